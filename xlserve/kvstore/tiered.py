"""The tiers under one engine's device pool, composed: write-back down the local tiers,
write-through to the cluster tier, and batched read-through lookups off the engine thread.

- Writes: the engine hands over block bytes it already copied out of the pool (``offer``)
  and goes on; a writer thread per destination stores them. Local tiers cascade: what the
  first evicts goes to the second (host -> disk). The queue is bounded in bytes; when it is
  full the write is dropped and counted, so a slow disk or store never stalls a step.
- Reads: ``lookup`` finds, in one batched ``contains`` per tier (a tier measured slower
  than computing the blocks is passed over: ``load_cost.py``), the longest run of a hash
  chain the tiers hold (each block from the first tier that has it), fetches it, and
  returns it as one payload through a future. The engine waits for it at most
  ``--kv-tier-timeout`` seconds and computes whatever did not arrive.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from xlserve.config import KVTierConfig
from xlserve.hashing import BlockHash
from xlserve.kvstore.base import KVTier, block_key, layout_digest, tier_class
from xlserve.kvstore.load_cost import LoadCosts

log = logging.getLogger(__name__)
MAX_PENDING_BYTES = 512 * 1024 ** 2  # queued writes, all destinations: past it writes are dropped
KNOWN_IN_CLUSTER = 1 << 18  # keys remembered as written through, so a block is sent once


@dataclass(frozen=True)
class TierLoad:
    """What a lookup found: the leading ``hashes`` of the chain asked for, their bytes, and
    how many blocks came from each tier."""
    hashes: list[BlockHash]
    data: bytes
    from_tiers: dict[str, int]
    in_cluster: tuple[BlockHash, ...] = ()  # those a cluster tier holds: no need to write them through


class _Writer:
    """One destination's write queue and thread."""

    def __init__(self, name: str, store, pending: "_Budget"):
        self.queue: queue.Queue = queue.Queue()
        self.store = store  # callable(keys, blocks)
        self.pending = pending
        self.thread = threading.Thread(target=self._run, name=f"kv-tier-writer-{name}", daemon=True)
        self.thread.start()

    def submit(self, keys: list[bytes], blocks: np.ndarray) -> bool:
        if not self.pending.take(blocks.nbytes):
            return False
        self.queue.put((keys, blocks))
        return True

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            keys, blocks = item
            try:
                self.store(keys, [memoryview(row) for row in blocks])
            except Exception:  # noqa: BLE001 - a tier fault never reaches a request
                log.exception("a KV tier write failed; the blocks are dropped")
            finally:
                self.pending.give(blocks.nbytes)
                self.queue.task_done()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=5)


class _Budget:
    def __init__(self, limit: int):
        self.limit, self.used, self.lock = limit, 0, threading.Lock()

    def take(self, n: int) -> bool:
        with self.lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self.lock:
            self.used -= n


class TieredKV:
    def __init__(self, tiers: list[KVTier], timeout: float, max_pending_bytes: int = MAX_PENDING_BYTES,
                 block_size: int = 16):
        if not tiers:
            raise ValueError("TieredKV needs at least one tier")
        self.tiers = tiers
        self.local = [t for t in tiers if t.local]
        self.cluster = [t for t in tiers if not t.local]
        self.timeout = timeout
        self.costs = LoadCosts(block_size)  # tiers measured slower than computing are passed over
        self.block_bytes = tiers[0].block_bytes
        self.dropped_writes = 0  # blocks not queued: the write budget was spent
        self._pending = _Budget(max_pending_bytes)
        self._writers = {}
        if self.local:
            self._writers["local"] = _Writer("local", self._store_local, self._pending)
        if self.cluster:
            self._writers["cluster"] = _Writer("cluster", self._store_cluster, self._pending)
        self._in_cluster: dict[bytes, None] = {}  # insertion-ordered, bounded
        self._cluster_outages = 0
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-tier-loader")

    def attach_events(self, events) -> None:
        """Tiers announce what they store and drop in the worker's KV event log."""
        for tier in self.tiers:
            tier.events = events
            events.tier_snapshots[tier.name] = tier.keys

    # -- writes ------------------------------------------------------------------
    def wants_evicted(self, hashes: list[BlockHash]) -> list[bool]:
        """Which blocks leaving the device pool are worth copying out: those the first tier
        that takes them (the first local one, else the cluster) does not hold yet."""
        first = (self.local or self.cluster)[0]
        return [not held for held in first.contains([block_key(h) for h in hashes])]

    def offer_evicted(self, hashes: list[BlockHash], blocks: np.ndarray) -> None:
        """Blocks leaving the device pool ([n, block_bytes] bytes the caller no longer needs)."""
        self._submit("local" if self.local else "cluster", hashes, blocks)

    def wants_written_through(self, hashes: list[BlockHash]) -> list[bool]:
        """Which of a finished request's blocks the cluster tier has not been sent yet (all of
        them after an outage: a restarted store has lost what it held)."""
        outages = sum(t.outages for t in self.cluster)
        if outages != self._cluster_outages:
            self._cluster_outages = outages
            self._in_cluster.clear()
        return [bool(self.cluster) and block_key(h) not in self._in_cluster for h in hashes]

    def offer_finished(self, hashes: list[BlockHash], blocks: np.ndarray) -> None:
        self.known_in_cluster(hashes)
        self._submit("cluster", hashes, blocks)

    def known_in_cluster(self, hashes) -> None:
        """Remember blocks the cluster tier holds (engine thread only)."""
        for h in hashes:
            self._in_cluster[block_key(h)] = None
        while len(self._in_cluster) > KNOWN_IN_CLUSTER:
            del self._in_cluster[next(iter(self._in_cluster))]

    def _submit(self, writer: str, hashes: list[BlockHash], blocks: np.ndarray) -> None:
        if hashes and not self._writers[writer].submit([block_key(h) for h in hashes], blocks):
            self.dropped_writes += len(hashes)

    def _store_local(self, keys: list[bytes], blocks: list[memoryview]) -> None:
        for tier in self.local:
            if not tier.enabled:
                continue
            evicted = tier.put(keys, blocks)
            if not evicted:
                return
            keys, blocks = [k for k, _ in evicted], [b for _, b in evicted]

    def _store_cluster(self, keys: list[bytes], blocks: list[memoryview]) -> None:
        for tier in self.cluster:
            if tier.enabled:
                tier.put(keys, blocks)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is stored (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._pending.used:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    # -- reads -------------------------------------------------------------------
    def lookup(self, hashes: list[BlockHash]) -> Future | None:
        """The longest leading run of ``hashes`` the tiers hold, fetched (``TierLoad``); None when
        no tier can have even the first block (local tiers answer that at once)."""
        if not hashes:
            return None
        if not self.cluster and not any(t.enabled and t.contains([block_key(hashes[0])])[0] for t in self.local):
            return None
        return self._loader.submit(self._load, list(hashes))

    def _load(self, hashes: list[BlockHash]) -> TierLoad:
        keys = [block_key(h) for h in hashes]
        source: list[KVTier | None] = [None] * len(keys)
        probe = self.costs.start_lookup()
        for tier in self.tiers:
            missing = [i for i, s in enumerate(source) if s is None]
            if not missing or not tier.enabled or not self.costs.worth_reading(tier.name, probe):
                continue
            try:
                for i, held in zip(missing, tier.contains([keys[i] for i in missing])):
                    if held:
                        source[i] = tier
            except Exception:  # noqa: BLE001 - a tier fault is a miss
                tier.stats.add(failures=1)
                log.warning("KV tier %s: lookup failed; treated as a miss", tier.name, exc_info=True)
        run = next((i for i, s in enumerate(source) if s is None), len(source))
        blocks: list[bytes | memoryview | None] = [None] * run
        for tier in {s for s in source[:run]}:
            at = [i for i in range(run) if source[i] is tier]
            started = time.monotonic()
            try:
                got = tier.get([keys[i] for i in at])
            except Exception:  # noqa: BLE001
                tier.stats.add(failures=1)
                log.warning("KV tier %s: read failed; treated as a miss", tier.name, exc_info=True)
                got = [None] * len(at)
            elapsed = time.monotonic() - started
            tier.stats.add(load_seconds=elapsed)
            self.costs.read(tier.name, sum(1 for b in got if b is not None), elapsed)
            for i, block in zip(at, got):
                blocks[i] = block
        run = next((i for i, b in enumerate(blocks) if b is None), run)
        counts: dict[str, int] = {}
        for tier in source[:run]:
            counts[tier.name] = counts.get(tier.name, 0) + 1
        for tier in self.tiers:
            tier.stats.add(hits=counts.get(tier.name, 0))
        in_cluster = tuple(h for h, s in zip(hashes[:run], source) if not s.local)
        return TierLoad(hashes[:run], b"".join(blocks[:run]), counts, in_cluster)

    # -- the rest ----------------------------------------------------------------
    def stats(self) -> dict:
        tiers = {t.name: {**t.stats.as_dict(), "blocks": t.num_blocks, "capacity_blocks": t.capacity_blocks,
                          "enabled": t.enabled, "skipped": self.costs.skipped.get(t.name, 0)} for t in self.tiers}
        return {"tiers": tiers, "pending_write_bytes": self._pending.used, "dropped_writes": self.dropped_writes}

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._loader.shutdown(wait=False, cancel_futures=True)
        for tier in self.tiers:
            tier.close()


def build_tiers(config: KVTierConfig, layout) -> TieredKV | None:
    """The tiers ``--kv-tiers`` names, in order, for blocks of ``layout`` (a ``KVLayout``);
    None: device only."""
    if not config.tier_names:
        return None
    block_bytes = layout.block_bytes
    digest = layout_digest(json.dumps(layout.to_json(), sort_keys=True))
    tiers: list[KVTier] = []
    try:
        for name in config.tier_names:
            tiers.append(tier_class(name).from_config(config, block_bytes, digest))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    log.info("KV tiers: %s", ", ".join(f"{t.name} ({t.capacity_blocks} blocks)" for t in tiers))
    return TieredKV(tiers, config.kv_tier_timeout, block_size=layout.block_size)
