"""Data-parallel attention: rank 0 schedules every rank's batch. One ``Scheduler`` per rank,
each the sole owner of that rank's KV pool (its requests' blocks live there for their whole
life), behind the interface the engine drives for one.

A new request goes to the rank where it costs least: the tokens its requests have yet to
compute (a waiting request's cached prefix counted too, one per decoding request) plus the
ones the new request would compute after that rank's prefix-cache hit. A shared system
prompt so draws its turns to the rank that holds it until that rank's queue outweighs
recomputing the prefix elsewhere (then both hold it), instead of herding every turn onto
one rank or ignoring the cache.

Invariants: a request is in exactly one rank's scheduler, from ``add_request`` until it
finishes; each step's chunks carry their rank (``ScheduledRequest.dp_rank``); each rank has
its own token budget and ``max_num_seqs``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

from xlserve.engine.kv_cache_manager import KVCacheManager, PrefixCacheStats
from xlserve.engine.kv_events import KVEventLog
from xlserve.engine.request import FinishReason, Request
from xlserve.engine.scheduler import Scheduler, SchedulerOutput

NO_TIERS = ("a worker with --data-parallel-attention keeps each request's KV on the rank that runs it: KV tiers "
           "do not reach it yet; serve it without --kv-tiers")


class RankSchedulers:
    def __init__(self, ranks: list[Scheduler]):
        self.ranks = ranks
        self.placed = [0] * len(ranks)  # requests each rank has been given
        self.requests = collections.ChainMap(*(r.requests for r in ranks))
        self.kv = RankPools([r.kv for r in ranks], self._queued_tokens)
        self.loading: dict = {}  # KV tiers are refused: nothing ever loads

    @property
    def running(self) -> list[Request]:
        return [req for r in self.ranks for req in r.running]

    @property
    def waiting(self) -> list[Request]:
        return [req for r in self.ranks for req in r.waiting]

    @property
    def num_unfinished(self) -> int:
        return sum(r.num_unfinished for r in self.ranks)

    @property
    def num_preemptions(self) -> int:
        return sum(r.num_preemptions for r in self.ranks)

    @property
    def num_tier_timeouts(self) -> int:
        return 0

    def add_request(self, request: Request) -> None:
        rank = min(range(len(self.ranks)), key=lambda r: (self._queued_tokens(r) + self._to_compute(r, request), r))
        self.placed[rank] += 1
        self.ranks[rank].add_request(request)

    def rank_of(self, request_id: str) -> int | None:
        """The rank whose scheduler holds the request (None: none does)."""
        return next((r for r, s in enumerate(self.ranks) if request_id in s.requests), None)

    def _queued_tokens(self, rank: int) -> int:
        s = self.ranks[rank]
        return sum(req.num_tokens - req.num_computed_tokens for req in itertools.chain(s.running, s.waiting))

    def _to_compute(self, rank: int, request: Request) -> int:
        return request.num_tokens - self.ranks[rank].kv.get_computed_blocks(request)[1]

    def overdue(self, timeout: float, now: float) -> list[str]:
        return [rid for r in self.ranks for rid in r.overdue(timeout, now)]

    def schedule(self) -> SchedulerOutput:
        outputs = [r.schedule() for r in self.ranks]
        scheduled = [dataclasses.replace(s, dp_rank=rank) for rank, out in enumerate(outputs) for s in out.scheduled]
        return SchedulerOutput(scheduled, sum(o.num_batched_tokens for o in outputs),
                               [rid for o in outputs for rid in o.finished_request_ids])

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]],
               logprobs: dict[str, list[dict]]) -> list[tuple[Request, int]]:
        advanced = []
        for rank, scheduler in enumerate(self.ranks):
            mine = [s for s in output.scheduled if s.dp_rank == rank]
            advanced += scheduler.update(SchedulerOutput(mine, sum(len(s.token_ids) for s in mine)), sampled, logprobs)
        return advanced

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        rank = self.rank_of(request_id)
        return None if rank is None else self.ranks[rank].finish(request_id, reason)

    def shares(self) -> list[dict]:
        """Each rank's requests placed so far and KV blocks in use (the metrics' per-rank series)."""
        return [{"placed": placed, "kv_blocks_used": rank.kv.num_used_blocks}
                for placed, rank in zip(self.placed, self.ranks)]

    def wait_for_loads(self, timeout: float) -> None:
        """Nothing loads (KV tiers are refused)."""


class RankPools:
    """The ranks' KV pools as the engine and the server see them: counters summed, block-hash
    events merged (a hash is stored while any rank holds it). A hand-off reads a pinned
    prefix from the rank that holds the longest of it, and an import goes to the rank with
    the shortest queue (the request that follows is placed where its prefix hit is); the
    blocks move between rank 0 and that rank point to point (``OtherRankPool``)."""

    def __init__(self, pools: list[KVCacheManager], queued_tokens):
        self.pools = pools
        self.queued_tokens = queued_tokens  # rank -> the tokens its requests have yet to compute
        self.events = SharedEvents()
        for pool in pools:
            pool.pool.events = self.events
        self.tiers = None

    def attach(self, kv_caches, layout, shards=None) -> None:
        """Rank 0's pool reads its own tensors; every other rank's goes through ``shards`` (the
        worker's ranks) to that rank."""
        from xlserve.parallel.ranks import OtherRankPool
        for rank, pool in enumerate(self.pools):
            pool.attach(kv_caches, layout, OtherRankPool(shards, rank) if rank else None)

    @property
    def layout(self):
        return self.pools[0].layout

    def attach_tiers(self, tiers) -> None:
        raise ValueError(NO_TIERS)

    def detach_tiers(self) -> None:
        return None

    def pin(self, hashes, seconds: float):
        rank = max(range(len(self.pools)), key=lambda r: (self.pools[r].cached_blocks(hashes), -r))
        return self.pools[rank].pin(hashes, seconds)

    def owner_of(self, pin_id: str) -> int | None:
        """The rank whose pool holds pin ``pin_id`` (None: none does)."""
        return next((r for r, p in enumerate(self.pools) if p.holds_pin(pin_id)), None)

    def export_pinned(self, pin_id: str, secret: str, hashes):
        return self.pools[self.owner_of(pin_id) or 0].export_pinned(pin_id, secret, hashes)  # rank 0 refuses

    def export(self, hashes):
        """The longest cached prefix of ``hashes`` on any rank (local use)."""
        return max((p.export(hashes) for p in self.pools), key=lambda payload: len(payload.block_hashes))

    def import_blocks(self, payload) -> int:
        rank = min(range(len(self.pools)), key=lambda r: (self.queued_tokens(r), r))
        return self.pools[rank].import_blocks(payload)

    def unpin(self, pin_id: str) -> bool:
        rank = self.owner_of(pin_id)
        return rank is not None and self.pools[rank].unpin(pin_id)

    def expire_pins(self, now: float | None = None) -> int:
        return sum(pool.expire_pins(now) for pool in self.pools)

    @property
    def num_pins(self) -> int:
        return sum(p.num_pins for p in self.pools)

    def blocks_for(self, num_tokens: int, step_tokens: int) -> int:
        """Per rank: a request's blocks are all on its own."""
        return self.pools[0].blocks_for(num_tokens, step_tokens)

    @property
    def num_used_blocks(self) -> int:
        return sum(p.num_used_blocks for p in self.pools)

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools)

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(sum(p.stats.queried_tokens for p in self.pools),
                                sum(p.stats.hit_tokens for p in self.pools))

    def events_since(self, since: int, epoch: str) -> dict:
        return self.events.since(since, epoch, lambda: list({k for p in self.pools for k in p.pool.cached
                                                             if not isinstance(k, tuple)}))


class SharedEvents(KVEventLog):
    """One journal for every rank's pool: a hash is announced when the first rank caches it
    and withdrawn when the last one evicts it, so a router's index says what the worker holds."""

    def __init__(self):
        super().__init__()
        self.holders: collections.Counter = collections.Counter()

    def stored(self, block_hash, tier: str = "") -> None:
        self.holders[block_hash] += 1
        if self.holders[block_hash] == 1:
            super().stored(block_hash, tier)

    def removed(self, block_hash, tier: str = "") -> None:
        self.holders[block_hash] -= 1
        if self.holders[block_hash] <= 0:
            del self.holders[block_hash]
            super().removed(block_hash, tier)
