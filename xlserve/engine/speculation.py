"""The engine's side of speculative decoding: who proposes how many tokens each step, what
became of the proposals, and what a checked row costs on this machine.

The proposer (``speculative/proposer.py``) guesses tokens; the scheduler gives a request
1 + k tokens of the step for them; the runner checks them (``speculative/verifier.py``).
This object sits between steps: it asks the proposer after a step, and records the fate of
the proposals and the step's time before the next.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from xlserve.engine.request import Request
from xlserve.engine.scheduler import SchedulerOutput
from xlserve.speculative.draft_budget import DraftLength, StepCosts, plan_lengths
from xlserve.speculative.proposer import Proposer


@dataclass
class SpeculationStats:
    """Proposed and accepted tokens, and how many of each step's proposals were accepted."""
    proposed: int = 0
    accepted: int = 0
    lengths: collections.Counter = field(default_factory=collections.Counter)

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.lengths[accepted] += 1


class Speculation:
    """``proposer`` None: speculation is off and every method does nothing."""

    def __init__(self, proposer: Proposer | None, fixed_length: int):
        self.proposer = proposer
        self.fixed_length = fixed_length  # --num-speculative-tokens; 0: planned per step
        self.draft_lengths: dict[str, DraftLength] = {}
        self.step_costs = StepCosts()  # decode steps timed by rows: what a proposal's row costs here
        self.forced_proposals: set[str] = set()  # requests whose pending proposal a grammar forced
        self.stats = SpeculationStats()

    def propose(self, running: Sequence[Request], max_model_len: int,
                forced_tokens: Callable[[str], list[int]]) -> tuple[float, int]:
        """Proposals for the running requests whose known tokens are all computed but the
        last (they decode): checked in the next step. Where a grammar forces the next tokens
        (a tool call's envelope, a schema's keys), those are the proposal; the others get
        what ``plan_lengths`` gives them. Returns the proposer's seconds and guess depth."""
        if self.proposer is None:
            return 0.0, 0
        lengths, rooms, requests, rows = [], [], [], 0
        for req in running:
            if req.num_computed_tokens != req.num_tokens - 1:
                continue
            rows += 1
            room = _room(req, max_model_len)
            if room <= 0:
                continue
            forced = forced_tokens(req.request_id) if req.params.guided is not None else []
            if forced:  # they land for sure: guesses of rate 1, planned like the others
                lengths.append(DraftLength(self.fixed_length, rate=1.0, most=len(forced), forced=True))
                rooms.append(min(room, len(forced)))
            else:
                lengths.append(self.draft_lengths.setdefault(req.request_id, DraftLength(self.fixed_length)))
                rooms.append(room)
            requests.append((req, forced))
        planned = plan_lengths(lengths, rooms, rows, rows, self.step_costs)
        asks, self.forced_proposals = [], set()
        for (req, forced), k in zip(requests, planned):
            if forced:
                req.spec_token_ids = forced[:k]
                self.forced_proposals.add(req.request_id)
            elif k > 0:
                asks.append((req, k))
        started = time.monotonic()
        proposals = self.proposer.propose_all([(req.request_id, req.all_token_ids, k) for req, k in asks])
        for (req, _), proposed in zip(asks, proposals):
            req.spec_token_ids = proposed
        return time.monotonic() - started, max((k for _, k in asks), default=0)

    def record(self, sched_out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Each checked proposal's fate (for adaptive lengths and the metrics)."""
        for s in sched_out.scheduled:
            if s.num_proposed and s.request_id in sampled:
                accepted = len(sampled[s.request_id]) - 1
                self.stats.record(s.num_proposed, accepted)
                length = self.draft_lengths.get(s.request_id)
                if length is not None and s.request_id not in self.forced_proposals:  # a grammar's always land
                    length.record(s.num_proposed, accepted)

    def observe(self, sched_out: SchedulerOutput, hidden: dict, sampled: dict[str, list[int]],
                errors: dict[str, str]) -> None:
        """The hidden states of the positions this step confirmed, to a proposer that reads
        them: a chunk's every row, a checking row's accepted ones (the rows after a rejected
        proposal hold a guess's state)."""
        if not hidden:
            return
        for s in sched_out.scheduled:
            states, tokens = hidden.get(s.request_id), sampled.get(s.request_id)
            if states is None or s.request_id in errors or (s.num_proposed and tokens is None):
                continue
            confirmed = len(tokens) if s.num_proposed else len(s.token_ids)
            self.proposer.observe(s.request_id, s.start_position, states[:confirmed])

    def time_step(self, sched_out: SchedulerOutput, forward_seconds: float, step_seconds: float,
                  proposing: tuple[float, int]) -> None:
        """A step whose every request decoded (one row each, plus its checked proposals) is what
        the proposal planner weighs: its seconds by the rows it computed."""
        scheduled = sched_out.scheduled
        if self.proposer is not None and scheduled and all(
                len(s.token_ids) == 1 + s.num_proposed and s.sample for s in scheduled):
            self.step_costs.record(sum(len(s.token_ids) for s in scheduled), forward_seconds, step_seconds,
                                   *proposing)

    def forget(self, req: Request) -> None:
        """A finished request: the proposer keeps what it learns from the output (suffix)."""
        if self.proposer is not None:
            self.proposer.forget(req.request_id, req.output_token_ids)
            self.draft_lengths.pop(req.request_id, None)


def _room(req: Request, max_model_len: int) -> int:
    """How many proposals the request can still use: all but its last token's place."""
    room = min(req.params.max_tokens - req.num_output_tokens - 1, max_model_len - req.num_tokens - 1)
    if req.pause_after is not None:
        room = min(room, req.pause_after - req.num_output_tokens - 1)
    return room
