"""GPTQ and AWQ checkpoints (integer codes with a scale and a zero point per group of inputs)
load and run as their dequantized weights do, kept in a block format wherever one holds the
values exactly. The tests pack codes as the quantizers' own packers lay them out (GPTQModel:
codes along the inputs, zero points along the outputs, v1 storing each zero point minus one;
AutoAWQ's GEMM layout: both along the outputs, nibbles interleaved), and the AWQ unpacking is
held to compressed-tensors' AutoAWQ converter."""

import math
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.unit.test_checkpoint_quantization import _same_as_reference, _write
from xlserve.kernels import gguf_blocks
from xlserve.kernels.gguf_blocks import BlockType, blocks_from_zero_point
from xlserve.layers.quantized import QuantizedWeight
from xlserve.loader.checkpoint_quantization import Awq, Gptq, checkpoint_quantization
from xlserve.planner.weights import Component, formats_from_config

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packer: nibble i holds output AWQ_PACK_ORDER[i] of eight


def _pack(codes: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """int32 words of ``codes`` packed along ``dim``, code i of a word at bits * i (``order``:
    which of the word's codes goes to nibble i)."""
    codes = codes.to(torch.int64).movedim(dim, -1)
    per_word = 32 // bits
    grouped = codes.reshape(*codes.shape[:-1], -1, per_word)
    if order is not None:
        grouped = grouped[..., list(order)]
    words = torch.zeros(grouped.shape[:-1], dtype=torch.int64)
    for i in range(per_word):
        words |= grouped[..., i] << (bits * i)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def _quantize(w: torch.Tensor, group: int, bits: int, symmetric: bool):
    """GPTQ / AWQ-style round-to-nearest: (codes [N, K], scales [N, G] float16, zeros [N, G])."""
    n, k = w.shape
    top = (1 << bits) - 1
    g = w.reshape(n, k // group, group)
    if symmetric:
        scale = (g.abs().amax(-1) / (top // 2)).clamp(min=1e-4)
        zero = torch.full_like(scale, (top + 1) // 2, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / top).clamp(min=1e-4)
        zero = torch.round(-lo / scale).to(torch.int64).clamp(0, top)
    scale = scale.to(torch.float16)
    codes = torch.round(g / scale.float().unsqueeze(-1)) + zero.unsqueeze(-1)
    return codes.clamp(0, top).to(torch.int64).reshape(n, k), scale, zero


def _gptq_tensors(base, w, group, bits=4, symmetric=True, v1=True, act_order=False):
    """A GPTQ linear's tensors, and the weight they stand for (the definition: scale * (code - zero))."""
    n, k = w.shape
    g_idx = torch.arange(k) // group
    if act_order:  # GPTQ's desc_act: inputs quantized in another order, so groups interleave
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(1))]
    order = torch.argsort(g_idx, stable=True)
    codes, scale, zero = _quantize(w[:, order], group, bits, symmetric)
    codes = codes[:, torch.argsort(order)]
    stored_zero = zero - 1 if v1 else zero
    tensors = {base + ".qweight": _pack(codes.T, bits, 0), base + ".qzeros": _pack(stored_zero.T, bits, 1),
               base + ".scales": scale.T.contiguous(), base + ".g_idx": g_idx.to(torch.int32)}
    return tensors, scale.float()[:, g_idx] * (codes - zero[:, g_idx]).float()


def _awq_tensors(base, w, group):
    codes, scale, zero = _quantize(w, group, 4, symmetric=False)
    tensors = {base + ".qweight": _pack(codes.T, 4, 1, AWQ_PACK_ORDER),
               base + ".qzeros": _pack(zero.T, 4, 1, AWQ_PACK_ORDER), base + ".scales": scale.T.contiguous()}
    groups = torch.arange(w.shape[1]) // group
    return tensors, scale.float()[:, groups] * (codes - zero[:, groups]).float()


def test_awq_unpacking_agrees_with_compressed_tensors():
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    w = torch.randn(48, 128)
    tensors, want = _awq_tensors("w", w, 32)
    fetch = tensors.__getitem__
    name, ours = Awq({"quant_method": "awq", "bits": 4, "group_size": 32}).dequantize(
        "w.qweight", tensors["w.qweight"], fetch)
    ints, scale, zero = AutoAWQConverter(group_size=32)._convert_gemm_module(
        tensors["w.qweight"], tensors["w.scales"], tensors["w.qzeros"])
    theirs = scale.float().repeat_interleave(32, 1) * (ints - zero.repeat_interleave(32, 1)).float()
    assert name == "w.weight" and torch.equal(ours, theirs) and torch.equal(ours, want)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("v1", [True, False], ids=["gptq-v1", "gptq-v2"])
def test_gptq_unpacking_follows_the_layout(bits, v1):
    w = torch.randn(16, 128)
    tensors, want = _gptq_tensors("w", w, 64, bits=bits, symmetric=False, v1=v1)
    config = {"quant_method": "gptq", "bits": bits, "group_size": 64, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    name, ours = Gptq(config).dequantize("w.qweight", tensors["w.qweight"], tensors.__getitem__)
    assert name == "w.weight" and torch.equal(ours, want)
    assert (ours - w).abs().max() <= tensors["w.scales"].float().max() * 0.51  # a quantization of w, not noise


def _blocks_hold(qtype, blocks, shape, want):
    from gguf.quants import dequantize as gguf_dequantize
    kept = QuantizedWeight.from_blocks(qtype, blocks, shape).dequantize(torch.float32)
    ggml = torch.from_numpy(gguf_dequantize(blocks.numpy(), int(qtype)).copy()).reshape(shape)
    return torch.equal(kept, want) and torch.equal(ggml, want)


def test_zero_point_weights_take_the_smallest_block_that_holds_them_exactly():
    torch.manual_seed(0)
    n, k = 8, 128
    codes = torch.randint(0, 16, (n, k))
    power_of_two = torch.tensor(2.0) ** torch.randint(-8, -2, (n, k // 32))  # s * z is a float16 for any z
    ragged = (torch.rand(n, k // 32) * 0.02 + 1e-3).to(torch.float16).float()  # s * z mostly is not
    cases = [(power_of_two, torch.full((n, k // 32), 8), BlockType.Q4_0),
             (power_of_two, torch.randint(0, 16, (n, k // 32)), BlockType.Q4_1),
             (ragged, torch.randint(1, 16, (n, k // 32)), BlockType.Q8_0)]
    for scale, zero, qtype in cases:
        got, blocks = blocks_from_zero_point(codes, scale, zero)
        want = scale.repeat_interleave(32, 1) * (codes - zero.repeat_interleave(32, 1)).float()
        assert got is qtype and blocks.shape == (n, gguf_blocks.row_bytes(qtype, k))
        assert _blocks_hold(qtype, blocks, (n, k), want)
    assert blocks_from_zero_point(codes, torch.full((n, k // 32), 1e-30), torch.zeros(n, k // 32)) is None
    assert blocks_from_zero_point(codes[:, :48], torch.ones(n, 1), torch.zeros(n, 1)) is None  # not whole blocks


def _quantized_llama(src: str, dst: str, linear, config: dict) -> tuple[str, dict]:
    """The tiny model with every projection quantized by ``linear(base, weight)``; the directory
    and the dequantized weights (the reference's)."""
    state, reference = {}, {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if name.endswith("_proj.weight"):
            tensors, reference[name] = linear(name.removesuffix(".weight"), t.float())
            state.update(tensors)
        else:
            state[name] = reference[name] = t
    return _write(src, dst, state, lambda c: {**c, "quantization_config": config}), reference


SETUPS = {  # name: (format, linear quantizer, config, the block type kept, or None: dequantized)
    "gptq-v1-symmetric": (lambda b, w: _gptq_tensors(b, w, 32), {"bits": 4, "group_size": 32, "sym": True},
                          BlockType.Q4_0),
    "gptq-8bit": (lambda b, w: _gptq_tensors(b, w, 64, bits=8), {"bits": 8, "group_size": 64, "sym": True},
                  BlockType.Q8_0),
    "gptq-v2-asymmetric": (lambda b, w: _gptq_tensors(b, w, 32, symmetric=False, v1=False),
                           {"bits": 4, "group_size": 32, "sym": False, "checkpoint_format": "gptq_v2"},
                           BlockType.Q8_0),
    "gptq-act-order": (lambda b, w: _gptq_tensors(b, w, 32, act_order=True),
                       {"bits": 4, "group_size": 32, "desc_act": True}, None),
    "awq": (lambda b, w: _awq_tensors(b, w, 32), {"bits": 4, "group_size": 32, "zero_point": True,
                                                  "version": "gemm"}, BlockType.Q8_0),
}


@pytest.mark.parametrize("quantization", ["auto", "none"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_checkpoint_runs_as_its_dequantized_weights(tiny_model_dirs, tmp_path, setup, quantization):
    """Logits and 24 greedy tokens as transformers on the dequantized weights; kept as stored
    where a block type holds the values (asymmetric float16 scales times their zero points are
    rarely float16 values, so those weights take Q8_0; act-order groups are not whole blocks)."""
    linear, config, kept_as = SETUPS[setup]
    method = "awq" if setup == "awq" else "gptq"
    torch.manual_seed(0)
    qdir, reference = _quantized_llama(tiny_model_dirs["llama"], str(tmp_path / "q"), linear,
                                       {"quant_method": method, **config})
    rdir = _write(tiny_model_dirs["llama"], str(tmp_path / "ref"), reference, lambda c: c)
    llm = _same_as_reference(qdir, rdir, quantization)
    weights = [m.weight for name, m in llm.engine.runner.model.named_modules()
               if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]
    assert len(weights) == 8
    kept = {p.qtype for w in weights if isinstance(w, QuantizedWeight) for p in w.parts}
    assert kept == ({kept_as} if quantization == "auto" and kept_as is not None else set())
    if quantization == "auto":  # `xlserve plan` counts the bytes the loader holds
        planned = formats_from_config({"quantization_config": {"quant_method": method, **config}}, "float32")
        assert sum(w.nbytes for w in weights) == sum(math.prod(w.shape) for w in weights) * \
            planned[Component.ATTENTION].bytes_per_param


def test_gptq_experts_are_kept_as_stored(tiny_model_dirs, tmp_path):
    """A Qwen3-MoE GPTQ checkpoint (experts quantized one linear each, the router left plain):
    each expert is Q4_0 blocks, and the model runs as its dequantized weights do."""
    from xlserve.layers.moe import SparseMoE
    src = tiny_model_dirs["qwen3_moe"]
    torch.manual_seed(0)
    qdir, reference = _quantized_llama(src, str(tmp_path / "q"), lambda b, w: _gptq_tensors(b, w, 32),
                                       {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True})
    rdir = _write(src, str(tmp_path / "ref"), reference, lambda c: c)
    llm = _same_as_reference(qdir, rdir)
    moes = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(m.kept_experts is not None for m in moes)
    kept = [w for m in moes for pair in m.kept_experts for w in pair]
    assert {p.qtype for w in kept for p in w.parts} == {BlockType.Q4_0}
    assert sum(w.nbytes for w in kept) == sum(w.shape.numel() for w in kept) * 18 // 32


def test_what_cannot_be_read_is_refused():
    def config(**q):
        return {"quantization_config": q}
    with pytest.raises(ValueError, match="3 bits"):
        checkpoint_quantization(config(quant_method="gptq", bits=3, group_size=128))
    with pytest.raises(ValueError, match="checkpoint_format"):
        checkpoint_quantization(config(quant_method="gptq", bits=4, checkpoint_format="marlin"))
    with pytest.raises(ValueError, match="GEMM"):
        checkpoint_quantization(config(quant_method="awq", bits=4, version="gemv"))
    with pytest.raises(ValueError, match="8 bits"):
        checkpoint_quantization(config(quant_method="awq", bits=8))
    tensors, _ = _gptq_tensors("w", torch.randn(16, 128), 64)
    tensors["w.scales"] = tensors["w.scales"][:1]  # one group's scales for two groups
    with pytest.raises(ValueError, match="do not make one weight"):
        Gptq({"bits": 4, "group_size": 64}).dequantize("w.qweight", tensors["w.qweight"], tensors.__getitem__)
