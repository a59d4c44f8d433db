"""The batch-invariant CPU attention (``attention_paged.c``): when it applies, and its call."""

from __future__ import annotations

import ctypes

import torch

from xlserve.kernels import portable_library


def kernel_for(q: torch.Tensor, k_cache: torch.Tensor) -> ctypes.CDLL | None:
    """The library, when the kernel takes this layer: CPU, fp32 or bf16 throughout, a head
    dimension of whole 16-lane vectors, query heads a multiple of the KV heads."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16) or q.dtype != k_cache.dtype:
        return None
    d = q.shape[-1]
    if d % 16 or q.shape[1] % k_cache.shape[1] or not k_cache.is_contiguous():
        return None
    return portable_library.kernels()


def paged_attention(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    table: torch.Tensor, row_seq: torch.Tensor, row_len: torch.Tensor, scale: float,
                    row_first: torch.Tensor | None = None, table_pos0: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] (rows may be strided) over caches [slots, Hk, D]: row t attends to entries
    ``row_first[t]`` (default 0) up to ``row_len[t]`` of ``table[row_seq[t]]``, whose entry 0
    holds position ``table_pos0[s]`` (default 0; where the kernel cuts its key tiles);
    ``sinks`` [Hq]: a logit per head in every softmax's denominator (gpt-oss). Returns [T, Hq, D]."""
    t, hq, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    out = torch.empty(t, hq, d, dtype=q.dtype)
    if sinks is not None:
        sinks = sinks.float().contiguous()
    pointers = [x.data_ptr() if x is not None else None for x in (table_pos0, row_first, sinks)]
    lib.xl_paged_attention_windowed(q.data_ptr(), q.stride(0), t, hq, k_cache.shape[1], d, k_cache.data_ptr(),
                                    v_cache.data_ptr(), table.data_ptr(), table.shape[1], pointers[0],
                                    row_seq.data_ptr(), pointers[1], row_len.data_ptr(), pointers[2], scale,
                                    out.data_ptr(), int(q.dtype == torch.bfloat16), torch.get_num_threads())
    return out
