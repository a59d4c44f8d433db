"""Paged attention over a flat token batch.

The KV cache of one layer is a pair of tensors ``[num_slots, num_kv_heads, head_dim]``
where slot = block_id * block_size + offset. New keys/values are scattered into their
slots, then each query attends to its sequence's context gathered through the block
table. Sequences that add one token (decode) attend as one padded batch; longer
chunks (prefill, chunked prefill, prefix hits) attend one sequence at a time.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from xlserve.kernels import attention_ops, cpu_ops
from xlserve.layers.window import Window

__all__ = ["AttentionMetadata", "DecodePath", "PrefillChunk", "Window", "get_attention_backend"]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as 0 / -inf in ``dtype``: SDPA's CPU flash kernel takes an additive
    mask directly, a boolean one costs it a conversion per layer."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def block_table(block_ids: list[list[int]], rows: int, width: int, fill: int) -> torch.Tensor:
    """[rows, width] block ids: row i holds sequence i's first ``width`` blocks, the rest of
    the table is ``fill``."""
    table = torch.full((rows, width), fill, dtype=torch.long)
    for i, blocks in enumerate(block_ids):
        used = blocks[:width]
        table[i, :len(used)] = torch.tensor(used, dtype=torch.long)
    return table


def decode_context(table: torch.Tensor, lens: torch.Tensor, context: int, block_size: int,
                   first: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The context of one-token sequences from their block table [B, >= context/block_size]
    and context lengths [B] (new token included): slots [B, context], ``real`` [B, context]
    (the positions below each length) and each row's new slot [B]; ``first`` [B]: a window's
    first position per row, where its context starts. Padding points at the row's own new
    slot: a masked key still has its value multiplied by a zero weight, and 0 x NaN is NaN,
    so padding must read a slot written this step, never memory that may hold any bit pattern."""
    pos = torch.arange(context, device=table.device)
    if first is None:
        slots = table[:, pos // block_size] * block_size + pos % block_size
        count = lens
    else:  # positions first .. lens - 1 of each row (padding clamped to the new token)
        rows = (first.unsqueeze(1) + pos).minimum((lens - 1).unsqueeze(1))
        slots = table.gather(1, rows // block_size) * block_size + rows % block_size
        count = lens - first
    real = pos.unsqueeze(0) < count.unsqueeze(1)
    new_slots = slots.gather(1, (count - 1).unsqueeze(1)).squeeze(1)
    return torch.where(real, slots, new_slots.unsqueeze(1)), real, new_slots


def host_decode_context(block_ids: list[list[int]], lens: list[int], block_size: int,
                        firsts: list[int] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``decode_context`` built on the host from each row's block ids, in numpy: slots, ``real``
    and new slots alike (padding points at the new token). A torch op on these small tensors
    costs microseconds of dispatch, tens right after a decode step has streamed the weights
    through every cache: the default model's whole step metadata took 250 us a token through
    ``decode_context``, ~150 through this (the CUDA graphs keep ``decode_context``: it runs
    on the device)."""
    firsts = firsts or [0] * len(lens)
    counts = [n - first for n, first in zip(lens, firsts)]
    slots = np.empty((len(lens), max(counts)), dtype=np.int64)
    offsets = np.arange(block_size)
    for row, blocks, n, first, count in zip(slots, block_ids, lens, firsts, counts):
        used = np.asarray(blocks[first // block_size:-(-n // block_size)], dtype=np.int64)
        row[:count] = (used[:, None] * block_size + offsets).ravel()[first % block_size:first % block_size + count]
        row[count:] = row[count - 1]
    ends = np.asarray(counts)
    return slots, np.arange(slots.shape[1]) < ends[:, None], slots[np.arange(len(lens)), ends - 1]


@dataclass
class PrefillChunk:
    """``end - start`` query rows of one sequence, at the end of its context."""
    start: int  # first row of the chunk in the flat batch
    end: int
    context_slots: torch.Tensor | None = None  # [C] slots of the whole context; None: no cached prefix
    prefix_first_slot: int | None = None  # the cached prefix is slots [this, this + C - n) when not None
    context_start: int = 0  # position of context_slots[0] (a windowed layer group's table starts later)


class DecodePath(str, enum.Enum):
    """The path of one step's forward (decided by ``engine/decode_plan.py:plan_decode``)."""
    CUDA_GRAPH = "cuda_graph"  # a decode step replayed from a captured CUDA graph of the eager model
    ONE_CALL = "one_call"  # every layer of a CPU decode step in one C call (cpu_ops.decode_layers_)
    # every layer in one call of the kernels built for any x86-64 CPU (kernels/decode_step.c):
    # weights kept quantized or dense under --deterministic, the eager path's bits
    PORTABLE_ONE_CALL = "portable_one_call"
    FUSED_LAYERS = "fused_layers"  # CPU decode step, each layer on the fused kernels from Python
    EAGER = "eager"  # torch ops: prefill chunks, mixed steps, and whatever no fast path takes


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    decode_rows: torch.Tensor | None = None  # [B] rows of one-token sequences
    decode_slots: torch.Tensor | None = None  # [B, L] context slots, padded
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, L] additive: 0 where a slot is real, else -inf
    decode_lens: torch.Tensor | None = None  # [B] context length of each decode row
    decode_firsts: torch.Tensor | None = None  # [B] position of decode_slots[:, 0] (a window's group); None: 0
    decode_new_slots: torch.Tensor | None = None  # [B] where each decode row's new K/V goes (CPU)
    cpu_kernels: bool = False  # the CPU kernels apply to this step (device, dtype, head shapes, library)
    decode_path: DecodePath = DecodePath.EAGER  # chosen once per step (engine/decode_plan.py)
    prefills: list[PrefillChunk] = field(default_factory=list)
    window_masks: dict = field(default_factory=dict)  # Window -> decode mask, built once per step
    contexts: dict = field(default_factory=dict)  # Window or None -> the paged CPU kernel's tables, once per step
    groups: dict = field(default_factory=dict)  # KV layer group -> its own metadata (engine/kv_groups.py)

    @property
    def fused_decode(self) -> bool:
        """A decode-only CPU step on the fused kernels (rows = batch, in order)."""
        return self.decode_path in (DecodePath.ONE_CALL, DecodePath.FUSED_LAYERS)

    @property
    def masks_decode(self) -> bool:
        """Decode rows attend through SDPA, which needs their padding masked; the one-call
        and fused kernels read each row's length instead."""
        return not self.fused_decode and self.decode_path is not DecodePath.PORTABLE_ONE_CALL

    def decode_window_mask(self, window: Window) -> torch.Tensor:
        """``decode_mask`` narrowed to what ``window`` lets each decode row see; computed on
        first use in a step and shared by every layer with that window."""
        mask = self.window_masks.get(window)
        if mask is None:
            lens = self.decode_lens.unsqueeze(1)
            positions = torch.arange(self.decode_slots.shape[1], device=lens.device).unsqueeze(0)
            allowed = (positions < lens) & window.allows(lens - 1, positions)
            mask = self.window_masks[window] = additive_mask(allowed[:, None, None, :], self.decode_mask.dtype)
        return mask


    def context_tables(self, rows: int, window: Window | None = None) -> tuple[torch.Tensor, ...]:
        """Every row's context for ``attention_ops.paged_attention``, built once per step and
        window: a slot table per sequence (decode rows, then prefill chunks) and the position
        of its entry 0, each row's table, its first entry (``window``: the first key it sees)
        and its number of entries (itself included)."""
        if window not in self.contexts:
            self.contexts[window] = self._context_tables(rows, window)
        return self.contexts[window]

    def _context_tables(self, rows: int, window: Window | None) -> tuple[torch.Tensor, ...]:
        tables, starts = [], []  # each sequence's slots, and the position of its entry 0
        row_seq, row_len = torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64)
        if self.decode_rows is not None:
            b = len(self.decode_rows)
            firsts = self.decode_firsts if self.decode_firsts is not None else torch.zeros(b, dtype=torch.int64)
            tables += list(self.decode_slots)
            starts += firsts.tolist()
            row_seq[self.decode_rows] = torch.arange(b)
            row_len[self.decode_rows] = self.decode_lens - firsts
        for chunk in self.prefills:
            slots = chunk.context_slots if chunk.context_slots is not None else \
                self.slot_mapping[chunk.start:chunk.end]
            n = chunk.end - chunk.start
            row_seq[chunk.start:chunk.end] = len(tables)
            row_len[chunk.start:chunk.end] = torch.arange(len(slots) - n + 1, len(slots) + 1)
            tables.append(slots)
            starts.append(chunk.context_start)
        table = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True) if tables else torch.zeros(1, 1)
        table_pos0 = torch.tensor(starts or [0], dtype=torch.int64)
        row_first = None
        if window is not None:  # a row at position p sees from window.first_key(p): an index into its table
            row_pos0 = table_pos0[row_seq]
            row_first = (window.first_keys(row_pos0 + row_len - 1) - row_pos0).clamp(min=0)
        return table.to(torch.int64).contiguous(), row_seq, row_len, row_first, table_pos0


class AttentionBackend(ABC):
    """Computes attention for one layer. Invariants: writes every new token's K/V to
    ``slot_mapping`` before reading, and returns one output row per query row; a ``window``
    layer reads no key outside its window; ``scale`` None is 1/sqrt(head_dim); ``sinks`` [Hq]:
    a logit per head that joins every softmax's denominator and no value (gpt-oss)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, window: Window | None = None, scale: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        ...


class TorchSDPABackend(AttentionBackend):
    def forward(self, q, k, v, kv_cache, meta, window=None, scale=None, sinks=None):
        k_cache, v_cache = kv_cache
        if meta.fused_decode:  # one kernel writes the new K/V and attends
            return cpu_ops.decode_attention(q, k, v, meta.slot_mapping, k_cache, v_cache, meta.decode_slots,
                                            meta.decode_lens, scale or q.shape[-1] ** -0.5)
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        lib = attention_ops.kernel_for(q, k_cache)
        if lib is not None:  # CPU: one reduction order per row, whatever the step (batch-invariant)
            table, row_seq, row_len, row_first, table_pos0 = meta.context_tables(q.shape[0], window)
            return attention_ops.paged_attention(lib, q, k_cache, v_cache, table, row_seq, row_len,
                                                 scale or q.shape[-1] ** -0.5, row_first, table_pos0, sinks)
        if window is not None or sinks is not None:
            return _masked(q, k_cache, v_cache, meta, window, scale, sinks)
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            qd = q[rows].unsqueeze(2)  # [B, Hq, 1, D]
            kd = k_cache[meta.decode_slots].transpose(1, 2)  # [B, Hkv, L, D]
            vd = v_cache[meta.decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, enable_gqa=True, scale=scale)
            out[rows] = od.squeeze(2)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.end)
            if chunk.context_slots is None:
                # 4-D inputs: with 3-D ones torch's CPU SDPA leaves its flash kernel for the
                # quadratic math path (20x slower at 2,000 tokens).
                op = F.scaled_dot_product_attention(_heads_first(q[rows]), _heads_first(k[rows]),
                                                    _heads_first(v[rows]), is_causal=True, enable_gqa=True, scale=scale)
                out[rows] = op.squeeze(0).transpose(0, 1)
            else:
                out[rows] = _attend_context(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
        return out


def _masked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
            window: Window | None, scale: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention under an explicit mask, the new K/V already in the cache (windowed layers,
    sinks): decode rows under the step's (window) mask, each chunk over the keys from its
    window's first position on."""
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        rows = meta.decode_rows
        qd = q[rows].unsqueeze(2)
        kd, vd = k_cache[meta.decode_slots].transpose(1, 2), v_cache[meta.decode_slots].transpose(1, 2)
        mask = meta.decode_window_mask(window) if window is not None else meta.decode_mask
        out[rows] = _attend(qd, kd, vd, mask, scale, sinks).squeeze(2)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.end)
        slots = chunk.context_slots if chunk.context_slots is not None else meta.slot_mapping[rows]
        n, start, end = chunk.end - chunk.start, chunk.context_start, chunk.context_start + len(slots)
        first = (window.first_key(end - n) if window is not None else 0) - start  # index into slots
        positions = torch.arange(start, end, device=q.device)
        q_pos, k_pos = positions[len(slots) - n:, None], positions[None, first:]
        allowed = window.allows(q_pos, k_pos) if window is not None else k_pos <= q_pos
        keys, values = k_cache[slots[first:]], v_cache[slots[first:]]
        o = _attend(_heads_first(q[rows]), _heads_first(keys), _heads_first(values), additive_mask(allowed, q.dtype),
                    scale, sinks)
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """[B, Hq, Lq, D] queries over [B, Hk, L, D] keys and values under an additive mask; with
    ``sinks``, each head's sink logit joins the softmax (computed in the activations' dtype,
    as the reference does) and its weight is dropped."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5) + mask
    logits = torch.cat((scores, sinks.to(q.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(logits, dim=-1)[..., :-1] @ v


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, chunk: PrefillChunk, scale: float | None = None) -> torch.Tensor:
    """A chunk [n, Hq, D] (its own keys and values ``k``, ``v``, already in the cache) after
    a cached prefix: each row attends to the prefix and to the chunk up to itself."""
    n, hq, d = q.shape
    if q.device.type != "cpu" or _CPU_FLASH is None:
        # one fused-attention call (flash on CUDA) with the causal mask aligned to the
        # chunk's end; no mask is materialized. Imported here: the module pulls in
        # torch._dynamo (over a second and tens of MiB), which CPU serving never needs.
        from torch.nn.attention.bias import causal_lower_right
        ctx = chunk.context_slots
        out = F.scaled_dot_product_attention(_heads_first(q), _heads_first(k_cache[ctx]), _heads_first(v_cache[ctx]),
                                             attn_mask=causal_lower_right(n, len(ctx)), enable_gqa=True, scale=scale)
        return out.squeeze(0).transpose(0, 1)
    # CPU: the query heads that share a KV head are stacked along the query axis
    # ([1, Hk, G*n, D]): fewer, larger products over the long context, no K/V copy per head
    hk = k_cache.shape[1]
    group = hq // hk
    qg = q.view(n, hk, group, d).permute(1, 2, 0, 3).reshape(1, hk, group * n, d)
    start = len(chunk.context_slots) - n
    if chunk.prefix_first_slot is not None:  # consecutive blocks: read the cache in place
        first = chunk.prefix_first_slot
        k_prefix, v_prefix = k_cache[first:first + start], v_cache[first:first + start]
    else:
        k_prefix, v_prefix = k_cache[chunk.context_slots[:start]], v_cache[chunk.context_slots[:start]]
    og = _split_attention(qg, _heads_first(k_prefix), _heads_first(v_prefix), _heads_first(k), _heads_first(v), group,
                          scale)
    return og.view(hk, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [1, H, T, D] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def _split_attention(qg: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k_self: torch.Tensor,
                     v_self: torch.Tensor, group: int, scale: float | None = None) -> torch.Tensor:
    """Attention over [cached prefix | the chunk itself] as two flash calls merged by their
    log-sum-exps: the prefix needs no mask at all and the chunk is plainly causal, so no
    [n, C] mask is built or read, and the causal half skips its upper triangle."""
    _, hk, rows, d = qg.shape
    n = rows // group
    o_prefix, lse_prefix = _CPU_FLASH(qg, k_prefix, v_prefix, scale=scale)
    q_heads = qg.view(hk, group, n, d).reshape(1, hk * group, n, d)
    o_self, lse_self = _CPU_FLASH(q_heads, k_self.repeat_interleave(group, 1), v_self.repeat_interleave(group, 1),
                                  is_causal=True, scale=scale)
    lse_self = lse_self.reshape(1, hk, group * n)
    top = torch.maximum(lse_prefix, lse_self)
    w_prefix, w_self = (lse_prefix - top).exp_(), (lse_self - top).exp_()
    total = w_prefix + w_self
    merged = o_prefix.float() * (w_prefix / total).unsqueeze(-1) + \
        o_self.reshape(1, hk, group * n, d).float() * (w_self / total).unsqueeze(-1)
    return merged.to(qg.dtype)


ATTENTION_BACKENDS = {"torch_sdpa": TorchSDPABackend}


def get_attention_backend(name: str = "torch_sdpa") -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r} unknown; available: {sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]()
