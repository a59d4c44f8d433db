"""The pool of KV blocks: reference counts, the prefix cache, and LRU reuse of freed blocks.

Invariants:
- a block is in the free queue iff its ref_cnt is 0;
- a block with a hash is findable through ``cached`` until it is handed out again;
- free blocks are reused least-recently-freed first, so recently used prefixes stay longest;
- an evicted cached block is shown to ``on_evict`` before its slot is reused.

Layer groups (``engine/kv_groups.py``) share the pool; a cached block is found by its
group and hash (group 0's by the hash alone: those are the ones KV events announce).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from xlserve.engine.kv_events import KVEventLog
from xlserve.hashing import BlockHash

CacheKey = BlockHash | tuple  # group 0: the hash; group g: (g, hash)


def cache_key(block_hash: BlockHash, group: int = 0) -> CacheKey:
    return block_hash if group == 0 else (group, block_hash)


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: CacheKey | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[CacheKey, KVBlock] = {}
        self.events = KVEventLog()
        # called with (block id, hash) of the cached blocks (layer group 0) an allocation
        # takes back, before anything overwrites them: the KV tiers' write-back
        self.on_evict: Callable[[list[tuple[int, BlockHash]]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def lookup(self, block_hash: BlockHash, group: int = 0) -> KVBlock | None:
        return self.cached.get(cache_key(block_hash, group))

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free_queue)} free")
        out = []
        evicted: list[tuple[int, BlockHash]] = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if self.on_evict is not None and isinstance(block.block_hash, bytes):
                evicted.append((block_id, block.block_hash))
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        if evicted:  # their bytes are still there: nothing writes a block before allocate returns
            self.on_evict(evicted)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks (prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each. Pass a request's blocks tail first: the tail of a
        prefix is the least likely to be shared, so it should be evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None

    def cache_block(self, block: KVBlock, block_hash: BlockHash, group: int = 0) -> None:
        key = cache_key(block_hash, group)
        if not self.enable_caching or block.block_hash is not None:
            return
        if key in self.cached:  # same content computed twice: keep the first copy
            return
        block.block_hash = key
        self.cached[key] = block
        if group == 0:
            self.events.stored(block_hash)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if not isinstance(block.block_hash, tuple):
                    self.events.removed(block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True
