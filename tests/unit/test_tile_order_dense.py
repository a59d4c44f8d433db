"""The dense AMX tile kernel's twin without AMX (``gemm_tile_order_dense.c``) computes the tiles'
bits: held to a torch model of the tile product's order on every CPU the AVX-512 kernels load
on, and to the tiles themselves where the CPU has them; so a bfloat16 model under
``--deterministic`` answers the same with and without AMX (a tiny model, capped below AMX in a
fresh process, bit for bit)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from xlserve.kernels import cpu_isa, cpu_ops

LIB = cpu_ops.kernels()
needs_kernels = pytest.mark.skipif(LIB is None, reason="no AVX-512 kernels here")
has_amx = pytest.mark.skipif(LIB is None or not cpu_ops.amx_ready(), reason="no AMX tiles here")


def _flushed(v: torch.Tensor) -> torch.Tensor:
    """bfloat16 values as fp32, denormals as zero (how the tiles take their inputs)."""
    f = v.float()
    return torch.where(f.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(f), f)


def tile_order_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 sums of x [M, K] @ w [N, K].T (bfloat16) in the tiles' order: per block of 32, the first
    products of the 16 pairs summed in pair order, the second ones apart, then C + (first +
    second), C carried across the blocks; + bias. Every product is exact in fp32, so each step is
    one fp32 addition."""
    xf, wf = _flushed(x), _flushed(w)
    c = torch.zeros(x.shape[0], w.shape[0])
    for k0 in range(0, x.shape[1], 32):
        first, second = torch.zeros_like(c), torch.zeros_like(c)
        for p in range(16):
            first = first + xf[:, k0 + 2 * p, None] * wf[None, :, k0 + 2 * p]
            second = second + xf[:, k0 + 2 * p + 1, None] * wf[None, :, k0 + 2 * p + 1]
        c = c + (first + second)
    return c if bias is None else c + bias.float()


def _twin(x: torch.Tensor, w: torch.Tensor, bias=None, residual=None, fp32: bool = False) -> torch.Tensor:
    m, n = x.shape[0], w.shape[0]
    out = torch.full((m, n), float("nan"), dtype=torch.float32 if fp32 else torch.bfloat16)
    LIB.xl_tile_order_dense(x.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(),
                            None if residual is None else residual.data_ptr(), None if fp32 else out.data_ptr(),
                            out.data_ptr() if fp32 else None, m, n, x.shape[1], n, torch.get_num_threads())
    return out


def _inputs(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4).bfloat16()
    x = (torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g) * 2)).bfloat16()
    x[0, :4] = torch.tensor([1e-39, -3e-39, 0.0, -0.0]).bfloat16()  # denormals: zero on the tiles
    w[1, :2] = torch.tensor([2e-39, -1e-40]).bfloat16()
    bias, residual = torch.randn(n, generator=g).bfloat16(), torch.randn(m, n, generator=g).bfloat16()
    return x, w, bias, residual


@needs_kernels
def test_the_twin_computes_the_tile_order_alone_batched_and_on_any_thread_count():
    """Against the torch model of the order, features as lanes (1-9 rows: passes of 8 and a part)
    and rows as lanes (19 and 300 rows: a part-filled group of 16, passes of 256), with the
    tiles' epilogue: + bias, rounded to bfloat16, + residual, rounded again."""
    x, w, bias, residual = _inputs(300, 64, 96, seed=5)
    for m in (1, 3, 8, 9, 19, 300):
        sums = tile_order_reference(x[:m], w, bias)
        assert torch.equal(_twin(x[:m], w, bias, fp32=True), sums)
        assert torch.equal(_twin(x[:m], w, bias), sums.bfloat16())
        with_residual = (sums.bfloat16().float() + residual[:m].float()).bfloat16()
        assert torch.equal(_twin(x[:m], w, bias, residual[:m]), with_residual)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_twin(x, w, fp32=True), tile_order_reference(x, w))
    finally:
        torch.set_num_threads(before)


@has_amx
@pytest.mark.parametrize("shape", [(96, 320), (576, 576), (64, 1536)])
def test_the_twin_and_the_tiles_give_the_same_bits(shape):
    """At every row count of a decode step and a prefill chunk, each epilogue (bf16 with and
    without bias and residual, the fp32 sums of the logits, fp32 activations rounded first);
    and the torch model of the order is the tiles' own."""
    n, k = shape
    x, w, bias, residual = _inputs(70, n, k, seed=n + k)
    for m in (1, 2, 7, 8, 9, 15, 16, 17, 33, 70):
        xm, rm = x[:m].contiguous(), residual[:m].contiguous()
        for b, r in ((None, None), (bias, None), (bias, rm), (None, rm)):
            tiles = cpu_ops.linear_amx(xm, w, b, r)
            assert torch.equal(tiles.view(torch.int16), _twin(xm, w, b, r).view(torch.int16)), (m, b is None, r is None)
        logits = torch.empty(m, n)
        LIB.xl_linear_amx_f32(xm.data_ptr(), w.data_ptr(), logits.data_ptr(), m, n, k, torch.get_num_threads())
        assert torch.equal(logits, _twin(xm, w, fp32=True))
        rows = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        dense = torch.empty(m, n)
        LIB.xl_linear_amx_dense(rows.data_ptr(), w.data_ptr(), dense.data_ptr(), m, n, k, n, torch.get_num_threads())
        assert torch.equal(dense, _twin(rows.bfloat16(), w, fp32=True))
    assert torch.equal(_twin(x[:9], w, fp32=True), tile_order_reference(x[:9], w))


ANSWERS = """
import json, sys
from xlserve import LLM, SamplingParams
from xlserve.kernels.invariant_linear import Kernel, kernel_of
llm = LLM(sys.argv[1], dtype="bfloat16", deterministic=True, kv_cache_tokens=1024)
weight = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.weight
assert kernel_of(weight) is Kernel.AMX, kernel_of(weight)
prompts = [[(7 * i + j) % 300 + 3 for j in range(3 + 9 * i)] for i in range(6)]
params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1),
          SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True, logprobs=1)]
outs = llm.generate(prompts, [params[i % 2] for i in range(len(prompts))])
print(json.dumps([[o.outputs[0].token_ids, [lp["logprob"] for lp in o.outputs[0].logprobs]] for o in outs]))
"""


@has_amx
def test_a_dense_model_answers_the_same_with_and_without_amx(tiny_llama_dir):
    """A bfloat16 model under --deterministic in two fresh processes: this CPU as it is (the
    tiles), and capped at an AMD Zen 4's instruction sets (XLSERVE_MAX_CPU_ISA=avx512-bf16: the
    twin): the same tokens and logprobs, greedy and seeded, bit for bit."""
    def answers(cap: str | None) -> list:
        env = {k: v for k, v in os.environ.items() if k != cpu_isa.MAX_CPU_ISA_ENV}
        if cap:
            env[cpu_isa.MAX_CPU_ISA_ENV] = cap
        run = subprocess.run([sys.executable, "-c", ANSWERS, tiny_llama_dir], env=env, capture_output=True,
                             text=True, check=True)
        return json.loads(run.stdout.strip().splitlines()[-1])
    with_amx, without = answers(None), answers("avx512-bf16")
    assert len({tuple(tokens) for tokens, _ in with_amx}) == 6
    assert without == with_amx
