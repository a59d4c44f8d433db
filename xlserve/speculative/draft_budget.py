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
tool call's envelope lands nearly always, free text's words seldom; a new request starts
at the rate every request's guesses had lately), so k guesses are expected to yield rate +
rate^2 + ... + rate^k tokens; guessing deeper also costs the proposer's time (an EAGLE
head's or a draft model's forward per depth).
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass, field

MAX_PROPOSALS = 8  # per request and step
START_RATE = 0.6  # guesses before any was checked (later, a new request starts at the recent rate)
RATE_DECAY = 0.3  # weight of the latest check: acceptance shifts within a tool call's few tokens


@dataclass
class DraftLength:
    """One request's proposal length: ``fixed`` (``--num-speculative-tokens``), or planned
    each step from its acceptance ``rate``."""
    fixed: int = 0
    rate: float = START_RATE
    most: int = MAX_PROPOSALS
    forced: bool = False  # a grammar's forced tokens: rate 1, all may go at once, no proposer runs

    def record(self, proposed: int, accepted: int) -> None:
        """A checked proposal: guesses 1..accepted landed, the next one (if any) missed."""
        if proposed:
            self.rate += RATE_DECAY * (accepted / min(accepted + 1, proposed) - self.rate)

    def gain(self, k: int) -> float:
        """Expected tokens the k-th guess (1-based) adds: it and every guess before it land."""
        return self.rate ** k


@dataclass
class StepCosts:
    """Seconds of this engine's decode steps, in three parts: the forward pass by the rows it
    computed; the proposer's time by the depth it guessed to (a model-based proposer catches
    up on the confirmed tokens, then runs its head or draft once per depth for every request
    at once; for ``ngram`` and ``suffix`` it is a lookup); and the rest of a step
    (scheduling, sampling's bookkeeping, detokenizing), which depends on neither. Each is the
    least of its latest WINDOW samples per row count or depth: noise (another process, the
    VM's neighbours) only ever adds time, and a mean that caught a spike can keep the planner
    off that row count for good, as it is then never tried again (the suspected cause when a
    noisy 2-core VM once ran bench spec's suffix at batch 1 in 107 request-steps a run for
    answers that other runs took in 80). One never measured is estimated at the most
    measured below it (optimistic: the planner tries it once, then knows)."""
    forward: dict[int, float] = field(default_factory=dict)
    proposing: dict[int, float] = field(default_factory=dict)
    rest: float | None = None
    windows: dict[tuple[str, int], collections.deque] = field(default_factory=dict)
    WINDOW = 8

    def record(self, rows: int, forward_seconds: float, step_seconds: float, propose_seconds: float = 0.0,
               depth: int = 0) -> None:
        self.forward[rows] = self._least("forward", rows, forward_seconds)
        if depth:
            self.proposing[depth] = self._least("proposing", depth, propose_seconds)
        self.rest = self._least("rest", 0, max(0.0, step_seconds - forward_seconds - propose_seconds))

    def _least(self, part: str, key: int, seconds: float) -> float:
        window = self.windows.setdefault((part, key), collections.deque(maxlen=self.WINDOW))
        window.append(seconds)
        return min(window)

    @staticmethod
    def _at(table: dict[int, float], key: int) -> float:
        below = [k for k in table if k <= key]
        return table[max(below)] if below else min(table.values())

    def estimate(self, rows: int, depth: int = 0) -> float | None:
        """The expected seconds of a decode step of ``rows`` whose proposals were guessed
        ``depth`` deep; None before one was measured."""
        if not self.forward:
            return None
        proposing = self._at(self.proposing, depth) if depth and self.proposing else 0.0
        return (self.rest or 0.0) + self._at(self.forward, rows) + proposing


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
    depth = max([n for n, length in zip(planned, lengths) if not length.forced], default=0)
    best, best_count, added = tokens / costs.estimate(rows, depth), 0, []
    heap = [(-lengths[i].gain(1), i) for i in adaptive]
    heapq.heapify(heap)
    count = [0] * len(lengths)
    while heap:
        gain, i = heapq.heappop(heap)
        added.append(i)
        count[i] += 1
        rows, tokens = rows + 1, tokens - gain
        depth = depth if lengths[i].forced else max(depth, count[i])
        if (rate := tokens / costs.estimate(rows, depth)) > best:
            best, best_count = rate, len(added)
        if count[i] < min(rooms[i], lengths[i].most):
            heapq.heappush(heap, (-lengths[i].gain(count[i] + 1), i))
    for i in added[:best_count]:
        planned[i] += 1
    return planned
