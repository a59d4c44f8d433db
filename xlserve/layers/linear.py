"""Linear layers whose weights load from several checkpoint tensors (fused QKV, gate/up),
and that hold their tensor-parallel slice (``Split``).

The module carries ``load_shard(param, tensor, shard)`` / ``load_whole(param, tensor, what)``
(not the parameter: moving a model between devices replaces its parameters) so model files
only declare which checkpoint names stack into which module, and which way it splits.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from xlserve.kernels import cpu_ops, invariant_linear
from xlserve.layers.quantized import HoldsQuantized, QuantizedWeight
from xlserve.parallel import tensor_parallel


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias (+ residual)``; bf16 CPU matmuls of up to ``cpu_ops.AMX_MAX_ROWS``
    rows (decode) take the AMX kernel, or without AMX the row kernel (1-4 rows, and on
    AVX512-BF16 its batched blocks up to 64; all read the weight in place and add the
    residual); larger ones the prepacked twin of the weight
    when there is one (``prepack_linear_weights``), else torch. A weight kept in its file's
    block format computes with its own kernel (``QuantizedWeight.linear``), and under
    ``--deterministic`` a dense one with ``invariant_linear`` (one reduction order per row)."""
    if isinstance(weight, QuantizedWeight):
        return weight.linear(x, bias, residual)
    if invariant_linear.applies(x, weight):  # --deterministic
        return invariant_linear.linear(x, weight, bias, residual)
    if cpu_ops.use_amx(x, weight):
        return cpu_ops.linear_amx(x, weight, bias, residual)
    if cpu_ops.use_linear(x, weight):
        return cpu_ops.linear_bf16(x, weight, bias, residual)
    packed = getattr(weight, PACKED, None)
    if packed is not None and x.dim() == 2 and x.dtype == weight.dtype:
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    else:
        out = nn.functional.linear(x, weight, bias)
    return out if residual is None else residual + out


def linear_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` with float32 products and a float32 result whatever the weight's dtype
    (the logits: rounded to bf16, a logit near 25 moves in steps of 0.125, which tied the
    default model's two best first tokens, 0.08 apart in float32, on a chat prompt and
    turned its greedy answer from transformers'). bf16 activations and weight on the CPU: the
    row kernel's float32 sums as they are, any row count, the weight read in place."""
    if isinstance(weight, QuantizedWeight) or weight.dtype == torch.float32:
        return linear(x.float(), weight, None)
    if invariant_linear.applies(x, weight):  # --deterministic
        return invariant_linear.linear(x.float(), weight, None, None)
    if x.dtype == torch.bfloat16 and cpu_ops.use_linear(x[..., :1, :], weight):
        return cpu_ops.linear_bf16_float32(x, weight)
    if x.device.type == "cuda":  # cuBLAS accumulates in float32; the result is rounded once to the weight's dtype
        return nn.functional.linear(x, weight).float()
    return nn.functional.linear(x.float(), weight.float())


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
        if not isinstance(weight, torch.Tensor):  # kept quantized: its own kernel
            continue
        linear_like = isinstance(module, (nn.Linear, MergedLinear)) or getattr(module, "prepackable", False)
        if linear_like and weight is not None and weight.device.type == "cpu":
            setattr(weight, PACKED, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint))
            count += 1
    return count


class Split(enum.Enum):
    """How a linear layer divides over tensor-parallel ranks: not at all; by output features
    (each rank computes its columns of the output: q/k/v heads, gate/up columns); or by input
    features (each rank multiplies its slice of the input, and the partial outputs are summed
    across ranks: the one all-reduce of an attention or MLP block)."""
    NONE = "none"
    COLUMN = "column"
    ROW = "row"


class Linear(HoldsQuantized, nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, split: Split = Split.NONE,
                 reduce: bool = True):
        """``reduce`` (row split): sum the ranks' partial products here, or leave that to the caller."""
        self.split, self.tp, self.reduce = split, tensor_parallel.current(), reduce
        if split is Split.COLUMN:
            out_features = self.tp.part(out_features, "output features")
        elif split is Split.ROW:
            in_features = self.tp.part(in_features, "input features")
        super().__init__(in_features, out_features, bias)

    def reset_parameters(self) -> None:
        pass  # weights come from the checkpoint; see Embedding.reset_parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split is Split.ROW and self.tp.size > 1:  # the bias once: after the sum, or on rank 0
            out = linear(x, self.weight, None)
            if self.reduce:
                out = self.tp.all_reduce(out)
            return out if self.bias is None or not (self.reduce or self.tp.rank == 0) else out + self.bias
        return linear(x, self.weight, self.bias)

    def load_whole(self, param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
        """A checkpoint tensor of the whole layer into this rank's slice of it."""
        if isinstance(loaded, QuantizedWeight):
            return self.hold(loaded)
        if self.tp.size > 1 and self.split is Split.COLUMN:
            loaded = loaded[self.tp.span(loaded.shape[0], what)]
        elif self.tp.size > 1 and self.split is Split.ROW and param.dim() == 2:
            loaded = loaded[:, self.tp.span(loaded.shape[1], what)]
        copy_checked(param, loaded, what)


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"weight {what}: expected shape {tuple(param.shape)}, "
                         f"checkpoint has {tuple(loaded.shape)}")
    param.data.copy_(loaded.to(param.dtype))


class MergedLinear(HoldsQuantized, nn.Module):
    """One matmul for several projections of the same input; ``shard_sizes`` in output order
    (whole-layer sizes). Column-parallel: each rank holds its slice of every projection.
    Shards kept quantized become parts of one ``QuantizedWeight`` (with any shard the file
    stored in a format that is not kept, as a dense part)."""

    def __init__(self, in_features: int, shard_sizes: dict, bias: bool):
        super().__init__()
        self.tp = tensor_parallel.current()
        self.shard_offsets = {}
        offset = 0
        for shard, size in shard_sizes.items():
            size = self.tp.part(size, f"{shard} output features")
            self.shard_offsets[shard] = (offset, size)
            offset += size
        self.weight = nn.Parameter(torch.empty(offset, in_features), requires_grad=False)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(offset), requires_grad=False)
        self.dense_rows: list[tuple[int, int]] = []  # shards copied into the float weight so far

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard) -> None:
        start, size = self.shard_offsets[shard]
        if isinstance(loaded, QuantizedWeight) or isinstance(self.weight, QuantizedWeight):
            return self._place(param, start, size, loaded, shard)
        self.dense_rows.append((start, size))
        if self.tp.size > 1:
            loaded = loaded[self.tp.span(loaded.shape[0], f"shard {shard}")]
        copy_checked(param.data.narrow(0, start, size), loaded, f"shard {shard}")

    def _place(self, param: torch.Tensor, start: int, size: int, loaded, shard) -> None:
        if tuple(loaded.shape) != (size, param.shape[1]):
            raise ValueError(f"weight shard {shard}: expected shape {(size, param.shape[1])}, checkpoint has "
                             f"{tuple(loaded.shape)}")
        if not isinstance(self.weight, QuantizedWeight):  # shards copied before stay, as dense parts
            dense = [(at, param.data[at:at + n].clone()) for at, n in self.dense_rows]
            self.hold(QuantizedWeight(tuple(param.shape), device=param.device))
            for at, rows in dense:
                self.weight.place(at, rows)
        self.weight.place(start, loaded if isinstance(loaded, QuantizedWeight) else loaded.to(param.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
