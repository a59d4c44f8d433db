"""Quantized checkpoints as the largest families publish them load dequantized and run as the
reference runs their dequantized weights: DeepSeek-V3 / Kimi K2 in FP8 blocks, gpt-oss with
MXFP4 experts, Kimi K2.5 (its ``KimiK25ForConditionalGeneration`` wrapper) with INT4
pack-quantized experts. Each reference dequantization comes from the format's own code
(the block definition, transformers' MXFP4 conversion, the compressed-tensors package)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.unit.test_hf_parity import _hf_greedy, _hf_model, _xl_logits
from xlserve import LLM, SamplingParams
from xlserve.loader.checkpoint_quantization import FP4_VALUES, Fp8Blocks, checkpoint_quantization
from xlserve.loader.safetensors_dir import SafetensorsDir


def _write(src: str, dst: str, state: dict, config_edit) -> str:
    os.makedirs(dst, exist_ok=True)
    cfg = json.loads(open(os.path.join(src, "config.json")).read())
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config_edit(cfg), f)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), dst)
    return dst


def _same_as_reference(quantized: str, reference: str, quantization: str = "auto") -> LLM:
    """Logits within 1e-4 of the reference's largest and 24 greedy tokens equal; the engine."""
    ids = torch.randint(3, 320, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    hf = _hf_model(reference)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    llm = LLM(quantized, dtype="float32", kv_cache_tokens=1024, quantization=quantization)
    ours = _xl_logits(llm, ids)
    assert (ours - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    out = llm.generate(ids[:10], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == _hf_greedy(hf, ids[:10], 24)
    return llm


def _fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    scale = torch.empty(-(-rows // block), -(-cols // block))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max() / 448
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _fp8_dequantized(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """The definition: element (i, j) times the scale of block (i // block, j // block)."""
    rows, cols = q.shape
    i = torch.arange(rows)[:, None] // block
    j = torch.arange(cols)[None, :] // block
    return q.float() * scale[i, j]


def test_fp8_partial_blocks_follow_the_definition_and_bad_scales_are_refused():
    w = torch.randn(40, 72)
    q, scale = _fp8_blocks(w, 32)  # 2 x 3 blocks, the last row and column of blocks partial
    fmt = Fp8Blocks({"weight_block_size": [32, 32]})
    name, plain = fmt.dequantize("x.weight", q, {"x.weight_scale_inv": scale}.__getitem__)
    assert name == "x.weight" and torch.equal(plain, _fp8_dequantized(q, scale, 32))
    assert (plain - w).abs().max() <= 0.07 * w.abs().max()  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match="expected"):
        fmt.dequantize("x.weight", q, {"x.weight_scale_inv": scale[:1]}.__getitem__)
    with pytest.raises(ValueError, match="not supported"):
        checkpoint_quantization({"quantization_config": {"quant_method": "hqq"}})


def test_deepseek_v3_fp8_checkpoint(tiny_model_dirs, tmp_path):
    """FP8 like DeepSeek-V3's release: every decoder projection but the router in float8 with
    float32 block scales (blocks of 32: partial blocks on the 48-wide latent projections)."""
    src = tiny_model_dirs["deepseek_v3"]
    quantized, reference = {}, {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if t.dim() == 2 and ".layers." in name and not name.endswith("mlp.gate.weight"):
            q, scale = _fp8_blocks(t.float(), 32)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            reference[name] = _fp8_dequantized(q, scale, 32)
        else:
            quantized[name] = reference[name] = t
    q_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32], "activation_scheme": "dynamic"}
    qdir = _write(src, str(tmp_path / "fp8"), quantized, lambda c: {**c, "quantization_config": q_config})
    rdir = _write(src, str(tmp_path / "ref"), reference, lambda c: c)
    assert SafetensorsDir(qdir).num_tensors == len(reference)  # the scales are not counted as tensors to load
    _same_as_reference(qdir, rdir)


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[experts, rows, cols] -> blocks [experts, rows, cols / 32, 16], scales [experts, rows, cols / 32]:
    a power-of-two scale per 32 values, each value the nearest FP4 code (low nibble first)."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-12) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # [..., groups, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_checkpoint(tiny_model_dirs, tmp_path):
    """MXFP4 experts as gpt-oss publishes them, against transformers' own dequantization."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    src = tiny_model_dirs["gpt_oss"]
    quantized, reference = {}, {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [experts, in, out]
            blocks, scales = _mxfp4(t.float().transpose(1, 2))
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            reference[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            quantized[name] = reference[name] = t
    q_config = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.embed_tokens",
                                                                    "lm_head", "model.layers.*.mlp.router"]}
    qdir = _write(src, str(tmp_path / "mxfp4"), quantized, lambda c: {**c, "quantization_config": q_config})
    rdir = _write(src, str(tmp_path / "ref"), reference, lambda c: c)
    ours = dict(SafetensorsDir(qdir).weights(torch.float32))
    for name, t in reference.items():
        assert torch.equal(ours[name], t.float()), name
    _same_as_reference(qdir, rdir)


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_kimi_k25_int4_checkpoint(tiny_model_dirs, tmp_path, quantization):
    """Kimi K2.5's layout: the DeepSeek-V3 language model under ``language_model.`` beside a
    vision tower and projector, routed experts in symmetric INT4 with a scale per 32 inputs,
    packed by compressed-tensors; everything else in its ``ignore`` list, unquantized. Kept
    as stored (auto), each expert is Q4_0 blocks: 18 bytes per 32 weights."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    from xlserve.kernels.gguf_blocks import BlockType
    from xlserve.layers.moe import SparseMoE
    src = tiny_model_dirs["deepseek_v3"]
    reference = {}
    quantized = {"vision_tower.patch.weight": torch.randn(4, 4), "mm_projector.proj.weight": torch.randn(4, 4)}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.gate_proj.weight
            w = t.float()
            scale = (w.reshape(w.shape[0], -1, 32).abs().amax(-1) / 7).to(torch.bfloat16)
            ints = torch.round(w / scale.float().repeat_interleave(32, 1)).clamp(-8, 7).to(torch.int8)
            base = "language_model." + name.removesuffix(".weight")
            packed = pack_to_int32(ints, 4)
            quantized[base + ".weight_packed"], quantized[base + ".weight_scale"] = packed, scale
            quantized[base + ".weight_shape"] = torch.tensor(w.shape)
            unpacked = unpack_from_int32(packed, 4, torch.Size(w.shape))
            reference[name] = unpacked.float() * scale.float().repeat_interleave(32, 1)
        else:
            quantized["language_model." + name] = reference[name] = t
    q_config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]}

    def k25(cfg: dict) -> dict:
        return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                "text_config": cfg, "vision_config": {"hidden_size": 4}, "quantization_config": q_config}
    qdir = _write(src, str(tmp_path / "k25"), quantized, k25)
    rdir = _write(src, str(tmp_path / "ref"), reference, lambda c: c)
    llm = _same_as_reference(qdir, rdir, quantization)
    moes = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    assert moes and all((m.kept_experts is not None) == (quantization == "auto") for m in moes)
    if quantization == "auto":
        kept = [w for m in moes for pair in m.kept_experts for w in pair]
        assert {p.qtype for w in kept for p in w.parts} == {BlockType.Q4_0}
        assert sum(w.nbytes for w in kept) == sum(w.shape.numel() for w in kept) * 18 // 32
        assert not hasattr(moes[0], "w_gate_up")  # the dense stacked tensors are gone


def test_packed_int4_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="format"):
        checkpoint_quantization({"quantization_config": {"quant_method": "compressed-tensors", "format": "marlin-24"}})
    asym = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}
    with pytest.raises(ValueError, match="symmetric"):
        checkpoint_quantization({"quantization_config": {"quant_method": "compressed-tensors",
                                                         "format": "pack-quantized",
                                                         "config_groups": {"g": {"weights": asym}}}})
