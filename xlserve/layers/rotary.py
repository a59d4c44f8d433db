"""How an attention layer encodes positions: rotary embedding with a precomputed cos/sin
table (rotate-half layout, Llama; or interleaved pairs, DeepSeek's ``rope_interleave``, Llama
4), with the scaling rules of long-context checkpoints (linear, Llama 3, YaRN, or GGUF's
per-frequency factors); or no rotary
at all with the query temperature Llama 4 gives its global layers.

Both are a ``PositionEncoding``: ``tables(positions)`` once per forward (shared by every
layer with that encoding), then ``forward(tables, q, k)`` per layer."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv = _yarn_inv_freq(inv, head_dim, theta, scaling)
    elif kind == "freq_factors":  # each frequency's divisor as GGUF stores it (rope_freqs: Llama 3.1, 4)
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv.shape:
            raise ValueError(f"rope frequency factors: {factors.numel()} values for {inv.numel()} frequencies")
        inv = inv / factors
    return inv


def _yarn_inv_freq(inv: torch.Tensor, dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: high frequencies kept, low ones interpolated by ``factor``, a linear ramp between
    the dimensions that turn ``beta_fast`` and ``beta_slow`` times over the original context."""
    factor, old_len = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])

    def turning_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turning_dim(scaling.get("beta_fast") or 32), turning_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: dict) -> float:
    """What YaRN multiplies cos and sin by (1 for the other rules)."""
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


class PositionEncoding(nn.Module, ABC):
    @abstractmethod
    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Per-token tables for one forward."""

    @abstractmethod
    def forward(self, tables: tuple[torch.Tensor, ...], q: torch.Tensor, k: torch.Tensor):
        """(q, k) with positions applied; q: [T, Hq, D], k: [T, Hkv, D]."""


class RotaryEmbedding(PositionEncoding):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict, interleave: bool = False):
        super().__init__()
        self.interleave = interleave
        # Built on the CPU explicitly (the model may be constructed on the meta device)
        # and moved to the activations' device on first use.
        with torch.device("cpu"):
            inv = _inv_freq(head_dim, theta, scaling)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
            emb = torch.cat((freqs, freqs), dim=-1)
        gain = attention_factor(scaling)
        self.cos, self.sin = emb.cos() * gain, emb.sin() * gain

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, [T, D] each."""
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
        if self.interleave:
            return self._rotate_pairs(cos_sin, q), self._rotate_pairs(cos_sin, k)
        cos, sin = (t.unsqueeze(1) for t in cos_sin)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin

    @staticmethod
    def _rotate_pairs(cos_sin, x: torch.Tensor) -> torch.Tensor:
        """Pairs (x0, x1), (x2, x3)... each turned by one frequency; the result holds the turned
        evens then the turned odds (queries and keys alike, so their products are unchanged)."""
        half = x.shape[-1] // 2
        cos, sin = (t[:, :half].unsqueeze(1) for t in cos_sin)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


class QueryTemperature(PositionEncoding):
    """No rotary; queries scaled by log1p(floor((position + 1) / floor_scale)) * scale + 1, so
    attention over a long context stays sharp (Llama 4's global layers, ``attn_temperature_tuning``)."""

    def __init__(self, floor_scale: int, scale: float):
        super().__init__()
        self.floor_scale, self.scale = floor_scale, scale

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor]:
        if not self.floor_scale:
            return (None,)
        steps = torch.floor((positions.float() + 1.0) / self.floor_scale)
        return (torch.log1p(steps) * self.scale + 1.0,)  # float32, as the reference multiplies

    def forward(self, tables, q: torch.Tensor, k: torch.Tensor):
        (temperature,) = tables
        if temperature is None:
            return q, k
        return (q * temperature[:, None, None]).to(q.dtype), k
