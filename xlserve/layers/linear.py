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
    bandwidth kernel, batches up to ``cpu_ops.AMX_MAX_ROWS`` rows the AMX kernel (both read
    the weight in place and add the residual); larger ones the prepacked twin of the weight
    when there is one (``prepack_linear_weights``), else torch."""
    if cpu_ops.use_linear(x, weight):
        return cpu_ops.linear_bf16(x, weight, bias, residual)
    if cpu_ops.use_amx(x, weight):
        return cpu_ops.linear_amx(x, weight, bias, residual)
    packed = getattr(weight, PACKED, None)
    if packed is not None and x.dim() == 2 and x.dtype == weight.dtype:
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    else:
        out = nn.functional.linear(x, weight, bias)
    return out if residual is None else residual + out


PACKED = "_xlserve_prepacked"


def prepack_unsupported(dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot prepack weights of ``dtype`` here, or None when it can."""
    if not torch.backends.mkldnn.is_available():
        return "prepacked weights need a torch build with oneDNN (mkldnn); this one has none"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return ("prepacked bfloat16 weights need a CPU with AVX512BW/VL/DQ or AVX-NE-CONVERT; "
                "this one has neither: use float32 or leave --prepack-weights off")
    return None


def prepack_linear_weights(model: nn.Module, rows_hint: int = 32) -> int:
    """Give the weight of every linear layer a oneDNN-prepacked twin (CPU): a matmul with a
    weight in oneDNN's own blocked layout skips the per-call reorder, which dominates for
    tens of rows. Costs one more copy of those weights. Returns how many were packed."""
    why = prepack_unsupported(next(model.parameters()).dtype)
    if why:
        raise ValueError(why)
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (nn.Linear, MergedLinear)) and weight is not None and weight.device.type == "cpu":
            setattr(weight, PACKED, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint))
            count += 1
    return count


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
