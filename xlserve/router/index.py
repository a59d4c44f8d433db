"""Where the router believes each KV block lives: block hash -> worker URLs.

Filled from the router's own routing (a worker that served a prompt holds its blocks)
and bounded LRU, so stale beliefs age out. Workers' KV events will make it exact.
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
