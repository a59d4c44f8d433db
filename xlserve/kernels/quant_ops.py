"""The quantized-weight matmul and row lookup (``gemm_quant.c``): thin ctypes wrappers over
``portable_library``'s build, and the fp32 row layout and epilogue that its matmuls (quantized
and ``--deterministic`` dense) share."""

from __future__ import annotations

import ctypes

import torch


def fp32_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` as contiguous float32 rows of ``k`` values: what the kernels read."""
    rows = x.reshape(-1, k)
    return rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.float().contiguous()


def finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
           residual: torch.Tensor | None) -> torch.Tensor:
    """The kernels' float32 products [rows, N] ``+ bias``, rounded to ``x``'s dtype once, in
    ``x``'s leading shape, ``+ residual``."""
    if bias is not None:
        out += bias
    out = out.to(x.dtype).view(*x.shape[:-1], out.shape[1])
    return out if residual is None else residual + out


def linear(lib: ctypes.CDLL, qtype: int, x: torch.Tensor, data: torch.Tensor, out: torch.Tensor,
           column: int, eight_bit: bool = False) -> None:
    """``out[:, column:column + N] = x @ dequant(data).T``: x [M, K] float32, data [N, row
    bytes] uint8 of ``qtype``, out [M, ldo] float32, all contiguous; ``eight_bit``: Q4_0,
    Q4_1 and Q8_0 multiply 8-bit activations (``dot_q8.c``). Interleaved types (``X16``) take
    ``dot_q8_x16.c`` with it and the AMX kernel (``gemm_amx_quant.c``, bfloat16 activations)
    without."""
    m, k = x.shape
    lib.xl_linear_quant(qtype, x.data_ptr(), data.data_ptr(), data.shape[1], out[:, column:].data_ptr(), m,
                        data.shape[0], k, out.shape[1], int(eight_bit), torch.get_num_threads())


def dequantize_rows(lib: ctypes.CDLL, qtype: int, data: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ``ids`` of ``data`` dequantized: [len(ids), k] float32."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    lib.xl_dequant_rows(qtype, data.data_ptr(), data.shape[1], ids.data_ptr(), ids.numel(), k, out.data_ptr(),
                        torch.get_num_threads())
    return out
