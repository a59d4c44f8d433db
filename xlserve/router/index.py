"""Where the router believes each KV block lives: block hash -> the workers holding it, and
in which tier (the device pool, host memory, disk), plus blocks in the cluster store, which
every worker can load.

Filled at once from the router's own routing (a worker that served a prompt holds its
blocks in its device pool) and corrected by the workers' KV events (stored / removed per
tier, or a snapshot after a worker or router restart). Bounded LRU.
"""

from __future__ import annotations

from collections import OrderedDict

DEVICE, CLUSTER_TIER = "", "mooncake"
CLUSTER = "*"  # the owner of blocks in the cluster store: every worker
# What a cached block is worth to a worker, by where it is: a device hit costs nothing, a
# host hit a memory copy, a disk hit a read, a cluster hit a network fetch; any of them is
# far cheaper than computing the block, so a worse tier still beats no tier.
TIER_WEIGHT = {DEVICE: 1.0, "host": 0.9, "disk": 0.8, CLUSTER_TIER: 0.7}


class PrefixIndex:
    def __init__(self, capacity: int = 1_000_000, block_size: int = 16):
        self.capacity, self.block_size = capacity, block_size
        self._where: OrderedDict[bytes, dict[str, str]] = OrderedDict()  # hash -> {url: tier}
        # Servers that publish no KV events: the blocks routed to each, oldest first, at most
        # as many as its cache holds (what it would have evicted by now is forgotten).
        self._aged: dict[str, OrderedDict[bytes, None]] = {}
        self._aged_limit: dict[str, int] = {}

    def set_capacity(self, url: str, cache_tokens: int) -> None:
        """``url`` reports no KV events; its cache holds ``cache_tokens`` tokens."""
        self._aged_limit[url] = max(cache_tokens // self.block_size, 1)
        self._aged.setdefault(url, OrderedDict())
        self._age(url)

    def _age(self, url: str) -> None:
        recent, limit = self._aged[url], self._aged_limit[url]
        while len(recent) > limit:
            oldest, _ = recent.popitem(last=False)
            self.remove(oldest, url)

    def record(self, hashes: list[bytes], url: str, tier: str = DEVICE) -> None:
        """``url`` holds these blocks in ``tier`` (the better tier wins when it holds them twice)."""
        if tier == CLUSTER_TIER:
            url = CLUSTER
        for h in hashes:
            owners = self._where.pop(h, {})
            held = owners.get(url)
            if held is None or TIER_WEIGHT.get(tier, 0) >= TIER_WEIGHT.get(held, 0):
                owners[url] = tier
            self._where[h] = owners
        if url in self._aged:
            recent = self._aged[url]
            for h in hashes:
                recent.pop(h, None)
                recent[h] = None
            self._age(url)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def __len__(self) -> int:
        """Blocks the index knows an owner of."""
        return len(self._where)

    def remove(self, block_hash: bytes, url: str, tier: str = DEVICE) -> None:
        owners = self._where.get(block_hash)
        if owners is not None and owners.get(url) == tier:
            del owners[url]
            if not owners:  # a hash nobody holds is forgotten: kept, every block ever seen stayed
                del self._where[block_hash]

    def apply_events(self, url: str, feed: dict) -> None:
        """Apply a worker's KV events answer (see ``KVEventLog.since``)."""
        if feed.get("reset"):
            self.forget_worker(url)
            for tier, hashes in (feed.get("tier_snapshot") or {}).items():
                self.record([bytes.fromhex(h) for h in hashes], url, tier)
            self.record([bytes.fromhex(h) for h in feed.get("snapshot", [])], url)
            return
        for kind, h, *tier in feed.get("events", []):
            where = tier[0] if tier else DEVICE
            if kind == "stored":
                self.record([bytes.fromhex(h)], url, where)
            elif where != CLUSTER_TIER:  # the store's evictions are not announced: those age out
                self.remove(bytes.fromhex(h), url, where)

    def blocks_on(self, url: str) -> int:
        return sum(1 for owners in self._where.values() if url in owners)

    def forget_worker(self, url: str) -> None:
        emptied = []
        for block_hash, owners in self._where.items():
            if owners.pop(url, None) is not None and not owners:
                emptied.append(block_hash)
        for block_hash in emptied:
            del self._where[block_hash]

    def cached_blocks(self, hashes: list[bytes], urls: list[str]) -> dict[str, int]:
        """For each url, how many leading blocks of ``hashes`` it is believed to hold or to be
        able to load (from its tiers or the cluster store)."""
        return {url: len(self._run(hashes, url)) for url in urls}

    def cache_scores(self, hashes: list[bytes], urls: list[str]) -> dict[str, float]:
        """For each url, its leading cached blocks, each weighted by the best tier it is in."""
        return {url: sum(TIER_WEIGHT.get(t, 0) for t in self._run(hashes, url)) for url in urls}

    def _run(self, hashes: list[bytes], url: str) -> list[str]:
        """The tier of each leading block ``url`` can have without computing it."""
        run = []
        for h in hashes:
            owners = self._where.get(h, {})
            mine, cluster = owners.get(url), owners.get(CLUSTER)
            if mine is None and cluster is None:
                break
            run.append(mine if mine is not None and (cluster is None or TIER_WEIGHT[mine] >= TIER_WEIGHT[cluster])
                       else cluster)
        return run

    def tiers_on(self, url: str) -> dict[str, int]:
        """Blocks the router believes ``url`` holds, by tier ("device" for the pool)."""
        counts: dict[str, int] = {}
        for owners in self._where.values():
            if url in owners:
                name = owners[url] or "device"
                counts[name] = counts.get(name, 0) + 1
        return counts
