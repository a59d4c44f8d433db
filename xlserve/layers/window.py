"""Attention windows: which earlier tokens a query of a windowed layer sees (no torch
import: the KV layer groups and the hand-off layout use it too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Window:
    """The earlier tokens a query sees in a windowed layer: the last ``size`` positions, itself
    included (sliding: Gemma 3, gpt-oss), or those of its own aligned chunk of ``size``
    (chunked: Llama 4) — the masks transformers builds for these layers."""
    size: int
    chunked: bool = False

    def allows(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Boolean [.., Q, K] for broadcastable query and key positions (causal included)."""
        near = (k_pos // self.size == q_pos // self.size) if self.chunked else (k_pos > q_pos - self.size)
        return (k_pos <= q_pos) & near

    def first_key(self, q_pos: int) -> int:
        """The earliest key position any query at ``q_pos`` or later sees."""
        return (q_pos // self.size) * self.size if self.chunked else max(q_pos - self.size + 1, 0)

    def first_keys(self, q_pos: torch.Tensor) -> torch.Tensor:
        """``first_key`` of each query position in a tensor."""
        return (q_pos // self.size) * self.size if self.chunked else (q_pos - self.size + 1).clamp(min=0)
