"""GGUF files of DeepSeek-V3 / Kimi K2 (llama.cpp's ``deepseek2``) and Llama 4, written as
llama.cpp's converter writes them, load to the same model as the safetensors of the same
weights: MLA with kv_b_proj whole (older files) or split per head for the absorbed path
(newer), the grouped sigmoid router with its score correction, shared experts, YaRN; Llama 4's
fused experts, its chunked / global layer pattern and Llama 3 rope factors."""

import json
import os

import numpy as np
import pytest
import torch

from tests.unit.gguf_writing import add_header, finish, gguf_writer, llama3_rope_factors
from xlserve import LLM, SamplingParams
from xlserve.layers.rotary import _inv_freq
from xlserve.loader.gguf_file import GGUFFile
from xlserve.models.arch import ModelArch

COMMON = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
              eos_token_id=2)
# what llama.cpp's names are for the checkpoint's (both families)
PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_a_proj": "attn_q_a", "self_attn.q_b_proj": "attn_q_b",
         "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
         "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
         "mlp.shared_experts.down_proj": "ffn_down_shexp", "mlp.router": "ffn_gate_inp",
         "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
         "mlp.shared_expert.down_proj": "ffn_down_shexp"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def _tiny(tmp_path, cfg) -> str:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # widen the small random init so logits are far from ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path)
    return str(tmp_path)


def _load(hf_dir: str) -> tuple[dict, ModelArch, dict]:
    from safetensors.torch import load_file
    cfg = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    return cfg, ModelArch.from_hf_config(cfg), load_file(os.path.join(hf_dir, "model.safetensors"))


def _header(w, cfg: dict, arch: ModelArch, ff: int, kv_heads: int) -> None:
    add_header(w, cfg, feed_forward_length=ff, head_count_kv=kv_heads, rope_freq_base=arch.rope_theta,
               vocab_size=arch.vocab_size, expert_count=arch.num_experts,
               expert_used_count=arch.num_experts_per_tok, expert_feed_forward_length=arch.moe_intermediate_size)


def _gguf_name(name: str) -> str:
    if name in TOP:
        return TOP[name]
    _, _, layer, rest = name.split(".", 3)
    if rest.endswith("e_score_correction_bias"):
        return f"blk.{layer}.exp_probs_b.bias"
    return f"blk.{layer}.{PARTS[rest.rsplit('.', 1)[0].replace('feed_forward.', 'mlp.')]}.weight"


def _write_deepseek(hf_dir: str, out: str, split_kv_b: bool, expert_types: dict | None = None) -> None:
    """``expert_types``: projection ("gate", "up", "down") -> the GGML type its stacked experts
    are stored in (quantized by gguf-py); float32 otherwise."""
    import gguf
    cfg, arch, state = _load(hf_dir)
    w = gguf_writer(out, "deepseek2", arch.vocab_size)
    _header(w, cfg, arch, arch.intermediate_size, 1)  # MLA as one-KV-head MQA
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_q_lora_rank(arch.q_lora_rank)
    w.add_kv_lora_rank(arch.kv_lora_rank)
    if split_kv_b:
        w.add_key_length(arch.kv_lora_rank + arch.head_dim)
        w.add_value_length(arch.kv_lora_rank)
        w.add_key_length_mla(arch.qk_nope_head_dim + arch.head_dim)
        w.add_value_length_mla(arch.v_head_dim)
    else:
        w.add_key_length(arch.qk_nope_head_dim + arch.head_dim)
        w.add_value_length(arch.v_head_dim)
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_rope_dimension_count(arch.head_dim)
    scaling = arch.rope_scaling_dict
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(scaling["factor"])
    w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
    experts: dict[tuple, dict] = {}
    for name, t in state.items():
        arr = t.float().numpy()
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.gate_proj.weight
            _, _, layer, _, _, e, proj, _ = name.split(".")
            experts.setdefault((layer, proj), {})[int(e)] = arr
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            layer = name.split(".")[2]
            kv_b = arr.reshape(arch.num_heads, arch.qk_nope_head_dim + arch.v_head_dim, -1)
            w.add_tensor(f"blk.{layer}.attn_k_b.weight",
                         np.ascontiguousarray(kv_b[:, :arch.qk_nope_head_dim].transpose(0, 2, 1)))
            w.add_tensor(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, arch.qk_nope_head_dim:]))
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(arr))
    for (layer, proj), by_expert in experts.items():
        stacked = np.ascontiguousarray(np.stack([by_expert[e] for e in sorted(by_expert)]))
        qtype = (expert_types or {}).get(proj.removesuffix("_proj"))
        if qtype is not None:
            stacked = gguf.quants.quantize(stacked, gguf.GGMLQuantizationType(qtype))
        w.add_tensor(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", stacked,
                     raw_dtype=None if qtype is None else gguf.GGMLQuantizationType(qtype))
    finish(w)


def _write_llama4(hf_dir: str, out: str) -> None:
    """Fused gate_up experts ([experts, hidden, 2 x inter]) split and transposed to
    output-major, down transposed; q/k not permuted (Llama 4 rotates adjacent pairs)."""
    cfg, arch, state = _load(hf_dir)
    w = gguf_writer(out, "llama4", arch.vocab_size)
    _header(w, cfg, arch, cfg["intermediate_size_mlp"], arch.num_kv_heads)
    w.add_key_length(arch.head_dim)
    w.add_value_length(arch.head_dim)
    w.add_interleave_moe_layer_step(cfg["interleave_moe_layer_step"])
    w.add_tensor("rope_freqs.weight", llama3_rope_factors(arch.rope_scaling_dict, arch.head_dim, arch.rope_theta))
    for name, t in state.items():
        arr = t.float().numpy()
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("experts.gate_up_proj"):
            gate, up = np.split(arr.transpose(0, 2, 1), 2, axis=1)
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
        elif name.endswith("experts.down_proj"):
            w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", np.ascontiguousarray(arr.transpose(0, 2, 1)))
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(arr))
    finish(w)


def _same_greedy(hf_dir: str, gguf_path: str) -> None:
    """The same tokens, each with the same log-probability, for a long and a short prompt
    batched together."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [list(range(10, 40)), list(range(100, 107))]
    a = LLM(hf_dir, dtype="float32", kv_cache_tokens=1024).generate(prompts, params)
    b = LLM(gguf_path, dtype="float32", kv_cache_tokens=1024).generate(prompts, params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        np.testing.assert_allclose([s["logprob"] for s in x.outputs[0].logprobs],
                                   [s["logprob"] for s in y.outputs[0].logprobs], atol=1e-4)


def tiny_deepseek(tmp_path) -> str:
    """A tiny DeepSeek-V3 checkpoint (random weights, saved by transformers): its directory."""
    from transformers import DeepseekV3Config
    cfg = DeepseekV3Config(**{**COMMON, "num_hidden_layers": 3, "intermediate_size": 128},
                           moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
                           n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
                           kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24,
                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 0.7, "mscale_all_dim": 0.7,
                                         "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1})
    return _tiny(tmp_path / "hf", cfg)


@pytest.mark.parametrize("split_kv_b", [False, True])
def test_deepseek2_gguf_matches_safetensors(tmp_path, split_kv_b):
    hf_dir = tiny_deepseek(tmp_path)
    out = str(tmp_path / "deepseek.gguf")
    _write_deepseek(hf_dir, out, split_kv_b)
    got = ModelArch.from_hf_config(GGUFFile(out).hf_config())
    want = ModelArch.from_hf_config(json.loads(open(os.path.join(hf_dir, "config.json")).read()))
    for field in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "head_dim", "router", "n_group",
                  "topk_group", "routed_scaling_factor", "mlp_only_layers", "shared_expert_intermediate_size"):
        assert getattr(got, field) == getattr(want, field), field
    _same_greedy(hf_dir, out)


def test_deepseek2_gguf_with_softmax_gating_is_refused(tmp_path):
    cfg = {"general.architecture": "deepseek2", "deepseek2.expert_gating_func": 1}
    from xlserve.loader.gguf_arch import CONFIGS
    with pytest.raises(ValueError, match="softmax expert gating"):
        CONFIGS["deepseek2"]({**cfg, "deepseek2.rope.dimension_count": 16, "deepseek2.attention.key_length": 48,
                              "deepseek2.attention.value_length": 24}, {"num_attention_heads": 4}, set())


def test_llama4_gguf_matches_safetensors(tmp_path):
    """What llama.cpp fixes for Llama 4 (chunks of 8,192, every fourth layer global with query
    temperature floor 8,192 and scale 0.1, q/k L2 norm below 128 experts) is what the
    checkpoint's config says here."""
    from transformers import Llama4TextConfig
    cfg = Llama4TextConfig(**{**COMMON, "num_hidden_layers": 4, "num_key_value_heads": 2, "intermediate_size": 32},
                           intermediate_size_mlp=128, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                           interleave_moe_layer_step=2, attention_chunk_size=8192, no_rope_layers=[1, 1, 1, 0],
                           use_qk_norm=True, floor_scale=8192, attn_scale=0.1, attn_temperature_tuning=True,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    hf_dir = _tiny(tmp_path / "hf", cfg)
    out = str(tmp_path / "llama4.gguf")
    _write_llama4(hf_dir, out)
    got = ModelArch.from_hf_config(GGUFFile(out).hf_config())
    want = ModelArch.from_hf_config(json.loads(open(os.path.join(hf_dir, "config.json")).read()))
    for field in ("layer_windows", "nope_layers", "nope_floor_scale", "nope_attn_scale", "qk_l2_norm",
                  "mlp_only_layers", "decoder_sparse_step", "router", "intermediate_size", "moe_intermediate_size"):
        assert getattr(got, field) == getattr(want, field), field
    _same_greedy(hf_dir, out)


def test_rope_frequency_factors_equal_llama3_scaling():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    factors = llama3_rope_factors(scaling, 128, 500000.0)
    assert ((factors > 1) & (factors < 8)).sum() >= 3  # the smoothed band is exercised
    torch.testing.assert_close(_inv_freq(128, 500000.0, {"rope_type": "freq_factors", "factors": tuple(factors)}),
                               _inv_freq(128, 500000.0, scaling), rtol=1e-6, atol=0)
