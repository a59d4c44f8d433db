"""The portable kernels' row operations and one-call decode step (``decode_step.c``): their
ctypes calls, and the table of addresses the step reads per layer.

A projection enters the table when the C step computes it exactly as the eager path does:
a ``QuantizedWeight`` whose parts are all block formats (``QuantizedWeight.linear``), or a
dense weight marked for ``--deterministic`` (``invariant_linear``). Anything else (a dense
part the eager path multiplies with torch, too many parts) keeps the step on the eager path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from xlserve.kernels import cpu_ops, invariant_linear
from xlserve.layers.quantized import QuantizedWeight

DENSE = {torch.float32: -1, torch.bfloat16: -2}  # decode_step.c: DENSE_F32, DENSE_BF16
DENSE_CALL = -3  # decode_step.c: a dense part whose kernel's address the table holds (the AMX library's)
PART_FIELDS, MAX_PARTS = 4, 3
PROJECTION_FIELDS = 2 + PART_FIELDS * MAX_PARTS
MAX_HEAD_DIM = 2048  # the rotary scratch of decode_step.c


def _is_bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def rmsnorm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm over the last dimension (``norm.py:RMSNorm``), one reduction order per row."""
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    h = x.shape[-1]
    lib.xl_row_rmsnorm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // h, h, eps, _is_bf16(x),
                       torch.get_num_threads())
    return out


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for rows of [gate | up]."""
    gate_up = gate_up.contiguous()
    i = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], i, dtype=gate_up.dtype)
    lib.xl_row_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * i), i, _is_bf16(gate_up),
                        torch.get_num_threads())
    return out


def projection_entry(weight, dtype: torch.dtype) -> list[int] | None:
    """A projection's ``PROJECTION_FIELDS`` table values, or None when the C step cannot compute
    it as the eager path does."""
    kernel = invariant_linear.kernel_of(weight) if isinstance(weight, torch.Tensor) else None
    if isinstance(weight, QuantizedWeight):
        if len(weight.parts) > MAX_PARTS or any(p.qtype is None or not p.data.is_contiguous() for p in weight.parts):
            return None
        parts = [(int(p.qtype), p.data.data_ptr(), p.data.shape[1], p.rows) for p in weight.parts]
        eight_bit = int(weight.eight_bit_activations)
    elif kernel is invariant_linear.Kernel.AMX and weight.is_contiguous():
        parts, eight_bit = [(DENSE_CALL, weight.data_ptr(), _amx_dense_address(), weight.shape[0])], 0
    elif kernel is invariant_linear.Kernel.TILES and weight.is_contiguous() and weight.dtype in DENSE:
        parts, eight_bit = [(DENSE[weight.dtype], weight.data_ptr(), 0, weight.shape[0])], 0
    else:
        return None
    if weight.shape[1] % 16:
        return None
    flat = [value for part in parts for value in part]
    return [len(parts), eight_bit, *flat] + [0] * (PART_FIELDS * MAX_PARTS - len(flat))


@functools.cache
def _amx_dense_address() -> int:
    """Where ``gemm_amx.c:xl_linear_amx_dense`` lies (the tiles, or their twin where the process
    has none): the portable build has neither, so the step calls the other library's through
    this address."""
    return ctypes.cast(cpu_ops.kernels().xl_linear_amx_dense, ctypes.c_void_p).value


def tensor_address(t: torch.Tensor | None, dtype: torch.dtype) -> int | None:
    """The address of a norm weight or bias in the activation dtype (0: none); None when it is
    not one the C step reads as such."""
    if t is None:
        return 0
    return t.data_ptr() if t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu" else None


def decode_step_(lib: ctypes.CDLL, x: torch.Tensor, table: torch.Tensor, eps: float, num_heads: int,
                 num_kv_heads: int, head_dim: int, intermediate: int, cos: torch.Tensor, sin: torch.Tensor,
                 new_slots: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float) -> None:
    """Every layer on ``x`` [B, H] in place; ``table`` [layers, fields] int64 from
    ``layer entries``; cos/sin [B, D] in x's dtype; row b writes its K/V to ``new_slots[b]`` and
    attends to the first ``lens[b]`` of ``slots[b]``."""
    fields = layer_fields(lib)
    if table.dim() != 2 or table.shape[1] != fields or table.dtype != torch.int64:
        # the C loop reads raw addresses: any other table is a crash
        raise ValueError(f"the decode step needs an int64 [layers, {fields}] table, got {table.dtype} "
                         f"{tuple(table.shape)}")
    if head_dim > MAX_HEAD_DIM or x.dtype not in DENSE or not x.is_contiguous():
        raise ValueError(f"the decode step takes contiguous fp32 or bf16 rows and head_dim <= {MAX_HEAD_DIM}")
    b, h = x.shape
    # named, so each lives until the call returns (the C step reads their addresses)
    cos, sin = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
    new_slots, slots, lens = (t.to(torch.int64).contiguous() for t in (new_slots, slots, lens))
    lib.xl_decode_step(x.data_ptr(), b, h, table.shape[0], table.data_ptr(), eps, num_heads, num_kv_heads,
                       head_dim, intermediate, cos.data_ptr(), sin.data_ptr(), new_slots.data_ptr(), slots.data_ptr(),
                       slots.shape[1], lens.data_ptr(), scale, _is_bf16(x), torch.get_num_threads())


@functools.cache
def layer_fields(lib: ctypes.CDLL) -> int:
    """The int64 fields of a layer's table row in this build (decode_step.c's LAYER_FIELDS)."""
    return lib.xl_decode_step_layer_fields()
