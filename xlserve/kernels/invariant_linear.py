"""The dense CPU matmul of ``--deterministic`` (``gemm_quant.c:xl_linear_dense``): each output
one dot product in a fixed order, whatever the number of rows, the tile or the thread, as
the quantized-weight kernel computes. oneDNN's and MKL's matmuls pick their blocking by
shape, so a row's result moves with the batch it is in; this one does not."""

from __future__ import annotations

import torch
from torch import nn

from xlserve.kernels import portable_library, quant_ops

MARK = "_xlserve_invariant"  # set on a weight whose matmuls take this kernel (a model loaded --deterministic)


def takes(weight: object) -> bool:
    """The kernel computes matmuls against this weight: a dense CPU tensor, fp32 or bf16, [N, K]
    or stacked [E, N, K], K a multiple of 16."""
    return (isinstance(weight, torch.Tensor) and weight.dim() in (2, 3) and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.shape[-1] % 16 == 0)


def mark(model: nn.Module) -> int:
    """Mark every dense CPU matmul weight this kernel takes: each module's ``weight`` [N, K], and
    stacked weights [E, N, K] of a module that says it has them (``matmul_stacks``: a MoE
    layer's experts); returns how many."""
    count = 0
    for module in model.modules():
        names = ("weight", *getattr(module, "matmul_stacks", ()))
        for weight in (getattr(module, name, None) for name in names):
            if takes(weight):
                setattr(weight, MARK, True)
                count += 1
    return count


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A matmul of a model loaded --deterministic takes the kernel."""
    return getattr(weight, MARK, False) and x.device.type == "cpu" and portable_library.kernels() is not None


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel can take this matmul, whatever the model was loaded with."""
    return x.device.type == "cpu" and takes(weight) and portable_library.kernels() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           residual: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias) (+ residual)``: fp32 products, rounded to ``x``'s dtype once."""
    n, k = weight.shape
    rows = quant_ops.fp32_rows(x, k)
    w = weight if weight.is_contiguous() else weight.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    portable_library.kernels().xl_linear_dense(rows.data_ptr(), w.data_ptr(), int(w.dtype == torch.bfloat16),
                                               out.data_ptr(), rows.shape[0], n, k, n, torch.get_num_threads())
    return quant_ops.finish(out, x, bias, residual)
