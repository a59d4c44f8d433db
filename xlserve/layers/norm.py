"""RMSNorm computed in float32, as the reference implementations do: Llama's (the weight
applied after rounding back to the input dtype) and Gemma's (1 + weight, applied in float32)."""

import torch
from torch import nn

from xlserve.kernels import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and cpu_ops.usable(x, self.weight):
            return cpu_ops.rmsnorm(x, self.weight, self.eps)  # the same rounding, one call
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma 2/3: scales by ``1 + weight`` (weights are stored as offsets from 1), in float32."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def rms_norm(size: int, eps: float, gemma: bool = False) -> nn.Module:
    return GemmaRMSNorm(size, eps) if gemma else RMSNorm(size, eps)
