"""The dense CPU matmul of ``--deterministic``: each output one dot product in a fixed order,
whatever the number of rows, the tile, the thread or the CPU. oneDNN's and MKL's matmuls pick
their blocking by shape, so a row's result moves with the batch it is in; these do not.

Two kernels, one per weight, chosen once as the model loads (``kernel_for``), so a weight's rows
take the same one alone or batched, prefill or decode (``decode_step.py`` reads the choice):

- ``Kernel.AMX`` (``gemm_amx.c``: ``xl_linear_amx`` for bf16 rows, ``xl_linear_amx_dense`` for
  the float32 ones of the one-call decode step and the logits): bf16 weights of a bf16 model
  whose shape the tiles take whole, for every row count, in the AMX tile product's order: on
  the tiles where the CPU has them, else in their twin in FMAs (``gemm_tile_order_dense.c``),
  the same bits, so a prefill worker with AMX and a decode worker without one answer as one
  machine. The default's bf16 decode matmuls take the same tiles (``cpu_ops.use_amx``), its
  prefill oneDNN's, which a 512-token prefill on ours now matches (docs/benchmarks.md: the
  mode's cost there is the rest of a decode step).
- ``Kernel.TILES`` (``gemm_quant.c:xl_linear_dense``): fp32 multiply-adds in the quantized
  kernels' order on every CPU the portable kernels run on (bf16 weights widened exactly): fp32
  weights or activations, shapes the tiles do not take whole, and CPUs without AVX-512.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from xlserve.kernels import cpu_ops, portable_library, quant_ops


class Kernel(enum.Enum):
    TILES = "tiles"
    AMX = "amx"


MARK = "_xlserve_invariant"  # the Kernel of a weight of a model loaded --deterministic


def takes(weight: object) -> bool:
    """The kernel computes matmuls against this weight: a dense CPU tensor, fp32 or bf16, [N, K]
    or stacked [E, N, K], K a multiple of 16."""
    return (isinstance(weight, torch.Tensor) and weight.dim() in (2, 3) and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.shape[-1] % 16 == 0)


def kernel_for(weight: torch.Tensor, dtype: torch.dtype, tile_order: bool) -> Kernel:
    """AMX where ``tile_order`` (this process computes the tiles' order: on the tiles or their
    twin), the model computes in bf16 (rounding its activations to bf16 changes nothing) and
    the tiles take the bf16 weight whole ([N, K], both multiples of 32); TILES otherwise."""
    whole = weight.dim() == 2 and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0
    return Kernel.AMX if tile_order and dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and whole \
        else Kernel.TILES


def mark(model: nn.Module, dtype: torch.dtype, tile_order: bool = True) -> dict[Kernel, int]:
    """Mark every dense CPU matmul weight these kernels take with its kernel: each module's
    ``weight`` [N, K], and stacked weights [E, N, K] of a module that says it has them
    (``matmul_stacks``: a MoE layer's experts, which take TILES); returns how many took each.
    AMX wherever the AVX-512 kernels load (``cpu_ops``: the tiles where the OS grants them,
    their twin elsewhere), not with ``tile_order`` False (the fp32 kernel's tests)."""
    tile_order = tile_order and cpu_ops.kernels() is not None
    counts = dict.fromkeys(Kernel, 0)
    for module in model.modules():
        names = ("weight", *getattr(module, "matmul_stacks", ()))
        for weight in (getattr(module, name, None) for name in names):
            if takes(weight):
                kernel = kernel_for(weight, dtype, tile_order)
                setattr(weight, MARK, kernel)
                counts[kernel] += 1
    return counts


def kernel_of(weight: torch.Tensor) -> Kernel | None:
    """The kernel ``mark`` chose for ``weight`` (None: not marked)."""
    return getattr(weight, MARK, None)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A matmul of a model loaded --deterministic takes the kernel."""
    return kernel_of(weight) is not None and x.device.type == "cpu" and portable_library.kernels() is not None


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel can take this matmul, whatever the model was loaded with."""
    return x.device.type == "cpu" and takes(weight) and portable_library.kernels() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           residual: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias) (+ residual)`` on the weight's kernel (TILES when unmarked): fp32
    sums, rounded to ``x``'s dtype once (``quant_ops.finish``)."""
    if kernel_of(weight) is Kernel.AMX and all(t is None or t.dtype == torch.bfloat16 for t in (x, bias, residual)):
        # the tiles' own bf16 epilogue rounds as finish does, without the float32 copies of x and
        # of the sums: a prefill's matmuls, 512 tokens of the default model in bf16, ~20 ms of 240
        return cpu_ops.linear_amx(x, weight, bias, residual)
    n, k = weight.shape
    rows = quant_ops.fp32_rows(x, k)
    w = weight if weight.is_contiguous() else weight.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    args = (out.data_ptr(), rows.shape[0], n, k, n, torch.get_num_threads())
    if kernel_of(weight) is Kernel.AMX:
        cpu_ops.kernels().xl_linear_amx_dense(rows.data_ptr(), w.data_ptr(), *args)
    else:
        portable_library.kernels().xl_linear_dense(rows.data_ptr(), w.data_ptr(), int(w.dtype == torch.bfloat16),
                                                   *args)
    return quant_ops.finish(out, x, bias, residual)
