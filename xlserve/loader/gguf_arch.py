"""What a GGUF file does not store but llama.cpp fixes per architecture, as the Hugging Face
config keys our models read; and each architecture's tensor names.

``CONFIGS[arch](meta, cfg, names)`` returns the keys to add to the generic config built by
``GGUFFile.hf_config`` (``names``: the file's tensor names). The constants below are the
ones llama.cpp's loader hard-codes (``llama-model.cpp``), so a file loads here as it runs
there.
"""

from __future__ import annotations

from typing import Callable

TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts: the router, every expert's projection stacked in one tensor, the shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_exps",
    "ffn_up_exps": "mlp.experts.up_exps",
    "ffn_down_exps": "mlp.experts.down_exps",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma 3 norms around attention and MLP (its ffn_norm is the pre-MLP norm, not Llama's post-attention one)
GEMMA_LAYER_TENSOR_NAMES = {**LAYER_TENSOR_NAMES, "post_attention_norm": "post_attention_layernorm",
                            "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# gpt-oss: the pre-MLP norm keeps Llama's meaning under Gemma's name; the sinks are a per-head vector
GPT_OSS_LAYER_TENSOR_NAMES = {**LAYER_TENSOR_NAMES, "post_attention_norm": "post_attention_layernorm",
                              "attn_sinks": "self_attn.sinks"}
# DeepSeek-V2/V3 and Kimi K2: multi-head latent attention; the router's score correction is a
# parameter (a name ending "_bias" is a whole parameter name, not a module). Newer converters
# store kv_b_proj split per head as attn_k_b (transposed) and attn_v_b: ``GGUFFile`` joins them.
DEEPSEEK_LAYER_TENSOR_NAMES = {**LAYER_TENSOR_NAMES, "attn_q_a": "self_attn.q_a_proj",
                               "attn_q_b": "self_attn.q_b_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                               "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                               "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                               "exp_probs_b": "mlp.gate.e_score_correction_bias"}
LAYER_NAMES_BY_ARCH = {"gemma3": GEMMA_LAYER_TENSOR_NAMES, "gpt-oss": GPT_OSS_LAYER_TENSOR_NAMES,
                       "deepseek2": DEEPSEEK_LAYER_TENSOR_NAMES}


def _gpt_oss(meta: dict, cfg: dict, names: set) -> dict:
    """Sliding windows on every other layer from the first, biases everywhere, and YaRN as
    the reference runs it (no truncation of the ramp)."""
    layers = cfg["num_hidden_layers"]
    scaling = {}
    if meta.get("gpt-oss.rope.scaling.type") == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(meta["gpt-oss.rope.scaling.factor"]), "truncate": False,
                   "original_max_position_embeddings": int(meta["gpt-oss.rope.scaling.original_context_length"])}
    return {"model_type": "gpt_oss", "attention_bias": True, "rope_scaling": scaling,
            "sliding_window": int(meta["gpt-oss.attention.sliding_window"]),
            "layer_types": ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)]}


def _gemma3(meta: dict, cfg: dict, names: set) -> dict:
    """Every sixth layer global, the others sliding with rotary base 10,000; queries scaled by
    1/sqrt(head_dim), except the 27B (62 layers) which uses 1/sqrt(hidden / heads)."""
    scaling = {}
    if meta.get("gemma3.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta["gemma3.rope.scaling.factor"])}
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if cfg["num_hidden_layers"] == 62 else cfg["head_dim"]
    return {"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": int(meta["gemma3.attention.sliding_window"]), "sliding_window_pattern": 6,
            "rope_local_base_freq": 10000.0, "rope_scaling": scaling, "query_pre_attn_scalar": scalar}


def _deepseek2(meta: dict, cfg: dict, names: set) -> dict:
    """MLA sizes (the file stores the attention as one-KV-head MQA of latent width; the per-head
    sizes are the ``_mla`` lengths in newer files), the sigmoid grouped router, and YaRN whose
    softmax scale llama.cpp keeps as 0.1 x mscale_all_dim."""
    a = "deepseek2."
    rope = int(meta[a + "rope.dimension_count"])
    mla = a + "attention.key_length_mla" in meta
    key = int(meta[a + ("attention.key_length_mla" if mla else "attention.key_length")])
    value = int(meta[a + ("attention.value_length_mla" if mla else "attention.value_length")])
    if int(meta.get(a + "expert_gating_func") or 1) != 2:  # 1: softmax (DeepSeek-V2), 2: sigmoid
        raise ValueError("GGUF deepseek2 with softmax expert gating (DeepSeek-V2) is not supported; supported: "
                         "sigmoid gating with the bias-corrected grouped top-k (DeepSeek-V3, Kimi K2)")
    scaling = {}
    if meta.get(a + "rope.scaling.type") == "yarn":
        mscale = float(meta.get(a + "rope.scaling.yarn_log_multiplier") or 0.0) / 0.1
        scaling = {"rope_type": "yarn", "factor": float(meta[a + "rope.scaling.factor"]),
                   "original_max_position_embeddings": int(meta[a + "rope.scaling.original_context_length"]),
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale}
    return {"model_type": "deepseek_v3", "num_key_value_heads": cfg["num_attention_heads"], "head_dim": None,
            "kv_lora_rank": int(meta[a + "attention.kv_lora_rank"]),
            "q_lora_rank": int(meta.get(a + "attention.q_lora_rank") or 0),
            "qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope, "v_head_dim": value,
            "n_routed_experts": int(meta[a + "expert_count"]), "n_shared_experts": int(meta[a + "expert_shared_count"]),
            "first_k_dense_replace": int(meta[a + "leading_dense_block_count"]),
            "n_group": int(meta.get(a + "expert_group_count") or 1),
            "topk_group": int(meta.get(a + "expert_group_used_count") or 1),
            "routed_scaling_factor": float(meta.get(a + "expert_weights_scale") or 1.0),
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_scaling": scaling, "rope_interleave": True}


def _llama4(meta: dict, cfg: dict, names: set) -> dict:
    """Chunks of 8,192 tokens on three layers of four, the fourth global without rotary and with
    query temperature (floor 8,192, scale 0.1); q/k L2 norm except on the 128-expert Maverick;
    MoE on the layers that have a router, each with an ungated shared expert."""
    layers = cfg["num_hidden_layers"]
    chunked = int(meta.get("llama4.attention.sliding_window", 8192)) != 0
    return {"model_type": "llama4_text", "intermediate_size_mlp": cfg["intermediate_size"],
            "intermediate_size": int(meta["llama4.expert_feed_forward_length"]),
            "attention_chunk_size": 8192 if chunked else None, "no_rope_layers": [
                int((i + 1) % 4 != 0) if chunked else 1 for i in range(layers)],
            "use_qk_norm": int(meta["llama4.expert_count"]) != 128, "attn_temperature_tuning": True,
            "floor_scale": 8192, "attn_scale": 0.1,
            "moe_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names]}


CONFIGS: dict[str, Callable[[dict, dict, set], dict]] = {
    "gemma3": _gemma3, "gpt-oss": _gpt_oss, "deepseek2": _deepseek2, "llama4": _llama4}
