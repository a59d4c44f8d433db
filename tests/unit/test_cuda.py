"""The CUDA path: the same engine on a GPU gives the CPU's greedy tokens (skipped without one)."""

import pytest
import torch

from xlserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_cuda_greedy_matches_cpu(tiny_llama_dir):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [list(range(5, 40)), list(range(60, 75)), [7] * 50]
    cpu = LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_tokens=2048).generate(prompts, params)
    gpu = LLM(tiny_llama_dir, dtype="float32", device="cuda", kv_cache_tokens=2048).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]


def test_cuda_bf16_prefix_cache_and_sampling(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="bfloat16", device="cuda", kv_cache_tokens=2048)
    shared = list(range(10, 80))
    llm.generate(shared + [1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    out = llm.generate(shared + [2], SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True))[0]
    assert out.cached_tokens == 64 and len(out.outputs[0].token_ids) == 8
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_cuda_graphs_match_eager(tiny_llama_dir):
    """Decode steps replayed from CUDA graphs give the eager tokens: batches that shrink as
    requests finish (3 rows in a 4-row bucket beside a 300-token context, then 2 and 1 short
    ones); the padding rows leave the cache intact (a repeat hits it and agrees)."""
    prompts = [list(range(5, 40)), list(range(60, 80)), [(7 * i) % 300 + 3 for i in range(300)]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (30, 20, 10)]

    def run(cuda_graphs):
        llm = LLM(tiny_llama_dir, dtype="float32", device="cuda", kv_cache_tokens=4096, cuda_graphs=cuda_graphs)
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        again = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in again] == first
        assert all(o.cached_tokens > 0 for o in again)
        assert llm.engine.stats()["kv_blocks_used"] == 0
        return first, llm.engine.runner.graphs

    eager, no_graphs = run(False)  # graphs are the default on CUDA; this run is the reference
    replayed, graphs = run(True)
    assert no_graphs is None and {(4, 512), (2, 256), (1, 256)} <= set(graphs.graphs)
    assert replayed == eager


def test_cuda_graphs_sampling_and_long_context(tiny_llama_dir):
    """Seeded sampling reads the replayed logits like eager ones; a context beyond the largest
    bucket falls back to eager steps."""
    llm = LLM(tiny_llama_dir, dtype="float32", device="cuda", kv_cache_tokens=4096)
    eager = LLM(tiny_llama_dir, dtype="float32", device="cuda", kv_cache_tokens=4096, cuda_graphs=False)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    prompt = list(range(3, 50))
    want = eager.generate(prompt, params)[0].outputs[0].token_ids
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == want
    assert llm.engine.runner.graphs.supports(64, 512) and not llm.engine.runner.graphs.supports(65, 10)
