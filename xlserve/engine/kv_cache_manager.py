"""Per-request KV blocks on top of the block pool: prefix-cache lookup, slot allocation,
free; and the pool's one owner: blocks leave and enter it by hash (export, import, pins)
only through here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xlserve.engine.block_pool import BlockPool, KVBlock
from xlserve.engine.kv_blocks import KVBlockStore, KVLayout, KVPayload, PinGrant
from xlserve.engine.request import Request
from xlserve.hashing import BlockHash


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_hashed_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        self._by_hash: KVBlockStore | None = None

    # -- blocks by hash (disaggregation, tiers) ---------------------------------------
    def attach(self, kv_caches: list[tuple[torch.Tensor, ...]], layout: KVLayout) -> None:
        """The tensors behind the pool's blocks (the model runner allocates them)."""
        self._by_hash = KVBlockStore(self.pool, kv_caches, layout)

    @property
    def layout(self) -> KVLayout:
        return self._by_hash.layout

    def export(self, hashes: list[BlockHash]) -> KVPayload:
        """The cached prefix of ``hashes``; local use (a peer reads through ``export_pinned``)."""
        return self._by_hash.export(hashes)

    def export_pinned(self, pin_id: str, secret: str, hashes: list[BlockHash]) -> KVPayload:
        return self._by_hash.export_pinned(pin_id, secret, hashes)

    def import_blocks(self, payload: KVPayload) -> int:
        return self._by_hash.import_(payload)

    def pin(self, hashes: list[BlockHash], seconds: float) -> PinGrant:
        return self._by_hash.pin(hashes, seconds)

    def unpin(self, pin_id: str) -> bool:
        return self._by_hash.unpin(pin_id)

    def expire_pins(self, now: float | None = None) -> int:
        return self._by_hash.expire_pins(now) if self._by_hash.pins else 0

    @property
    def num_pins(self) -> int:
        return len(self._by_hash.pins) if self._by_hash else 0

    def events_since(self, since: int, epoch: str) -> dict:
        """Block-hash events (stored / removed) after ``since``, or a snapshot."""
        return self.pool.events.since(since, epoch, lambda: list(self.pool.cached))

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, in whole blocks. At least one token is
        always left to compute, since the last position's logits are needed."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queried_tokens += num_tokens
        self.stats.hit_tokens += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] = ()) -> bool:
        """Make room for ``num_new_tokens`` beyond the computed ones; False if the pool is short."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        need = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reclaimed:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        self.pool.touch(list(new_computed_blocks))
        blocks.extend(new_computed_blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        self._cache_full_blocks(request, blocks, total)
        return True

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # Blocks are published as soon as this step will have filled them: another
        # request that hits them in the same step reads them after they are written,
        # since attention writes every new K/V before it reads any.
        start = self.num_hashed_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_hashed_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_hashed_blocks.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks
