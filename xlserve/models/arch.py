"""The architecture facts a decoder model needs, read from a Hugging Face config dict."""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")  # freq_factors: GGUF's rope_freqs
# Every ModelArch field is one or the other (a test checks): sizes and constants, which the
# fast paths check as shapes, and features, which change what a layer computes and which
# each decode path declares it implements or not (engine/decode_plan.py).
DIMENSIONS = frozenset({"architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                        "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta",
                        "max_position_embeddings", "num_experts_per_tok", "moe_intermediate_size",
                "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group", "routed_scaling_factor",
                "nope_floor_scale", "nope_attn_scale", "swiglu_alpha"})
FEATURES = frozenset({"attention_bias", "qk_norm", "tie_word_embeddings", "rope_scaling", "num_experts",
                      "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size",
                      "shared_expert_gated", "router", "kv_lora_rank", "q_lora_rank", "rope_interleave",
                      "layer_windows", "chunked_attention", "hidden_act", "gemma_norms", "attention_scale",
                      "final_logit_softcapping", "local_rope_theta", "nope_layers", "qk_l2_norm",
                      "attention_sinks", "router_bias", "expert_bias", "swiglu_limit", "norm_weight_float32"})
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class Router(str, enum.Enum):
    """How a MoE layer picks a token's experts."""
    SOFTMAX_TOPK = "softmax_topk"  # Mixtral, Qwen MoE: softmax over experts, the k largest
    # DeepSeek-V3 / Kimi K2: sigmoid scores; the choice (not the weights) adds a per-expert
    # bias and first keeps the best groups of experts
    SIGMOID_GROUPED = "sigmoid_grouped"
    # Llama 4: the k largest logits; each chosen expert's input is scaled by the sigmoid of its logit
    SIGMOID_TOPK_INPUT = "sigmoid_topk_input"
    # gpt-oss: the k largest logits, softmax over those k
    TOPK_SOFTMAX = "topk_softmax"


@dataclass(frozen=True)
class KVCacheSpec:
    """What the KV cache keeps per token and layer: ``parts`` tensors of [heads, dim] each
    (K and V: 2 of [kv_heads, head_dim]; MLA's compressed latent with the rotary key
    appended: 1 of [1, kv_lora_rank + rope_dim])."""
    parts: int
    heads: int
    dim: int
    shared: bool = False  # one entry serves every query head (MLA's latent): each tensor-parallel rank keeps it whole

    def bytes_per_token(self, num_layers: int, itemsize: int) -> int:
        return num_layers * self.parts * self.heads * self.dim * itemsize


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: tuple = ()  # sorted (key, value) pairs, hashable
    # mixture of experts (Mixtral, Qwen3-MoE): softmax top-k routing; 0 experts: dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the chosen experts' weights to sum to 1
    decoder_sparse_step: int = 1  # every n-th layer is sparse (Qwen MoE's rule)
    mlp_only_layers: tuple = ()  # layers that stay dense
    shared_expert_intermediate_size: int = 0  # a shared expert every token passes; 0: none
    shared_expert_gated: bool = True  # scaled by a sigmoid gate (Qwen2-MoE), not plainly added (DeepSeek)
    router: Router = Router.SOFTMAX_TOPK
    n_group: int = 1  # SIGMOID_GROUPED: experts fall in n_group groups, the topk_group best are kept
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' sum is scaled by this
    # multi-head latent attention (DeepSeek-V2/V3, Kimi K2); kv_lora_rank 0: ordinary attention.
    # head_dim is then the rotary part of a query/key head (qk_rope_head_dim).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # queries through a low-rank projection and norm; 0: one projection
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary pairs are (x0, x1), (x2, x3)... instead of two halves
    # per-layer attention window in tokens, 0: the whole context (Gemma 3, gpt-oss: sliding;
    # Llama 4: chunked, a token sees its own aligned chunk); empty: every layer sees it all
    layer_windows: tuple = ()
    chunked_attention: bool = False
    hidden_act: str = "silu"  # of the MLP's gate (ACTIVATIONS)
    # Gemma 2/3: RMSNorm scales by 1 + weight, attention and MLP outputs are normed before the
    # residual adds them (four norms a layer), embeddings are scaled by sqrt(hidden_size)
    gemma_norms: bool = False
    attention_scale: float = 0.0  # softmax scale of q.k; 0: 1/sqrt(head_dim)
    final_logit_softcapping: float = 0.0  # logits = cap * tanh(logits / cap); 0: none
    local_rope_theta: float = 0.0  # rotary base of windowed layers (default rope); 0: rope_theta and rope_scaling
    # Llama 4: layers without rotary (its global layers), their queries scaled by
    # log1p(floor((pos + 1) / nope_floor_scale)) * nope_attn_scale + 1 (0: no scaling); and an
    # L2 norm (no weight) on queries and keys of the rotary layers
    nope_layers: tuple = ()
    nope_floor_scale: int = 0
    nope_attn_scale: float = 0.0
    qk_l2_norm: bool = False
    # gpt-oss: a learned per-head logit in every softmax's denominator ("sinks"); biases on the
    # router and experts; experts' SwiGLU clamped at swiglu_limit as (up + 1) * gate * sigmoid(alpha * gate)
    # (0: plain SwiGLU); RMSNorm weight applied in float32
    attention_sinks: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    norm_weight_float32: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_attention_heads ({self.num_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_kv_heads})")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0 and self.decoder_sparse_step > 0):
            raise ValueError(f"model config: {self.num_experts} experts need 1..{self.num_experts} experts per "
                             f"token (got {self.num_experts_per_tok}), a positive moe_intermediate_size and "
                             "decoder_sparse_step")
        if self.router is Router.SIGMOID_GROUPED and (self.num_experts % self.n_group
                                                      or not 0 < self.topk_group <= self.n_group):
            raise ValueError(f"model config: {self.num_experts} experts do not split into n_group={self.n_group} "
                             f"groups of which topk_group={self.topk_group} are kept")
        if self.kv_lora_rank and not (self.qk_nope_head_dim > 0 and self.v_head_dim > 0):
            raise ValueError("model config: latent attention needs positive qk_nope_head_dim and v_head_dim")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"activation {self.hidden_act!r} is not supported; supported: {ACTIVATIONS}")
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope scaling {rope_type!r} is not supported; supported: {ROPE_TYPES}")

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArch":
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("model config has no 'architectures' entry")
        if isinstance(cfg.get("text_config"), dict):  # a multimodal wrapper: the language model's facts
            outer = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
            cfg = {**outer, **cfg["text_config"], "architectures": archs}
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        local = scaling.get("sliding_attention") if isinstance(scaling.get("sliding_attention"), dict) else None
        scaling = scaling.get("full_attention", scaling)  # per layer type (Gemma 3): the global layers'
        scaling = {k: v for k, v in scaling.items() if not isinstance(v, (dict, list))}
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        rope_theta = cfg.get("rope_theta", scaling.pop("rope_theta", 10000.0))
        max_positions = int(cfg.get("max_position_embeddings", 4096))
        mla, windows = _mla_fields(cfg), _layer_windows(cfg)
        window = cfg.get("sliding_window")
        if window and cfg.get("use_sliding_window", True) and not windows:
            # Full attention equals sliding-window attention up to the window: serve that far.
            max_positions = min(max_positions, int(window))
        return cls(
            architecture=archs[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size_mlp") or cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg["qk_rope_head_dim"] if mla else cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            rope_scaling=tuple(sorted(scaling.items())),
            **_moe_fields(cfg), **mla, **windows, **_gemma_fields(cfg, local), **_llama4_fields(cfg),
            **_gpt_oss_fields(cfg),
        )

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        if self.kv_lora_rank:
            return KVCacheSpec(1, 1, self.kv_lora_rank + self.head_dim, shared=True)
        return KVCacheSpec(2, self.num_kv_heads, self.head_dim)

    def kv_groups(self) -> list[tuple[int, int]]:
        """(window, layers) per group of layers whose cache lives alike: window 0 keeps every
        token; a window w keeps at most w (sliding) or one chunk of w (chunked) per sequence."""
        windows = self.layer_windows or (0,) * self.num_layers
        return sorted(collections.Counter(windows).items())

    def sparse_layer(self, index: int) -> bool:
        """Layer ``index`` routes to experts (else it has a dense MLP)."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    def features(self, qkv_bias: bool = False, qk_norm: bool = False) -> frozenset[str]:
        """The features this model uses; ``qkv_bias`` / ``qk_norm``: set by its class
        (Qwen2, Qwen3) rather than its config."""
        moe = self.num_experts > 0
        used = {"attention_bias": self.attention_bias or qkv_bias, "qk_norm": self.qk_norm or qk_norm,
                "tie_word_embeddings": self.tie_word_embeddings, "rope_scaling": bool(self.rope_scaling),
                "num_experts": moe, "norm_topk_prob": moe and not self.norm_topk_prob,
                "decoder_sparse_step": moe and self.decoder_sparse_step != 1,
                "mlp_only_layers": moe and bool(self.mlp_only_layers),
                "shared_expert_intermediate_size": moe and self.shared_expert_intermediate_size > 0,
                "shared_expert_gated": moe and self.shared_expert_intermediate_size > 0 and self.shared_expert_gated,
                "router": moe and self.router is not Router.SOFTMAX_TOPK, "kv_lora_rank": self.kv_lora_rank > 0,
                "q_lora_rank": self.q_lora_rank > 0, "rope_interleave": self.rope_interleave,
                "layer_windows": any(self.layer_windows), "chunked_attention": self.chunked_attention,
                "hidden_act": self.hidden_act != "silu", "gemma_norms": self.gemma_norms,
                "attention_scale": self.attention_scale > 0,
                "final_logit_softcapping": self.final_logit_softcapping > 0,
                "local_rope_theta": self.local_rope_theta > 0,
                "nope_layers": bool(self.nope_layers), "qk_l2_norm": self.qk_l2_norm,
                "attention_sinks": self.attention_sinks, "router_bias": self.router_bias,
                "expert_bias": self.expert_bias, "swiglu_limit": self.swiglu_limit > 0,
                "norm_weight_float32": self.norm_weight_float32}
        return frozenset(name for name, on in used.items() if on)


def _moe_fields(cfg: dict) -> dict:
    """Mixtral names its experts ``num_local_experts``, Qwen MoE ``num_experts``, DeepSeek
    ``n_routed_experts`` (with ``first_k_dense_replace`` dense layers first and
    ``n_shared_experts`` of ``moe_intermediate_size`` added ungated)."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    if not experts:
        return {}
    size = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])  # Llama 4: the experts' size
    fields = {"num_experts": experts, "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 2)),
              "moe_intermediate_size": size, "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
              "decoder_sparse_step": int(cfg.get("decoder_sparse_step") or cfg.get("moe_layer_freq")
                                         or cfg.get("interleave_moe_layer_step") or 1),
              "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
              "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)}
    if "intermediate_size_mlp" in cfg:  # Llama 4: every MoE layer also has an ungated shared expert
        fields.update(shared_expert_intermediate_size=size, shared_expert_gated=False,
                      router=Router.SIGMOID_TOPK_INPUT)
    if cfg.get("moe_layers") is not None:  # an explicit list overrides the interleave step
        moe = set(cfg["moe_layers"])
        fields.update(decoder_sparse_step=1,
                      mlp_only_layers=tuple(i for i in range(int(cfg["num_hidden_layers"])) if i not in moe))
    if "n_routed_experts" in cfg:
        scoring = cfg.get("scoring_func", "sigmoid")
        if scoring != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"MoE routing {scoring!r}/{cfg.get('topk_method')!r} is not supported; supported: "
                             "sigmoid scores with the bias-corrected grouped top-k (noaux_tc)")
        fields.update(router=Router.SIGMOID_GROUPED, n_group=int(cfg.get("n_group") or 1),
                      topk_group=int(cfg.get("topk_group") or 1),
                      routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                      mlp_only_layers=tuple(range(int(cfg.get("first_k_dense_replace") or 0))),
                      shared_expert_intermediate_size=size * int(cfg.get("n_shared_experts") or 0),
                      shared_expert_gated=False)
    return fields


def _layer_windows(cfg: dict) -> dict:
    """Per-layer windows from ``layer_types`` (HF's names), Llama 4's ``no_rope_layers`` (its
    rotary layers are the chunked ones) or Gemma's ``sliding_window_pattern``."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if not types and cfg.get("no_rope_layers") and cfg.get("attention_chunk_size"):
        types = ["chunked_attention" if rope else "full_attention" for rope in cfg["no_rope_layers"]]
    if not types and cfg.get("sliding_window_pattern") and cfg.get("sliding_window"):
        pattern = int(cfg["sliding_window_pattern"])
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if not types or set(types) == {"full_attention"}:
        return {}
    sizes = {"full_attention": 0, "sliding_attention": cfg.get("sliding_window"),
             "chunked_attention": cfg.get("attention_chunk_size")}
    unknown = set(types) - {t for t, size in sizes.items() if size is not None}
    if unknown or len(types) != layers:
        raise ValueError(f"model config: layer_types {sorted(set(types))} for {len(types)} of {layers} layers; "
                         "supported: full_attention, sliding_attention (with sliding_window), chunked_attention "
                         "(with attention_chunk_size), one per layer")
    return {"layer_windows": tuple(int(sizes[t]) for t in types), "chunked_attention": "chunked_attention" in types}


def _gemma_fields(cfg: dict, local_rope: dict | None) -> dict:
    """Gemma 2/3: norms, query scale, soft-capping and the windowed layers' own rotary base."""
    fields = {"hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"}
    if not str(cfg.get("model_type", "")).startswith("gemma"):
        return fields
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("attention logit soft-capping (Gemma 2) is not supported; Gemma 3 does not use it")
    if local_rope and local_rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {local_rope.get('rope_type')!r} on windowed layers is not supported")
    local_theta = (local_rope or {}).get("rope_theta") or cfg.get("rope_local_base_freq") or 0.0
    query_scalar = cfg.get("query_pre_attn_scalar")
    return {**fields, "gemma_norms": True, "attention_scale": float(query_scalar) ** -0.5 if query_scalar else 0.0,
            "final_logit_softcapping": float(cfg.get("final_logit_softcapping") or 0.0),
            "local_rope_theta": float(local_theta)}


def _gpt_oss_fields(cfg: dict) -> dict:
    if cfg.get("model_type") != "gpt_oss":
        return {}
    return {"attention_sinks": True, "router_bias": True, "expert_bias": True, "router": Router.TOPK_SOFTMAX,
            "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)), "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
            "norm_weight_float32": True}


def _llama4_fields(cfg: dict) -> dict:
    if "no_rope_layers" not in cfg:
        return {}
    tuning = cfg.get("attn_temperature_tuning", True)
    return {"nope_layers": tuple(i for i, rope in enumerate(cfg["no_rope_layers"]) if not rope),
            "nope_floor_scale": int(cfg.get("floor_scale", 8192)) if tuning else 0,
            "nope_attn_scale": float(cfg.get("attn_scale", 0.1)) if tuning else 0.0,
            "qk_l2_norm": bool(cfg.get("use_qk_norm", True)), "rope_interleave": True}  # complex-number rotary


def _mla_fields(cfg: dict) -> dict:
    """Multi-head latent attention sizes (DeepSeek-V2/V3 configs); empty for other models."""
    if not cfg.get("kv_lora_rank"):
        return {}
    return {"kv_lora_rank": int(cfg["kv_lora_rank"]), "q_lora_rank": int(cfg.get("q_lora_rank") or 0),
            "qk_nope_head_dim": int(cfg["qk_nope_head_dim"]), "v_head_dim": int(cfg["v_head_dim"]),
            "rope_interleave": bool(cfg.get("rope_interleave", True))}
