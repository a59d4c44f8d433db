"""RMSNorm computed in float32, as the reference implementations do: Llama's (the weight
applied after rounding back to the input dtype) and Gemma's (1 + weight, applied in float32)."""

import torch
from torch import nn

from xlserve.kernels import decode_step, portable_library


def normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in float32 (every norm here; alone, Llama 4's
    weightless q/k L2 norm)."""
    y = x.float()
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # contiguous first: a one-row view of q or k (for q/k norms) is contiguous where a many-row one
        # is not, and a row must take the same kernel alone or batched
        x = x.contiguous()
        lib = portable_library.row_kernels(x, self.weight) if x.dtype == self.weight.dtype else None
        if lib is not None:  # what the one-call decode step computes (decode_step.c), the same rounding
            return decode_step.rmsnorm(lib, x, self.weight, self.eps)
        return self.weight * normalized(x, self.eps).to(x.dtype)


class Float32WeightRMSNorm(nn.Module):
    """The weight applied in float32 before rounding: gpt-oss; Gemma 2/3 scale by ``1 + weight``
    (``offset`` 1: weights are stored as offsets from 1)."""

    def __init__(self, size: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (normalized(x, self.eps) * (self.offset + self.weight.float())).to(x.dtype)


class GemmaRMSNorm(Float32WeightRMSNorm):
    def __init__(self, size: int, eps: float):
        super().__init__(size, eps, offset=1.0)


def rms_norm(size: int, eps: float, gemma: bool = False, weight_float32: bool = False) -> nn.Module:
    """The model family's RMSNorm (``ModelArch.gemma_norms``, ``norm_weight_float32``)."""
    if gemma:
        return GemmaRMSNorm(size, eps)
    return Float32WeightRMSNorm(size, eps) if weight_float32 else RMSNorm(size, eps)
