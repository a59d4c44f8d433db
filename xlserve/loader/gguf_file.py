"""GGUF files: metadata -> Hugging Face style config, tensors -> dequantized weights.

The container is read by ``gguf_container``; dequantization uses the ``gguf`` package,
so every type it knows is supported.
llama.cpp stores Llama query/key weights permuted for its rope layout; they are
permuted back here so the model code sees the Hugging Face layout.
"""

from __future__ import annotations

import re
import struct
from typing import Iterator

import numpy as np
import torch

from xlserve.loader.gguf_container import TensorInfo, read_gguf, release, tensor_bytes
from xlserve.models.registry import GGUF_ARCHITECTURES, GGUF_MOE_ARCHITECTURES

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
    # mixture of experts: the router, and every expert's projection stacked in one tensor
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_exps",
    "ffn_up_exps": "mlp.experts.up_exps",
    "ffn_down_exps": "mlp.experts.down_exps",
}
# Gemma 3 norms around attention and MLP (its ffn_norm is the pre-MLP norm, not Llama's post-attention one)
GEMMA_LAYER_TENSOR_NAMES = {**LAYER_TENSOR_NAMES, "post_attention_norm": "post_attention_layernorm",
                            "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# gpt-oss: the pre-MLP norm keeps Llama's meaning under Gemma's name; the sinks are a per-head vector
GPT_OSS_LAYER_TENSOR_NAMES = {**LAYER_TENSOR_NAMES, "post_attention_norm": "post_attention_layernorm",
                              "attn_sinks": "self_attn.sinks"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFFile:
    def __init__(self, path: str):
        self.path = path
        try:
            self.meta, self.tensors, self._data = read_gguf(path)
        except (ValueError, OSError, struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read GGUF file {path!r} (corrupt or truncated?): {e}") from e

    def hf_config(self) -> dict:
        m = self.meta
        arch = m.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
        heads = int(m[f"{arch}.attention.head_count"])
        hidden = int(m[f"{arch}.embedding_length"])
        names = {t.name for t in self.tensors}
        cfg = {
            "architectures": [GGUF_ARCHITECTURES[arch]],
            "vocab_size": len(m.get("tokenizer.ggml.tokens") or []) or int(m[f"{arch}.vocab_size"]),
            "hidden_size": hidden,
            "intermediate_size": int(m[f"{arch}.feed_forward_length"]),
            "num_hidden_layers": int(m[f"{arch}.block_count"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(m.get(f"{arch}.attention.head_count_kv") or heads),
            "head_dim": int(m.get(f"{arch}.attention.key_length") or hidden // heads),
            "rms_norm_eps": float(m[f"{arch}.attention.layer_norm_rms_epsilon"]),
            "rope_theta": float(m.get(f"{arch}.rope.freq_base") or 10000.0),
            "max_position_embeddings": int(m.get(f"{arch}.context_length") or 4096),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": m.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": m.get("tokenizer.ggml.eos_token_id"),
        }
        experts = int(m.get(f"{arch}.expert_count") or 0)
        if experts:
            cfg.update(self._moe_config(arch, experts, names, cfg["num_hidden_layers"]))
        if arch == "gemma3":
            cfg.update(self._gemma3_config(cfg))
        if arch == "gpt-oss":
            cfg.update(self._gpt_oss_config(cfg))
        return cfg

    def _gpt_oss_config(self, cfg: dict) -> dict:
        """Sliding windows on every other layer from the first, biases everywhere, and YaRN as
        the reference runs it (no truncation of the ramp)."""
        m = self.meta
        layers = cfg["num_hidden_layers"]
        scaling = {}
        if m.get("gpt-oss.rope.scaling.type") == "yarn":
            scaling = {"rope_type": "yarn", "factor": float(m["gpt-oss.rope.scaling.factor"]), "truncate": False,
                       "original_max_position_embeddings": int(m["gpt-oss.rope.scaling.original_context_length"])}
        return {"model_type": "gpt_oss", "attention_bias": True, "rope_scaling": scaling,
                "sliding_window": int(m["gpt-oss.attention.sliding_window"]),
                "layer_types": ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)]}

    def _gemma3_config(self, cfg: dict) -> dict:
        """What llama.cpp fixes for Gemma 3 instead of storing: every sixth layer global, the
        others sliding with rotary base 10,000; queries scaled by 1/sqrt(head_dim), except
        the 27B (62 layers) which uses 1/sqrt(hidden / heads)."""
        m = self.meta
        scaling = {}
        if m.get("gemma3.rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(m["gemma3.rope.scaling.factor"])}
        scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if cfg["num_hidden_layers"] == 62 else cfg["head_dim"]
        return {"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
                "sliding_window": int(m["gemma3.attention.sliding_window"]), "sliding_window_pattern": 6,
                "rope_local_base_freq": 10000.0, "rope_scaling": scaling, "query_pre_attn_scalar": scalar}

    def _moe_config(self, arch: str, experts: int, names: set, layers: int) -> dict:
        """Experts from the metadata; which layers route from their tensors (a layer without a
        router is dense: Qwen MoE's ``mlp_only_layers``)."""
        m = self.meta
        dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
        size = int(m.get(f"{arch}.expert_feed_forward_length") or m[f"{arch}.feed_forward_length"])
        return {"architectures": [GGUF_MOE_ARCHITECTURES.get(arch, GGUF_ARCHITECTURES[arch])],
                "num_experts": experts, "num_experts_per_tok": int(m[f"{arch}.expert_used_count"]),
                "moe_intermediate_size": size, "mlp_only_layers": dense,
                "norm_topk_prob": bool(m.get(f"{arch}.expert_weights_norm", True))}

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize
        cfg = self.hf_config()
        permute = cfg["architectures"][0] in ("LlamaForCausalLM", "MixtralForCausalLM")  # llama.cpp's "llama"
        gemma = cfg.get("model_type") == "gemma3_text"
        layer_names = {"gemma3_text": GEMMA_LAYER_TENSOR_NAMES, "gpt_oss": GPT_OSS_LAYER_TENSOR_NAMES}.get(
            cfg.get("model_type"), LAYER_TENSOR_NAMES)
        for t in self.tensors:
            name = self._hf_name(t.name, layer_names)
            tensor = self._tensor(t, dequantize)
            release(self._data, t)
            if gemma and name.endswith("norm.weight"):  # llama.cpp stores Gemma's 1 + weight
                tensor = tensor.float() - 1
            if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
                key = "num_attention_heads" if "q_proj" in name else "num_key_value_heads"
                tensor = _unpermute_rope(tensor, cfg[key])
            yield name, tensor.to(dtype)

    def _tensor(self, t: TensorInfo, dequantize) -> torch.Tensor:
        from gguf import GGMLQuantizationType as Q
        raw = tensor_bytes(self._data, t)
        unquantized = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.int16}
        if t.qtype in unquantized:  # reinterpret the bytes, no float32 detour
            array = torch.from_numpy(np.array(raw).view(unquantized[t.qtype]))  # copy: the map is read-only
            if t.qtype == Q.BF16:
                array = array.view(torch.bfloat16)
            return array.reshape(t.shape)
        try:
            array = dequantize(raw, Q(t.qtype))
        except Exception as e:
            raise ValueError(f"cannot dequantize tensor {t.name} (type {t.qtype}) of {self.path!r}: {e}") from e
        return torch.from_numpy(np.array(array, dtype=np.float32)).reshape(t.shape)

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    @staticmethod
    def _hf_name(name: str, layer_names: dict) -> str:
        match = _LAYER_RE.match(name)
        if match:
            layer, part, kind = match.groups()
            if part not in layer_names:
                raise ValueError(f"GGUF tensor {name!r} is not understood")
            return f"model.layers.{layer}.{layer_names[part]}.{kind}"
        base, kind = name.rsplit(".", 1)
        if base not in TENSOR_NAMES:
            raise ValueError(f"GGUF tensor {name!r} is not understood")
        return f"{TENSOR_NAMES[base]}.{kind}"


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
