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
