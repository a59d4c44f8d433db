"""The gated MLP of Llama-family layers (and of a MoE layer's shared expert): one matmul
for gate and up, act(gate) * up, then down; act is SiLU (SwiGLU) or tanh-approximated GELU
(Gemma's GeGLU)."""

from __future__ import annotations

import torch
from torch import nn

from xlserve.kernels import decode_step, portable_library
from xlserve.layers.activation import ACTIVATIONS, silu
from xlserve.layers.linear import Linear, MergedLinear, Split


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", reduce: bool = True):
        """``reduce``: under tensor parallelism, sum the ranks' parts here (False: the caller
        sums them, with its own: a MoE layer's shared expert)."""
        super().__init__()
        self.act = ACTIVATIONS[activation]
        size = intermediate_size
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": size, "up": size}, bias=False)
        self.down_proj = Linear(size, hidden_size, bias=False, split=Split.ROW, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        lib = portable_library.row_kernels(gate_up) if self.act is silu else None
        if lib is not None:  # what the one-call decode step computes (decode_step.c)
            return self.down_proj(decode_step.silu_mul(lib, gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
