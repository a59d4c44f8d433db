"""How many tokens each decoding request proposes for the next step (``--num-speculative-tokens
0``, the default): from what this engine's steps cost and how often each request's guesses land.

A checked proposal is one more row in the step's forward pass. Whether a row is cheap is a
property of the machine and the kernels, not of speculation: where a decode step is bound by
reading the weights, a few more rows cost little; on a 2-core Zen 4 EPYC, where one row of the
default model is already bound by dequantization, 8 rows took 2.8 times one row's matmul
time. So the engine times its own decode steps by the rows they compute (``StepCosts``) and
hands guesses to the requests whose next guess is likeliest to land, for as long as the
step's expected tokens per second grow (``plan_lengths``).

Acceptance is modelled per request as geometric: each guess lands with probability ``rate``
once the ones before it did (``DraftLength.rate``, learned from every checked proposal: a
tool call's envelope lands nearly always, free text's words seldom), so k guesses are
expected to yield rate + rate^2 + ... + rate^k tokens. The proposer's own time counts as
part of a step's fixed cost (cheap for ``ngram`` and ``suffix``; a draft model's per-guess
forward is not modelled).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

MAX_PROPOSALS = 8  # per request and step
START_RATE = 0.6  # a request's guesses before any of them was checked
RATE_DECAY = 0.3  # weight of the latest check: acceptance shifts within a tool call's few tokens


@dataclass
class DraftLength:
    """One request's proposal length: ``fixed`` (``--num-speculative-tokens``), or planned
    each step from its acceptance ``rate``."""
    fixed: int = 0
    rate: float = START_RATE
    most: int = MAX_PROPOSALS  # a grammar's forced tokens (rate 1) may all go at once

    def record(self, proposed: int, accepted: int) -> None:
        """A checked proposal: guesses 1..accepted landed, the next one (if any) missed."""
        if proposed:
            self.rate += RATE_DECAY * (accepted / min(accepted + 1, proposed) - self.rate)

    def gain(self, k: int) -> float:
        """Expected tokens the k-th guess (1-based) adds: it and every guess before it land."""
        return self.rate ** k


@dataclass
class StepCosts:
    """Seconds of this engine's decode steps: the forward pass by the rows it computed (an
    exponential mean per row count) plus the rest of a step (scheduling, sampling's
    bookkeeping, detokenizing, proposing), which does not depend on the rows. A row count
    never measured is estimated at the most rows measured below it (optimistic: the planner
    tries it once, then knows)."""
    forward: dict[int, float] = field(default_factory=dict)
    rest: float | None = None
    DECAY = 0.2

    def record(self, rows: int, forward_seconds: float, step_seconds: float) -> None:
        self.forward[rows] = self._mean(self.forward.get(rows), forward_seconds)
        self.rest = self._mean(self.rest, max(0.0, step_seconds - forward_seconds))

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.DECAY * (new - old)

    def estimate(self, rows: int) -> float | None:
        """The expected seconds of a decode step of ``rows``; None before one was measured."""
        if not self.forward:
            return None
        below = [r for r in self.forward if r <= rows]
        return (self.rest or 0.0) + (self.forward[max(below)] if below else min(self.forward.values()))


def plan_lengths(lengths: list[DraftLength], rooms: list[int], base_rows: int, base_tokens: float,
                 costs: StepCosts) -> list[int]:
    """Proposal lengths for the requests of ``lengths``, at most ``rooms`` each (which also
    caps a fixed length), that maximize the next step's expected tokens per second. The step
    computes ``base_rows`` rows besides, yielding ``base_tokens`` (a token per decoding request
    and the forced ones). Guesses are added likeliest first and the best prefix of that order
    wins: step costs are not convex (a kernel takes over at some row count). Before any step
    was measured, every request proposes as much as its room allows."""
    planned = [min(length.fixed, room) if length.fixed else 0 for length, room in zip(lengths, rooms)]
    adaptive = [i for i, length in enumerate(lengths) if not length.fixed and rooms[i] > 0]
    if not adaptive:
        return planned
    if costs.estimate(base_rows) is None:
        for i in adaptive:
            planned[i] = min(rooms[i], lengths[i].most)
        return planned
    rows = base_rows + sum(planned)
    tokens = base_tokens + sum(lengths[i].gain(k) for i, n in enumerate(planned) for k in range(1, n + 1))
    best, best_count, added = tokens / costs.estimate(rows), 0, []
    heap = [(-lengths[i].gain(1), i) for i in adaptive]
    heapq.heapify(heap)
    count = [0] * len(lengths)
    while heap:
        gain, i = heapq.heappop(heap)
        added.append(i)
        count[i] += 1
        rows, tokens = rows + 1, tokens - gain
        if tokens / costs.estimate(rows) > best:
            best, best_count = tokens / costs.estimate(rows), len(added)
        if count[i] < min(rooms[i], lengths[i].most):
            heapq.heappush(heap, (-lengths[i].gain(count[i] + 1), i))
    for i in added[:best_count]:
        planned[i] += 1
    return planned
