"""Where the router believes each KV block lives: block hash -> worker URLs.

Filled at once from the router's own routing (a worker that served a prompt holds its
blocks) and corrected by the workers' KV events (stored / removed, or a snapshot after a
worker or router restart). Bounded LRU.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, capacity: int = 1_000_000):
        self.capacity = capacity
        self._where: OrderedDict[bytes, set[str]] = OrderedDict()

    def record(self, hashes: list[bytes], url: str) -> None:
        for h in hashes:
            owners = self._where.pop(h, set())
            owners.add(url)
            self._where[h] = owners
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def remove(self, block_hash: bytes, url: str) -> None:
        owners = self._where.get(block_hash)
        if owners is not None:
            owners.discard(url)

    def apply_events(self, url: str, feed: dict) -> None:
        """Apply a worker's KV events answer (see ``KVEventLog.since``)."""
        if feed.get("reset"):
            self.forget_worker(url)
            self.record([bytes.fromhex(h) for h in feed.get("snapshot", [])], url)
            return
        for kind, h in feed.get("events", []):
            if kind == "stored":
                self.record([bytes.fromhex(h)], url)
            else:
                self.remove(bytes.fromhex(h), url)

    def blocks_on(self, url: str) -> int:
        return sum(1 for owners in self._where.values() if url in owners)

    def forget_worker(self, url: str) -> None:
        for owners in self._where.values():
            owners.discard(url)

    def cached_blocks(self, hashes: list[bytes], urls: list[str]) -> dict[str, int]:
        """For each url, how many leading blocks of ``hashes`` it is believed to hold."""
        counts = {}
        for url in urls:
            n = 0
            for h in hashes:
                if url not in self._where.get(h, ()):
                    break
                n += 1
            counts[url] = n
        return counts
