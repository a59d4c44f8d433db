"""Whether loading a block from a tier beats computing it.

A tier that is slower than the model (a disk under a fast GPU, a store over a slow link)
makes hits cost more than misses: a known trap of tiered KV caches. Both sides are
measured as the worker runs: seconds per block read from each tier (its ``get`` calls)
and seconds per prompt token computed (the engine's prefill steps). A tier whose blocks
take longer to read than ``block_size`` tokens take to compute is skipped by lookups,
except one lookup in ``PROBE_EVERY``, which keeps its figure fresh: a tier that speeds
up (a warm page cache, a store that recovered) comes back.
"""

from __future__ import annotations

import threading

SMOOTHING = 0.2  # weight of the newest measurement in the moving averages
PROBE_EVERY = 16
MIN_PREFILL_TOKENS = 64  # steps with fewer computed tokens are mostly decode: not a prefill figure


class LoadCosts:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.compute_s_per_token: float | None = None
        self.read_s_per_block: dict[str, float] = {}
        self.skipped: dict[str, int] = {}  # lookups that passed a tier over, by tier
        self._lookups = 0
        self._lock = threading.Lock()

    def computed(self, tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` prompt tokens in ``seconds`` (engine thread)."""
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self.compute_s_per_token = _average(self.compute_s_per_token, seconds / tokens)

    def read(self, tier: str, blocks: int, seconds: float) -> None:
        """A tier returned ``blocks`` blocks in ``seconds`` (loader threads)."""
        if blocks:
            with self._lock:
                self.read_s_per_block[tier] = _average(self.read_s_per_block.get(tier), seconds / blocks)

    def start_lookup(self) -> bool:
        """Count a lookup; True when it probes every tier whatever its figure."""
        with self._lock:
            self._lookups += 1
            return self._lookups % PROBE_EVERY == 0

    def worth_reading(self, tier: str, probe: bool) -> bool:
        read = self.read_s_per_block.get(tier)
        if probe or read is None or self.compute_s_per_token is None:
            return True
        if read <= self.compute_s_per_token * self.block_size:
            return True
        with self._lock:
            self.skipped[tier] = self.skipped.get(tier, 0) + 1
        return False


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
