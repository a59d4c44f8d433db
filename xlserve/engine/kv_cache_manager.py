"""Per-request KV blocks on top of the block pool: prefix-cache lookup, slot allocation,
free, one block table per layer group (windowed groups free what left their window); and
the pool's one owner: blocks leave and enter it by hash (export, import, pins) only
through here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xlserve.engine.block_pool import BlockPool, KVBlock
from xlserve.engine.kv_blocks import KVBlockStore, KVLayout, KVPayload, KVShards, PinGrant, cached_prefix
from xlserve.engine.kv_groups import KVGroup
from xlserve.engine.request import Request
from xlserve.hashing import BlockHash
from xlserve.kvstore.tiered import TieredKV, TierLoad


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 groups: tuple[KVGroup, ...] = (KVGroup(None, ()),)):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = groups  # layer groups (engine/kv_groups.py); group 0 keeps every token
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[list[KVBlock | None]]] = {}  # request -> one table per group
        self.num_hashed_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        self._by_hash: KVBlockStore | None = None
        self.tiers: TieredKV | None = None
        self.held_for_load: dict[str, list[KVBlock]] = {}  # request -> its device hit, held while tiers load the rest

    # -- blocks by hash (disaggregation, tiers) ---------------------------------------
    def attach(self, kv_caches: list[tuple[torch.Tensor, ...]], layout: KVLayout,
               shards: KVShards | None = None) -> None:
        """The tensors behind the pool's blocks (the model runner allocates them); ``shards``:
        the other tensor-parallel ranks' heads of them."""
        self._by_hash = KVBlockStore(self.pool, kv_caches, layout, self.groups, shards)

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

    def cached_blocks(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of ``hashes`` the pool holds (what ``pin`` and ``export`` would take)."""
        return len(self._by_hash.cached_prefix(hashes)[0])

    def holds_pin(self, pin_id: str) -> bool:
        return pin_id in self._by_hash.pins

    def pin(self, hashes: list[BlockHash], seconds: float) -> PinGrant:
        return self._by_hash.pin(hashes, seconds)

    def unpin(self, pin_id: str) -> bool:
        return self._by_hash.unpin(pin_id)

    def expire_pins(self, now: float | None = None) -> int:
        return self._by_hash.expire_pins(now) if self._by_hash.pins else 0

    @property
    def num_pins(self) -> int:
        return len(self._by_hash.pins) if self._by_hash else 0

    # -- KV tiers (kvstore/): write-back on eviction, write-through at the end, read-through
    def attach_tiers(self, tiers: TieredKV) -> None:
        if len(self.groups) > 1:
            raise ValueError("KV tiers hold models whose every layer keeps every token; this model has "
                             "windowed layers (serve it without --kv-tiers)")
        self.tiers = tiers
        self.pool.on_evict = self._write_back
        tiers.attach_events(self.pool.events)

    def detach_tiers(self) -> TieredKV | None:
        """The pool stops offering blocks to the tiers; returns them (the caller closes them)."""
        tiers, self.tiers = self.tiers, None
        self.pool.on_evict = None
        return tiers

    def _write_back(self, evicted: list[tuple[int, BlockHash]]) -> None:
        wanted = [e for e, want in zip(evicted, self.tiers.wants_evicted([h for _, h in evicted])) if want]
        if wanted:
            self.tiers.offer_evicted([h for _, h in wanted], self._by_hash.read([i for i, _ in wanted]))

    def write_through(self, request: Request) -> None:
        """Send a request's computed blocks to the cluster tier (those not sent before): once its
        prompt is computed, and again when it finishes."""
        table = self.req_blocks.get(request.request_id)
        if self.tiers is None or not self.tiers.cluster or not table:
            return
        n = min(request.num_computed_tokens // self.block_size, len(request.block_hashes), len(table[0]))
        hashes = request.block_hashes[:n]
        wanted = [i for i, want in enumerate(self.tiers.wants_written_through(hashes)) if want]
        if wanted:
            self.tiers.offer_finished([hashes[i] for i in wanted],
                                      self._by_hash.read([table[0][i].block_id for i in wanted]))

    def start_load(self, request: Request):
        """Ask the tiers for the blocks of the request's prefix that follow its device hit;
        a ``Future`` of a ``TierLoad``, or None when there is nothing to ask. The device hit
        is held until ``finish_load``: the load's own blocks must not evict it."""
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        hit = []
        while len(hit) < len(hashes) and (block := self.pool.lookup(hashes[len(hit)])) is not None:
            hit.append(block)
        future = self.tiers.lookup(hashes[len(hit):])
        if future is not None:
            self.pool.touch(hit)
            self.held_for_load[request.request_id] = hit
        return future

    def finish_load(self, request: Request, load: TierLoad | None) -> int:
        """Put what a tier lookup fetched (None: nothing arrived in time) into the pool,
        published and evictable, and let go of the device hit; returns the blocks loaded."""
        loaded = 0
        if load is not None and load.hashes:
            self.tiers.known_in_cluster(load.in_cluster)
            loaded = self._by_hash.import_(KVPayload(self.layout, load.hashes, load.data))
        self.pool.free(list(reversed(self.held_for_load.pop(request.request_id, []))))
        return loaded

    def events_since(self, since: int, epoch: str) -> dict:
        """Block-hash events (stored / removed) after ``since``, or a snapshot."""
        return self.pool.events.since(since, epoch, lambda: [k for k in self.pool.cached if not isinstance(k, tuple)])

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # -- a request's blocks, one table per layer group ---------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[list], int]:
        """Longest cached prefix of the request, in whole blocks, as each group's hits: group
        0's blocks, and for a windowed group its blocks inside the window at the prefix's end
        (None before it). At least one token is always left to compute, since the last
        position's logits are needed."""
        if not self.enable_caching:
            return [[] for _ in self.groups], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        full, *windows = cached_prefix(self.pool, self.groups, request.block_hashes[:max_blocks], self.block_size)
        hit = len(full)
        return [full, *([None] * (hit - len(w)) + w for w in windows)], hit * self.block_size

    def blocks_for(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` holds at once, computing at most
        ``step_tokens`` a step: every block in group 0; in a windowed group, those spanning a
        step's tokens and the window before them."""
        bs = self.block_size
        total = -(-num_tokens // bs)
        for group in self.groups[1:]:
            span = group.window.size - 1 + min(step_tokens, num_tokens)
            total += min(-(-num_tokens // bs), -(-span // bs) + 1)
        return total

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queried_tokens += num_tokens
        self.stats.hit_tokens += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: list[list] = ()) -> bool:
        """Make room for ``num_new_tokens`` beyond the computed ones (``new_computed_blocks``:
        prefix hits from ``get_computed_blocks``); False if the pool is short. Blocks a
        windowed group no longer reads are freed first."""
        tables = self.req_blocks.setdefault(request.request_id, [[] for _ in self.groups])
        hits = list(new_computed_blocks) or [[] for _ in self.groups]
        num_computed = request.num_computed_tokens + len(hits[0]) * self.block_size
        total = num_computed + num_new_tokens
        self._free_outside_windows(tables, num_computed)
        blocks_needed = -(-total // self.block_size)
        need = sum(max(blocks_needed - max(len(t) + len(h), group.first_block(num_computed, self.block_size)), 0)
                   for t, h, group in zip(tables, hits, self.groups))
        fresh = [b for group_hits in hits for b in group_hits if b is not None]
        if need > self.pool.num_free_blocks - sum(1 for b in fresh if b.ref_cnt == 0):
            if not any(tables):
                del self.req_blocks[request.request_id]
            return False
        self.pool.touch(fresh)
        for g, (table, group_hits) in enumerate(zip(tables, hits)):
            table.extend(group_hits)
            first = self.groups[g].first_block(num_computed, self.block_size)
            while len(table) < first:  # a window that starts past the table's end (chunked layers)
                table.append(None)
            if blocks_needed > len(table):
                table.extend(self.pool.allocate(blocks_needed - len(table)))
        self._cache_full_blocks(request, tables, total)
        return True

    def _free_outside_windows(self, tables: list[list], position: int) -> None:
        for g in range(1, len(self.groups)):
            table = tables[g]
            first = min(self.groups[g].first_block(position, self.block_size), len(table))
            gone = [b for b in table[:first] if b is not None]
            table[:first] = [None] * first
            self.pool.free(list(reversed(gone)))

    def _cache_full_blocks(self, request: Request, tables: list[list], num_tokens: int) -> None:
        # Blocks are published as soon as this step will have filled them: another
        # request that hits them in the same step reads them after they are written,
        # since attention writes every new K/V before it reads any.
        start = self.num_hashed_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for g, table in enumerate(tables):
            for i in range(start, end):
                if table[i] is not None:
                    self.pool.cache_block(table[i], request.block_hashes[i], g)
        self.num_hashed_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        tables = self.req_blocks.pop(request.request_id, [])
        self.num_hashed_blocks.pop(request.request_id, None)
        for table in tables:
            self.pool.free([b for b in reversed(table) if b is not None])

    def block_ids(self, request_id: str) -> list[list[int]]:
        """Each group's block ids; -1 where a windowed group freed the block."""
        return [[b.block_id if b is not None else -1 for b in table] for table in self.req_blocks.get(request_id, [])]

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks
