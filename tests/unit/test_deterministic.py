"""``deterministic=True``: output that does not depend on the step a token is computed in —
alone or in a batch of mixed lengths, chunked, after a prefix hit, recomputed after
preemption, on one thread or two — bit for bit, in float32 and in bfloat16 (in the AMX tiles'
order and on the fp32 kernel), for every model family."""

import functools

import pytest
import torch

from xlserve import LLM, SamplingParams
from xlserve.kernels import cpu_ops, invariant_linear

PARAMS = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1),
          SamplingParams(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True, logprobs=1)]


def _prompts() -> list[list[int]]:
    return [[(7 * i + j) % 300 + 3 for j in range(3 + 9 * i)] for i in range(16)]


def _run(llm: LLM, prompts: list[list[int]], first: int = 0) -> list[tuple]:
    """Prompt i (counted from ``first``) greedy when i is even, sampled with a seed when odd."""
    outs = llm.generate(prompts, [PARAMS[(first + i) % 2] for i in range(len(prompts))])
    return [(tuple(o.outputs[0].token_ids), tuple(lp["logprob"] for lp in o.outputs[0].logprobs)) for o in outs]


# every family: windowed layers (gemma3's sliding, llama4's chunks, gpt-oss's sliding with sinks)
# and MoE routers and experts take the invariant kernels too
FAMILIES = ["llama", "llama3", "qwen2", "qwen3", "mistral", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe",
            "deepseek_v3", "llama4", "gpt_oss"]
SMALL_POOL = {"gemma3": 16, "llama4": 20}


# bfloat16 where the AVX-512 kernels load: the dense matmuls in the AMX tiles' order (on the tiles,
# or their twin without AMX), and again on the fp32 kernel of CPUs without AVX-512 (forced here;
# there the plain run takes it)
SETUPS = ["float32", "bfloat16"] + (["bfloat16-fp32-kernel"] if cpu_ops.kernels() is not None else [])


@pytest.mark.parametrize("dtype", SETUPS)
@pytest.mark.parametrize("name", FAMILIES)
def test_deterministic_output_does_not_depend_on_the_step(tiny_model_dirs, name, dtype, monkeypatch):
    if dtype == "bfloat16-fp32-kernel":
        monkeypatch.setattr(invariant_linear, "mark", functools.partial(invariant_linear.mark, tile_order=False))
        dtype = "bfloat16"
    path, prompts = tiny_model_dirs[name], _prompts()
    llm = LLM(path, dtype=dtype, deterministic=True, kv_cache_tokens=2048)
    batched = _run(llm, prompts)
    assert len({tokens for tokens, _ in batched}) > 8  # the prompts are answered differently
    assert [_run(llm, [p], i)[0] for i, p in enumerate(prompts[:4])] == batched[:4]  # alone, after prefix hits
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert _run(llm, prompts[4:8], 4) == batched[4:8]
    finally:
        torch.set_num_threads(before)
    # a pool that preempts; a window's layer group takes blocks of its own besides (gemma3, llama4)
    small = LLM(path, dtype=dtype, deterministic=True, num_kv_blocks=SMALL_POOL.get(name, 14),
                max_num_batched_tokens=16, enable_prefix_caching=False)
    assert _run(small, prompts[8:16], 8) == batched[8:16]  # chunked, and recomputed after preemption
    assert small.engine.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "llama4", "gpt_oss"])
def test_moe_routing_does_not_depend_on_the_batch_without_the_flag(tiny_model_dirs, name, dtype):
    """A token's experts and their weights are the same bits alone as in a batch of 37, with or
    without --deterministic: a MoE file whose other matmuls are kept quantized (a Qwen3-MoE or
    Mixtral GGUF: the router is its one dense matmul) is then batch-invariant without the flag."""
    from xlserve.layers.moe import SparseMoE
    llm = LLM(tiny_model_dirs[name], dtype=dtype, kv_cache_tokens=256)
    moe = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE))
    x = torch.randn(37, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(3)).to(getattr(torch, dtype))
    with torch.inference_mode():
        weights, experts = moe.gate(x)
        shared = moe._shared_gate(x) if moe.shared_expert_gate is not None else None  # Qwen2-MoE's
        for i in range(len(x)):
            alone = moe.gate(x[i:i + 1])
            assert torch.equal(alone[0][0], weights[i]) and torch.equal(alone[1][0], experts[i]), i
            assert shared is None or torch.equal(moe._shared_gate(x[i:i + 1])[0], shared[i]), i
