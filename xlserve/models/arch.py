"""The architecture facts a decoder model needs, read from a Hugging Face config dict."""

from __future__ import annotations

from dataclasses import dataclass

ROPE_TYPES = ("default", "linear", "llama3")
# Every ModelArch field is one or the other (a test checks): sizes and constants, which the
# fast paths check as shapes, and features, which change what a layer computes and which
# each decode path declares it implements or not (engine/decode_plan.py).
DIMENSIONS = frozenset({"architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                        "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta",
                        "max_position_embeddings"})
FEATURES = frozenset({"attention_bias", "qk_norm", "tie_word_embeddings", "rope_scaling"})


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

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_attention_heads ({self.num_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_kv_heads})")
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
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        scaling = {k: v for k, v in scaling.items() if not isinstance(v, (dict, list))}
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        rope_theta = cfg.get("rope_theta", scaling.pop("rope_theta", 10000.0))
        max_positions = int(cfg.get("max_position_embeddings", 4096))
        window = cfg.get("sliding_window")
        if window and cfg.get("use_sliding_window", True):
            # Full attention equals sliding-window attention up to the window: serve that far.
            max_positions = min(max_positions, int(window))
        return cls(
            architecture=archs[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            rope_scaling=tuple(sorted(scaling.items())),
        )

    def features(self, qkv_bias: bool = False, qk_norm: bool = False) -> frozenset[str]:
        """The features this model uses; ``qkv_bias`` / ``qk_norm``: set by its class
        (Qwen2, Qwen3) rather than its config."""
        used = {"attention_bias": self.attention_bias or qkv_bias, "qk_norm": self.qk_norm or qk_norm,
                "tie_word_embeddings": self.tie_word_embeddings, "rope_scaling": bool(self.rope_scaling)}
        return frozenset(name for name, on in used.items() if on)
