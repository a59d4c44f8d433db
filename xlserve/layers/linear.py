"""Linear layers whose weights load from several checkpoint tensors (fused QKV, gate/up).

The module carries ``load_shard(param, tensor, shard)`` (not the parameter: moving a
model between devices replaces its parameters) so model files only declare which
checkpoint names stack into which module.
"""

from __future__ import annotations

import torch
from torch import nn

from xlserve.kernels import cpu_ops


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias (+ residual)``; few-row bf16 CPU matmuls (decode) take the
    bandwidth kernel, which also adds the residual."""
    if cpu_ops.use_linear(x, weight):
        return cpu_ops.linear_bf16(x, weight, bias, residual)
    out = nn.functional.linear(x, weight, bias)
    return out if residual is None else residual + out


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        pass  # weights come from the checkpoint; see Embedding.reset_parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"weight {what}: expected shape {tuple(param.shape)}, "
                         f"checkpoint has {tuple(loaded.shape)}")
    param.data.copy_(loaded.to(param.dtype))


class MergedLinear(nn.Module):
    """One matmul for several projections of the same input; ``shard_sizes`` in output order."""

    def __init__(self, in_features: int, shard_sizes: dict, bias: bool):
        super().__init__()
        self.shard_offsets = {}
        offset = 0
        for shard, size in shard_sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size
        self.weight = nn.Parameter(torch.empty(offset, in_features), requires_grad=False)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(offset), requires_grad=False)

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard) -> None:
        start, size = self.shard_offsets[shard]
        copy_checked(param.data.narrow(0, start, size), loaded, f"shard {shard}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
