"""KV events: which block hashes a worker's cache gained or lost, so a router's index of
where blocks live stays true. A bounded journal with sequence numbers; a reader that
fell behind (or a new reader, or a restarted worker: new epoch) gets a snapshot instead.
"""

from __future__ import annotations

import uuid
from collections import deque

from xlserve.hashing import BlockHash

JOURNAL_LENGTH = 65536


class KVEventLog:
    def __init__(self, capacity: int = JOURNAL_LENGTH):
        self.epoch = uuid.uuid4().hex  # changes when the worker restarts
        self.seq = 0
        self._journal: deque[tuple[int, str, BlockHash]] = deque(maxlen=capacity)

    def stored(self, block_hash: BlockHash) -> None:
        self.seq += 1
        self._journal.append((self.seq, "stored", block_hash))

    def removed(self, block_hash: BlockHash) -> None:
        self.seq += 1
        self._journal.append((self.seq, "removed", block_hash))

    def since(self, seq: int, epoch: str, snapshot) -> dict:
        """Events after ``seq`` of ``epoch``; a snapshot of all cached hashes when the reader
        cannot be caught up from the journal. ``snapshot``: callable returning the hashes."""
        oldest = self._journal[0][0] if self._journal else self.seq + 1
        if epoch != self.epoch or seq < oldest - 1 or seq > self.seq:
            return {"epoch": self.epoch, "seq": self.seq, "reset": True,
                    "snapshot": [h.hex() for h in snapshot()], "events": []}
        events = [[kind, h.hex()] for s, kind, h in self._journal if s > seq]
        return {"epoch": self.epoch, "seq": self.seq, "reset": False, "events": events}
