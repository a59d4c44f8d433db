"""CUDA graphs of decode-only steps.

A decode step of a small model on a GPU is bound by kernel launches (~15 per layer),
not by the GPU: replaying the whole forward from one captured graph turns hundreds of
launches and their Python into one. A graph has fixed shapes, so steps are padded to a
bucket: the batch to the next of ``BATCH_BUCKETS``, the context to the next power of two
of at least ``MIN_CONTEXT`` tokens. Graphs are captured on first use and share one
memory pool (replays never overlap, and no graph reads another's temporaries).
"""

from __future__ import annotations

import torch

from xlserve.layers.attention import AttentionMetadata, additive_mask, block_table, decode_context

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_CONTEXT = 256


class DecodeGraphs:
    """Replays decode-only steps. Invariants: the step's rows fill the head of a bucket's
    static inputs; padding rows have context length 1 and a block table of the scratch
    block (outside the block pool), so they write and read nothing real; every buffer a
    replay reads is written before it, and the returned logits hold the real rows first."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, block_size: int,
                 scratch_block: int, max_context: int):
        self.model = model
        self.device, self.dtype = device, dtype
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_context = _context_bucket(max_context, block_size)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}

    def supports(self, batch: int, longest: int) -> bool:
        return batch <= BATCH_BUCKETS[-1] and longest <= self.max_context

    def logits(self, ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Logits [bucket, vocab] of one decode step; row i is sequence i's next token."""
        batch = len(ids)
        lens = [p + 1 for p in positions]
        key = (next(b for b in BATCH_BUCKETS if b >= batch),
               min(_context_bucket(max(lens), self.block_size), self.max_context))
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, inputs, out = self.graphs[key]
        host = {"ids": _padded(ids, key[0], 0), "positions": _padded(positions, key[0], 0),
                "lens": _padded(lens, key[0], 1),
                "table": block_table(block_tables, key[0], key[1] // self.block_size, self.scratch_block)}
        for name, value in host.items():
            inputs[name].copy_(value, non_blocking=False)
        graph.replay()
        return out

    def _static_inputs(self, batch: int, context: int) -> dict[str, torch.Tensor]:
        width = context // self.block_size
        return {"ids": torch.zeros(batch, dtype=torch.int64, device=self.device),
                "positions": torch.zeros(batch, dtype=torch.int64, device=self.device),
                "lens": torch.ones(batch, dtype=torch.int64, device=self.device),
                "table": torch.full((batch, width), self.scratch_block, dtype=torch.int64, device=self.device)}

    def _forward(self, inputs: dict[str, torch.Tensor], context: int) -> torch.Tensor:
        batch = inputs["ids"].shape[0]
        slots, real, new_slots = decode_context(inputs["table"], inputs["lens"], context, self.block_size)
        meta = AttentionMetadata(slot_mapping=new_slots, decode_rows=torch.arange(batch, device=self.device),
                                 decode_slots=slots, decode_lens=inputs["lens"], decode_new_slots=new_slots,
                                 decode_mask=additive_mask(real.view(batch, 1, 1, context), self.dtype))
        hidden = self.model(inputs["ids"], inputs["positions"], meta)
        return self.model.compute_logits(hidden)

    def _capture(self, batch: int, context: int):
        inputs = self._static_inputs(batch, context)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: lazy inits, cuBLAS handles
            for _ in range(2):
                self._forward(inputs, context)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(inputs, context)
        return graph, inputs, out


def _context_bucket(tokens: int, block_size: int) -> int:
    size = MIN_CONTEXT
    while size < tokens:
        size *= 2
    return max(size, block_size)


def _padded(values: list[int], size: int, fill: int) -> torch.Tensor:
    return torch.tensor(values + [fill] * (size - len(values)), dtype=torch.int64)
