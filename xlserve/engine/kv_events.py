"""KV events: which block hashes a worker's cache gained or lost, and where (the device pool,
or a KV tier: host, disk, the cluster store), so a router's index of where blocks live stays
true. A bounded journal with sequence numbers; a reader that fell behind (or a new reader,
or a restarted worker: new epoch) gets a snapshot instead.

An event is ``[kind, hash hex]`` for the device pool and ``[kind, hash hex, tier]`` for a
tier. Tiers write from their own threads, so the journal takes a lock.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from typing import Callable

from xlserve.hashing import BlockHash

JOURNAL_LENGTH = 65536
DEVICE = ""  # the tier name of the device pool in the journal


class KVEventLog:
    def __init__(self, capacity: int = JOURNAL_LENGTH):
        self.epoch = uuid.uuid4().hex  # changes when the worker restarts
        self.seq = 0
        self._journal: deque[tuple[int, str, BlockHash, str]] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        # tier name -> its hashes, for snapshots (the device pool's come from the caller)
        self.tier_snapshots: dict[str, Callable[[], list[BlockHash]]] = {}

    def stored(self, block_hash: BlockHash, tier: str = DEVICE) -> None:
        self._record("stored", block_hash, tier)

    def removed(self, block_hash: BlockHash, tier: str = DEVICE) -> None:
        self._record("removed", block_hash, tier)

    def _record(self, kind: str, block_hash: BlockHash, tier: str) -> None:
        with self._lock:
            self.seq += 1
            self._journal.append((self.seq, kind, block_hash, tier))

    def since(self, seq: int, epoch: str, snapshot) -> dict:
        """Events after ``seq`` of ``epoch``; a snapshot of all cached hashes when the reader
        cannot be caught up from the journal. ``snapshot``: callable returning the device
        pool's hashes (each tier's come from ``tier_snapshots``)."""
        with self._lock:
            oldest = self._journal[0][0] if self._journal else self.seq + 1
            if epoch != self.epoch or seq < oldest - 1 or seq > self.seq:
                current = self.seq
            else:
                events = [[kind, h.hex(), *([tier] if tier else [])] for s, kind, h, tier in self._journal if s > seq]
                return {"epoch": self.epoch, "seq": self.seq, "reset": False, "events": events}
        tiers = {name: [h.hex() for h in hashes()] for name, hashes in self.tier_snapshots.items()}
        return {"epoch": self.epoch, "seq": current, "reset": True, "snapshot": [h.hex() for h in snapshot()],
                "tier_snapshot": tiers, "events": []}
