"""Weight bytes of a model, by component, and the share of them each device holds under a
parallel layout.

Parameters are counted from the architecture (not from file sizes), component by
component, because each component is stored and split differently: experts are often
quantized while attention stays bf16; tensor parallelism shards projections but
replicates norms, routers and MLA's two down-projections (``q_a_proj`` and
``kv_a_proj_with_mqa``, as vLLM and SGLang do); pipeline stages split layers.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from xlserve.models.arch import ModelArch, Router


class Component(str, enum.Enum):
    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    ATTENTION = "attention"
    DENSE_MLP = "dense_mlp"
    EXPERTS = "experts"
    SHARED_EXPERTS = "shared_experts"
    REPLICATED = "replicated"  # norms, routers, MLA down-projections: every tensor-parallel rank has all


@dataclass(frozen=True)
class WeightFormat:
    """How a weight is stored: bits per parameter, and one scale of ``scale_bits`` per
    ``group`` parameters (0: no scales)."""
    name: str
    bits: float
    group: int = 0
    scale_bits: int = 0

    @property
    def bytes_per_param(self) -> float:
        return (self.bits + (self.scale_bits / self.group if self.group else 0)) / 8


FORMATS = {f.name: f for f in (
    WeightFormat("float32", 32), WeightFormat("bfloat16", 16), WeightFormat("float16", 16),
    WeightFormat("fp8", 8, 128 * 128, 32),  # e4m3 with a float32 scale per 128x128 block (DeepSeek-V3)
    WeightFormat("int8", 8, 128, 16),
    WeightFormat("int4", 4, 32, 16),  # a bf16 scale per 32 weights (Kimi K2 Thinking / K2.5 experts)
    WeightFormat("mxfp4", 4, 32, 8),  # e2m1 with an e8m0 scale per 32 (gpt-oss experts)
)}


def formats_from_config(cfg: dict, dtype: str) -> dict[Component, WeightFormat]:
    """Each component's format: ``dtype`` unless the checkpoint's ``quantization_config``
    says otherwise (fp8 blocks, compressed-tensors int4 experts, mxfp4 experts)."""
    plain = FORMATS[dtype]
    formats = {c: plain for c in Component}
    q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config") or {}
    method = q.get("quant_method")
    projections = (Component.ATTENTION, Component.DENSE_MLP, Component.EXPERTS, Component.SHARED_EXPERTS)
    if method == "fp8":
        block = q.get("weight_block_size") or [128, 128]
        fp8 = WeightFormat("fp8", 8, block[0] * block[1], 32)
        formats.update({c: fp8 for c in projections})
    elif method == "mxfp4":
        formats[Component.EXPERTS] = FORMATS["mxfp4"]
    elif method == "compressed-tensors":
        formats.update(_compressed_tensors(q, projections))
    elif method in ("gptq", "awq"):
        formats.update({c: _zero_point_ints(q, method, plain) for c in projections})
    elif method:
        raise ValueError(f"quantization {method!r} is not understood by the planner; "
                         "known: fp8, mxfp4, compressed-tensors, gptq, awq")
    return formats


def _zero_point_ints(q: dict, method: str, plain: WeightFormat) -> WeightFormat:
    """What the loader holds of a GPTQ / AWQ projection (``checkpoint_quantization.ZeroPointInt``):
    codes minus zero points that fit 4 signed bits (symmetric 4-bit, any 2-bit) as Q4_0, other
    4- and 8-bit ones as Q8_0 (a float16 scale times an asymmetric zero point is rarely a
    float16, which Q4_1's minimum would need), and groups that are not whole blocks of 32
    inputs (act-order, or a size off 32) dequantized to ``plain``."""
    bits, group = int(q.get("bits", 4)), int(q.get("group_size", 128))
    symmetric = method == "gptq" and q.get("sym", True)
    if group != -1 and (group % 32 or (method == "gptq" and q.get("desc_act"))):
        return plain
    if bits == 2 or (bits == 4 and symmetric):
        return WeightFormat("q4_0", 4, 32, 16)
    return WeightFormat("q8_0", 8, 32, 16)


def _compressed_tensors(q: dict, projections) -> dict[Component, WeightFormat]:
    """compressed-tensors groups: the weight format of the projections its ``ignore`` list
    leaves in (Kimi K2.5 ignores attention, shared experts and dense MLPs: experts only)."""
    groups = list((q.get("config_groups") or {}).values())
    if not groups:
        return {}
    weights = groups[0].get("weights") or {}
    fmt = WeightFormat(f"int{weights.get('num_bits', 4)}", int(weights.get("num_bits", 4)),
                       int(weights.get("group_size") or 0), 16 if weights.get("group_size") else 0)
    ignored = [re.compile(p[3:]) for p in q.get("ignore") or () if p.startswith("re:")]
    samples = {Component.ATTENTION: "model.layers.1.self_attn.o_proj",
               Component.DENSE_MLP: "model.layers.0.mlp.down_proj",
               Component.EXPERTS: "model.layers.1.mlp.experts.0.down_proj",
               Component.SHARED_EXPERTS: "model.layers.1.mlp.shared_experts.down_proj"}
    return {c: fmt for c in projections if not any(p.search(samples[c]) for p in ignored)}


def attention_params(arch: ModelArch) -> tuple[int, int]:
    """(sharded, replicated) parameters of one attention layer."""
    h = arch.hidden_size
    if arch.kv_lora_rank:
        q_head = arch.qk_nope_head_dim + arch.head_dim
        q = (arch.q_lora_rank * arch.num_heads * q_head) if arch.q_lora_rank else h * arch.num_heads * q_head
        down = (h * arch.q_lora_rank if arch.q_lora_rank else 0) + h * (arch.kv_lora_rank + arch.head_dim)
        kv_b = arch.kv_lora_rank * arch.num_heads * (arch.qk_nope_head_dim + arch.v_head_dim)
        return q + kv_b + arch.num_heads * arch.v_head_dim * h, down
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    return h * (2 * q + 2 * kv), 0


@dataclass(frozen=True)
class Layout:
    """How the model is split: ``tp`` tensor-parallel ranks x ``pp`` pipeline stages; with
    ``dp_attention`` the ``tp`` ranks split only the routed experts and each keeps everything
    else whole and its own requests' KV (``--data-parallel-attention``)."""
    tp: int = 1
    pp: int = 1
    dp_attention: bool = False

    @property
    def attention_tp(self) -> int:
        """The ranks that split attention's heads (and its KV heads): none under data-parallel attention."""
        return 1 if self.dp_attention else self.tp

    @property
    def devices(self) -> int:
        return self.tp * self.pp


def component_params(arch: ModelArch) -> dict[Component, int]:
    """Parameters of the whole model per component."""
    h, layers = arch.hidden_size, arch.num_layers
    sharded_attn, replicated_attn = attention_params(arch)
    sparse = sum(arch.sparse_layer(i) for i in range(layers))
    norms = h * (2 * layers + 1) + layers * ((arch.q_lora_rank + arch.kv_lora_rank) if arch.kv_lora_rank else 0)
    router = arch.num_experts * (h + (1 if arch.router is Router.SIGMOID_GROUPED else 0))  # + correction bias
    return {
        Component.EMBEDDING: arch.vocab_size * h,
        Component.LM_HEAD: 0 if arch.tie_word_embeddings else arch.vocab_size * h,
        Component.ATTENTION: sharded_attn * layers,
        Component.DENSE_MLP: 3 * h * arch.intermediate_size * (layers - sparse),
        Component.EXPERTS: 3 * h * arch.moe_intermediate_size * arch.num_experts * sparse,
        Component.SHARED_EXPERTS: 3 * h * arch.shared_expert_intermediate_size * sparse,
        Component.REPLICATED: replicated_attn * layers + norms + router * sparse,
    }


def bytes_per_device(arch: ModelArch, formats: dict[Component, WeightFormat], layout: Layout) -> dict[Component, float]:
    """Bytes of each component on the busiest device: sharded components divided over the
    tensor-parallel ranks (key/value heads fewer than ranks are copied, not split), layers
    over the pipeline stages (the first stage also holds the embedding, the last the head)."""
    params = component_params(arch)
    out = {}
    split = (Component.EXPERTS,) if layout.dp_attention else tuple(c for c in params if c is not Component.REPLICATED)
    for component, count in params.items():
        share = count * formats[component].bytes_per_param
        if component in split:
            share /= layout.tp
        if component not in (Component.EMBEDDING, Component.LM_HEAD):
            share /= layout.pp
        out[component] = share
    if not arch.kv_lora_rank and arch.num_kv_heads < layout.attention_tp:  # each rank keeps one whole KV head
        kv = 2 * arch.hidden_size * arch.head_dim * arch.num_layers / layout.pp * (
            1 - arch.num_kv_heads / layout.attention_tp)
        out[Component.ATTENTION] += kv * formats[Component.ATTENTION].bytes_per_param
    if layout.pp > 1:  # embedding and head sit on different stages: the busier stage has the larger
        out[Component.LM_HEAD] = max(out[Component.EMBEDDING], out[Component.LM_HEAD])
        out[Component.EMBEDDING] = 0.0
    return out
