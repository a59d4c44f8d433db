"""Routing policies, chosen by name. Each picks one worker for a stage of one request.

Invariant: a policy only returns a worker from the candidates it is given (healthy, of
the right role), and never None when there is a candidate.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from xlserve.router.pool import Worker


@dataclass(frozen=True)
class RouteRequest:
    block_hashes: list[bytes]  # of the prompt, in order
    prompt_tokens: int
    session: str | None  # x-session-affinity
    # worker url -> prompt tokens the index believed cached there when it was picked
    predicted_cached: dict[str, int] = field(default_factory=dict, compare=False)
    served_by: list[str] = field(default_factory=list, compare=False)  # "stage=url", for the response header


class RoutingPolicy(ABC):
    @abstractmethod
    def pick(self, candidates: list[Worker], req: RouteRequest, cached: dict[str, float]) -> Worker:
        """``cached``: worker url -> the prompt's leading blocks it is believed to hold or be able to
        load, each weighted by its tier (1 in the device pool, less in host memory, disk, the
        cluster store: ``router/index.py``)."""


class RoundRobin(RoutingPolicy):
    def __init__(self):
        self._counter = itertools.count()

    def pick(self, candidates, req, cached):
        return candidates[next(self._counter) % len(candidates)]


class LeastTokens(RoutingPolicy):
    def pick(self, candidates, req, cached):
        return min(candidates, key=lambda w: (w.load, w.url))


class CacheAware(RoutingPolicy):
    """Most cached blocks minus a load penalty, never onto a worker loaded beyond
    ``max_imbalance`` tokens over the least-loaded one (no hot spots)."""

    def __init__(self, block_size: int = 16, load_weight: float = 1.0, max_imbalance: int = 8192):
        self.block_size, self.load_weight, self.max_imbalance = block_size, load_weight, max_imbalance

    def pick(self, candidates, req, cached):
        floor = min(w.load for w in candidates)
        allowed = [w for w in candidates if w.load - floor <= self.max_imbalance] or candidates

        def score(w: Worker):
            return cached.get(w.url, 0) * self.block_size - self.load_weight * w.load
        return max(allowed, key=lambda w: (score(w), -w.load, w.url))


class SessionAffinity(RoutingPolicy):
    """Consistent hashing with bounded load: a session stays on its worker unless that
    worker is down or carries more than ``load_factor`` times the mean load (plus slack)."""

    def __init__(self, fallback: RoutingPolicy | None = None, load_factor: float = 1.5, slack: int = 2048,
                 replicas: int = 64):
        self.fallback, self.load_factor = fallback or CacheAware(), load_factor
        self.slack, self.replicas = slack, replicas

    @staticmethod
    def _h(key: str) -> int:
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")

    def pick(self, candidates, req, cached):
        if not req.session:
            return self.fallback.pick(candidates, req, cached)
        ring = sorted((self._h(f"{w.url}#{i}"), w) for w in candidates for i in range(self.replicas))
        keys = [k for k, _ in ring]
        bound = self.load_factor * (sum(w.load for w in candidates) / len(candidates)) + self.slack
        start = bisect.bisect(keys, self._h(req.session)) % len(ring)
        seen = set()
        for i in range(len(ring)):
            w = ring[(start + i) % len(ring)][1]
            if w.url in seen:
                continue
            seen.add(w.url)
            if w.load <= bound:
                return w
        return min(candidates, key=lambda w: w.load)


POLICIES = {"round_robin": RoundRobin, "least_tokens": LeastTokens, "cache_aware": CacheAware}


def make_policy(name: str, affinity: bool = True, block_size: int = 16) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"routing policy {name!r} unknown; available: {', '.join(sorted(POLICIES))}")
    base = CacheAware(block_size) if name == "cache_aware" else POLICIES[name]()
    return SessionAffinity(base) if affinity else base
