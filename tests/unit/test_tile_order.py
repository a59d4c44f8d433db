"""The tile kernel's twin without AMX (``gemm_tile_order.c``) computes the AMX tiles' bits: held
to a torch model of the tile product's order on every AVX-512 CPU, and to the tiles themselves
where the CPU has them; so a bfloat16 model kept in Q4_0 / Q4_1 / Q8_0 answers the same with
and without AMX (the default model, capped below AMX in a fresh process, bit for bit)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.unit.test_quantized_weights import random_rows
from xlserve.kernels import cpu_isa, gguf_blocks, portable_library, quant_ops
from xlserve.kernels.gguf_blocks import INTERLEAVABLE, LAYOUTS, BlockType

BUILDS = {isa: portable_library.library(isa) for isa in portable_library.available_isas()}
TWINS = [isa for isa, lib in BUILDS.items() if lib is not None and lib.xl_tile_order_ready()
         and not lib.xl_amx_quant_ready()]
AMX = BUILDS.get(portable_library.ISA.AMX)
AMX_READY = AMX is not None and bool(AMX.xl_amx_quant_ready())
has_amx = pytest.mark.skipif(not AMX_READY, reason="no AMX tiles here")
QTYPES = [BlockType.Q4_0, BlockType.Q4_1, BlockType.Q8_0]
PAIRED = [0, 4, 1, 5, 2, 6, 3, 7]  # a Q4 block's pair 4j + t: values 8j + t and 8j + 4 + t


def _half(blocks: np.ndarray, at: int) -> torch.Tensor:
    return torch.from_numpy(blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32))


def _block_parts(qtype: BlockType, data: torch.Tensor, k: int):
    """Per weight row and block: the tile's weight values [n, blocks, 32] (Q4 1 + q / 16, Q8_0
    q), 16 d (Q8_0: d) and m - 16 d (Q8_0: 0), as the kernels form them in fp32."""
    blocks = data.numpy().reshape(data.shape[0], k // 32, LAYOUTS[qtype].bytes)
    d = _half(blocks, 0)
    if qtype is BlockType.Q8_0:
        q = torch.from_numpy(blocks[..., 2:34].copy().view(np.int8).astype(np.float32))
        return q, d, torch.zeros_like(d)
    nibbles = blocks[..., 4:20] if qtype is BlockType.Q4_1 else blocks[..., 2:18]
    q = torch.from_numpy(np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.float32))
    d16 = d * 16
    m = _half(blocks, 2) if qtype is BlockType.Q4_1 else d16 * -0.5
    return 1 + q / 16, d16, m - d16


def _reduce_add(v: torch.Tensor) -> torch.Tensor:
    """The 32 values' sum in the kernels' order (lanes of two 16-wide halves, then GCC's
    _mm512_reduce_add_ps tree), fp32 at every step."""
    t = v[..., :16] + v[..., 16:]
    t = t[..., :8] + t[..., 8:]
    t = t[..., :4] + t[..., 4:]
    t = t[..., :2] + t[..., 2:]
    return t[..., 0] + t[..., 1]


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once (float64 holds the product exactly; a sum needing more than
    53 bits rounds twice, which these fixed inputs do not hit)."""
    return (a.double() * b.double() + c.double()).float()


def tile_order_reference(qtype: BlockType, data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [m, k] (bfloat16 values) @ the weights as the AMX tile kernel computes it: per block,
    the first values of the pairs' products summed in pair order, the second values' likewise,
    the two added to a zero; then acc = fma(16 d, that, acc) and (Q4) fma(m - 16 d, the block's
    sum of x, acc), block after block."""
    n, k = data.shape[0], x.shape[1]
    w, d16, c = _block_parts(qtype, data, k)  # [n, blocks, 32], [n, blocks]
    xb = x.view(x.shape[0], k // 32, 32)  # [m, blocks, 32]
    if qtype is BlockType.Q8_0:
        first_idx, second_idx = list(range(0, 32, 2)), list(range(1, 32, 2))
    else:
        order = [8 * j + PAIRED[i] for j in range(4) for i in range(8)]
        first_idx, second_idx = order[0::2], order[1::2]
    acc = torch.zeros(x.shape[0], n)
    for b in range(k // 32):
        sums = []
        for idx in (first_idx, second_idx):
            chain = torch.zeros(x.shape[0], n)
            for v in idx:  # every product exact: one fp32 rounding a step
                chain = chain + xb[:, b, v:v + 1] * w[:, b, v].unsqueeze(0)
            sums.append(chain)
        tile = torch.zeros(()) + (sums[0] + sums[1])
        acc = _fma(d16[:, b].unsqueeze(0), tile, acc)
        if qtype is not BlockType.Q8_0:
            acc = _fma(c[:, b].unsqueeze(0), _reduce_add(xb[:, b]).unsqueeze(1), acc)
    return acc


def _product(lib, qtype: BlockType, data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    out = torch.full((x.shape[0], data.shape[0]), float("nan"))
    quant_ops.linear(lib, INTERLEAVABLE[qtype], x, gguf_blocks.interleave16(qtype, data), out, 0, False)
    return out


@pytest.mark.skipif(not TWINS, reason="no AVX-512 build with AVX512BW here")
@pytest.mark.parametrize("qtype", QTYPES)
def test_the_twin_computes_the_tile_order_alone_and_batched(qtype):
    """Against the torch model of the order, 1 to 19 rows (passes of 8 and a part); a row the
    same bits alone and in any batch, on one thread or two."""
    lib, n, k = BUILDS[TWINS[0]], 32, 192
    data = random_rows(qtype, n, k, seed=7 + int(qtype))
    x = torch.randn(19, k).bfloat16().float()
    for m in (1, 3, 8, 19):
        assert torch.equal(_product(lib, qtype, data, x[:m]), tile_order_reference(qtype, data, x[:m]))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_product(lib, qtype, data, x), tile_order_reference(qtype, data, x))
    finally:
        torch.set_num_threads(before)


@has_amx
@pytest.mark.parametrize("qtype", QTYPES)
def test_the_twin_and_the_tiles_give_the_same_bits(qtype):
    """The model of the order is the tiles' own (held against them here), and the twin's bits are
    the tiles' at every row count of the default model's shapes; fp32 activations are rounded
    to bfloat16 alike (denormals to zero, as vcvtneps2bf16 does)."""
    n, k = 64, 576
    data = random_rows(qtype, n, k, seed=11 + int(qtype))
    x = torch.randn(70, k)
    x[0, :5] = torch.tensor([1e-39, -3e-39, 1e-45, 0.0, -0.0])
    tiles = _product(AMX, qtype, data, x)
    for isa in TWINS:
        for m in (1, 2, 7, 8, 9, 16, 17, 33, 70):
            assert torch.equal(_product(BUILDS[isa], qtype, data, x[:m]), tiles[:m]), (isa, m)
    xb = x[:9].bfloat16().float()
    assert torch.equal(_product(AMX, qtype, data[:32], xb), tile_order_reference(qtype, data[:32], xb))


TILE_ORDER_BUILDS = ([portable_library.ISA.AMX] if AMX_READY else []) + TWINS


@pytest.mark.skipif(not TILE_ORDER_BUILDS, reason="no AVX-512 build with AVX512BW here")
@pytest.mark.parametrize("qtype", QTYPES)
def test_every_block_pair_count_in_the_tile_order(qtype):
    """Up to 16 rows the tile kernel makes block pair p + 1's B tiles and scales pair p - 1 while
    pair p's products run: one pair (k 64), two, three, an even and an odd count, each at 1 and
    5 rows, against the model of the order; the tiles where the CPU has them, their twin on
    every AVX-512 CPU."""
    n = 32
    for k in (64, 128, 192, 256, 576):
        data = random_rows(qtype, n, k, seed=k + int(qtype))
        x = torch.randn(5, k).bfloat16().float()
        for isa in TILE_ORDER_BUILDS:
            for m in (1, 5):
                assert torch.equal(_product(BUILDS[isa], qtype, data, x[:m]),
                                   tile_order_reference(qtype, data, x[:m])), (isa, k, m)


ANSWERS = """
import json
from xlserve import LLM, SamplingParams
llm = LLM("default", kv_cache_tokens=2048)
chats = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Write a haiku about the sea.",
         "Explain recursion in two sentences.")]
outs = llm.chat(chats, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1))
print(json.dumps([[o.outputs[0].token_ids, [lp["logprob"] for lp in o.outputs[0].logprobs]] for o in outs]))
"""


@has_amx
def test_the_default_model_answers_the_same_with_and_without_amx():
    """The default model as users get it (Q4_1 and Q8_0 kept, bfloat16), in two fresh processes:
    this CPU as it is, and capped at an AMD Zen 4's instruction sets (XLSERVE_MAX_CPU_ISA=
    avx512-bf16): the same tokens and the same logprobs, bit for bit."""
    def answers(cap: str | None) -> list:
        env = {k: v for k, v in os.environ.items() if k != cpu_isa.MAX_CPU_ISA_ENV}
        if cap:
            env[cpu_isa.MAX_CPU_ISA_ENV] = cap
        run = subprocess.run([sys.executable, "-c", ANSWERS], env=env, capture_output=True, text=True, check=True)
        return json.loads(run.stdout.strip().splitlines()[-1])
    with_amx, without = answers(None), answers("avx512-bf16")
    assert len({tuple(tokens) for tokens, _ in with_amx}) == 3
    assert without == with_amx
