"""GGUF files: metadata -> Hugging Face style config, tensors -> weights.

The container is read by ``gguf_container``. Matmul weights in a block format with a
kernel (``kernels/gguf_blocks.py``: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) stay in it when
asked (``--quantization auto``); every other type is dequantized by the ``gguf`` package,
so every type it knows loads.
llama.cpp stores Llama query/key weights permuted for its rope layout; they are
permuted back here so the model code sees the Hugging Face layout.
"""

from __future__ import annotations

import logging
import re
import struct
from typing import Iterator

import numpy as np
import torch

from xlserve.kernels.gguf_blocks import X16, BlockType
from xlserve.layers.quantized import QuantizedExperts, QuantizedWeight
from xlserve.loader.gguf_arch import CONFIGS, LAYER_NAMES_BY_ARCH, LAYER_TENSOR_NAMES, TENSOR_NAMES
from xlserve.loader.gguf_container import TensorInfo, read_gguf, release, tensor_bytes
from xlserve.models.registry import GGUF_ARCHITECTURES, GGUF_MOE_ARCHITECTURES

log = logging.getLogger(__name__)
# as stored: the file formats (not xlserve's interleaved ones); BF16 only when asked: keep_bf16
KEPT_TYPES = {int(t) for t in BlockType if not t & X16} - {int(BlockType.BF16)}
UNQUANTIZED_TYPES = {0, 1, 30}  # ggml's F32, F16, BF16
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_ABSORBED_RE = re.compile(r"blk\.(\d+)\.attn_([kv])_b\.weight$")
ROPE_FREQS = "rope_freqs.weight"


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
        if arch in CONFIGS:
            cfg.update(CONFIGS[arch](m, cfg, names))
        if ROPE_FREQS in names:  # Llama 3.1 / 4 long-context scaling, stored as each frequency's divisor
            rope_freqs = next(t for t in self.tensors if t.name == ROPE_FREQS)
            factors = self._tensor(rope_freqs).float()
            cfg["rope_scaling"] = {"rope_type": "freq_factors", "factors": tuple(factors.tolist())}
        return cfg

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

    def weights(self, dtype: torch.dtype, keep_quantized: bool = False, keep_bf16: bool = False
                ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(name, tensor) in the Hugging Face layout; with ``keep_quantized``, matmul weights
        in a kept block format come as ``QuantizedWeight`` (a layer that cannot hold one
        dequantizes it), BF16 ones too with ``keep_bf16``."""
        cfg = self.hf_config()
        dequantized: dict[str, int] = {}  # block formats without a kernel: type -> tensors
        permute = cfg["architectures"][0] in ("LlamaForCausalLM", "MixtralForCausalLM")  # llama.cpp's "llama"
        arch = self.meta["general.architecture"]
        layer_names = LAYER_NAMES_BY_ARCH.get(arch, LAYER_TENSOR_NAMES)
        absorbed: dict[str, torch.Tensor] = {}  # MLA's per-head halves of kv_b_proj, until both are read
        for t in self.tensors:
            if t.name == ROPE_FREQS:  # already in the config
                continue
            tensor = self._read(t, keep_quantized, dequantized, keep_bf16)
            release(self._data, t)
            if _ABSORBED_RE.match(t.name):
                absorbed[t.name] = tensor
                joined = _join_kv_b(absorbed, t.name)
                if joined is None:
                    continue
                name, tensor = joined
            else:
                name = self._hf_name(t.name, layer_names)
            if arch == "gemma3" and name.endswith("norm.weight"):  # llama.cpp stores Gemma's 1 + weight
                tensor = tensor.float() - 1
            if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
                key = "num_attention_heads" if "q_proj" in name else "num_key_value_heads"
                tensor = _unpermute_rope(tensor, cfg[key])
            yield name, tensor if isinstance(tensor, (QuantizedWeight, QuantizedExperts)) else tensor.to(dtype)
        for qtype, count in dequantized.items():
            log.info("%d tensors in %s have no kernel here: dequantized to %s", count, qtype,
                     str(dtype).removeprefix("torch."))
        if absorbed:
            raise ValueError(f"GGUF file {self.path!r} has {', '.join(sorted(absorbed))} without its other half")

    def _read(self, t: TensorInfo, keep_quantized: bool, dequantized: dict[str, int], keep_bf16: bool = False
              ) -> torch.Tensor | QuantizedWeight | QuantizedExperts:
        """A matmul weight in a kept block format as stored (when asked), else a tensor;
        ``dequantized`` counts the block-quantized tensors that had to be dequantized."""
        experts = len(t.shape) == 3 and t.name.endswith("_exps.weight")  # every expert's projection
        kept = t.qtype in KEPT_TYPES or (keep_bf16 and t.qtype == BlockType.BF16 and t.shape[-1] % 32 == 0)
        if keep_quantized and kept and (len(t.shape) == 2 or experts):
            raw = torch.from_numpy(np.array(tensor_bytes(self._data, t)))  # copied: the pages are released
            if experts:
                return QuantizedExperts(t.qtype, raw.reshape(*t.shape[:2], -1), t.shape)
            return QuantizedWeight.from_blocks(t.qtype, raw, t.shape)
        if keep_quantized and t.qtype not in UNQUANTIZED_TYPES and len(t.shape) >= 2:
            name = tensor_type_name(t.qtype)
            dequantized[name] = dequantized.get(name, 0) + 1
        return self._tensor(t)

    def _tensor(self, t: TensorInfo) -> torch.Tensor:
        from gguf import GGMLQuantizationType as Q
        from gguf.quants import dequantize
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
            target = layer_names[part]  # a module, or a whole parameter name ("..._bias")
            return f"model.layers.{layer}.{target}" + ("" if target.endswith("_bias") else f".{kind}")
        base, kind = name.rsplit(".", 1)
        if base not in TENSOR_NAMES:
            raise ValueError(f"GGUF tensor {name!r} is not understood")
        return f"{TENSOR_NAMES[base]}.{kind}"


def _join_kv_b(absorbed: dict[str, torch.Tensor], name: str) -> tuple[str, torch.Tensor] | None:
    """kv_b_proj from llama.cpp's split form, once both halves of a layer are read: attn_k_b
    [heads, rank, nope] (W_uk transposed) and attn_v_b [heads, v_dim, rank] become the
    checkpoint's [heads x (nope + v_dim), rank]."""
    layer = _ABSORBED_RE.match(name).group(1)
    k_name, v_name = f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"
    if k_name not in absorbed or v_name not in absorbed:
        return None
    k_b, v_b = absorbed.pop(k_name), absorbed.pop(v_name)
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise ValueError(f"GGUF tensors {k_name} {tuple(k_b.shape)} and {v_name} {tuple(v_b.shape)} do not "
                         "split one kv_b_proj")
    joined = torch.cat((k_b.transpose(1, 2), v_b), dim=1)
    return f"model.layers.{layer}.self_attn.kv_b_proj.weight", joined.reshape(-1, joined.shape[-1])


def tensor_type_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def _unpermute_rope(w: torch.Tensor | QuantizedWeight, n_head: int) -> torch.Tensor | QuantizedWeight:
    if isinstance(w, QuantizedWeight):  # whole rows move: the blocks move with them
        return w.take_rows(_unpermute_rope(torch.arange(w.shape[0]), n_head))
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
