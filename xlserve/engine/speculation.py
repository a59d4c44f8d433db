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
from xlserve.speculative.draft_budget import MAX_PROPOSALS, DraftLength, StepCosts, plan_lengths
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


# The tokens a grammar forces after guesses join the proposal when the guesses are likelier
# than not to land (by the request's rate). bench spec's tool calls on the AMX Xeon, suffix,
# median of 7 interleaved: batch 1 1.83x none (every tail: 1.67x, tails after forced tokens
# only: 1.84x), batch 8 1.34x (1.38x, 1.37x): the VM's noise, but no row spent on a likely miss.
TAIL_ODDS = 0.5

def evidence_class(evidence: int) -> int:
    """Lookup matches of 2-3, 4-7, 8-15, 16-31 and 32 or more tokens: each doubling of the
    context matched is a class of guesses with a rate of its own. bench spec's tool calls
    (suffix, batch 1, every decode position of the eight answers): the first guess landed
    after 18 of 21 matches of 3 tokens, 68 of 87 of 4-11, and 48 of 50 of 12 or more; a
    request's own rate, learned from its misses on novel argument values, had fallen to 0.21
    by the fourth request, and no later one guessed again, not even a repeated call's
    arguments matched over 20 tokens."""
    return min(evidence.bit_length(), 6)


# (request id, tokens) -> how many of the tokens the request's grammar admits from its state,
# and the tokens it forces after those (``RequestSampling.grammar_continuation``)
Continuation = Callable[[str, list[int]], tuple[int, list[int]]]


@dataclass
class ProposalChain:
    """One decoding request's proposal for the next step: the tokens its grammar forces now
    (``head``), the proposer's guesses after them, and the tokens the grammar forces after
    those (``tail``). A forced token lands whenever everything before it does, so a tool
    call's envelope, its argument value guessed from an earlier call, and the envelope's
    close can all be checked in one step where each took a step of its own."""
    req: Request
    room: int  # proposals it may carry
    guided: bool
    forced: list[int]  # what the grammar forces from the request's state
    rate: float = 1.0  # how likely each guess lands (``DraftLength.rate``)
    head: list[int] = field(default_factory=list)
    guesses: list[int] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)
    forced_entry: int | None = None  # its places in the plan (``plan_lengths``)
    guess_entry: int | None = None
    evidence: int = 0  # a lookup's: how many latest tokens its guesses' context matched

    @property
    def tokens(self) -> list[int]:
        return self.head + self.guesses + self.tail

    def follow_grammar(self, continuation: Continuation) -> None:
        """Guesses the grammar forbids are cut (each would cost a row, then be rejected); the
        tokens it forces after what is left join, within the room, if the guesses before them
        are likelier than not to land."""
        admitted, forced = continuation(self.req.request_id, self.head + self.guesses)
        if admitted < len(self.head):  # never for a grammar's own forced tokens
            self.head, self.guesses = self.head[:admitted], []
            return
        self.guesses = self.guesses[:admitted - len(self.head)]
        if self.guesses and self.rate ** len(self.guesses) < TAIL_ODDS:
            return
        self.tail = forced[:self.room - len(self.head) - len(self.guesses)]


class Speculation:
    """``proposer`` None: speculation is off and every method does nothing."""

    def __init__(self, proposer: Proposer | None, fixed_length: int):
        self.proposer = proposer
        self.fixed_length = fixed_length  # --num-speculative-tokens; 0: planned per step
        self.draft_lengths: dict[str, DraftLength] = {}
        self.by_evidence: dict[int, DraftLength] = {}  # lookups' guesses by evidence_class
        self.recent = DraftLength()  # every request's guesses, latest weighing most: a new request's start
        self.step_costs = StepCosts()  # decode steps timed by rows: what a proposal's row costs here
        self.chains: dict[str, ProposalChain] = {}  # the pending proposals, by request
        self.stats = SpeculationStats()

    def propose(self, running: Sequence[Request], max_model_len: int, continuation: Continuation) -> tuple[float, int]:
        """Proposals for the running requests whose known tokens are all computed but the
        last (they decode): checked in the next step. Where a grammar forces the next tokens
        (a tool call's envelope, a schema's keys), those lead the proposal; guesses follow
        as ``plan_lengths`` gives them, cut where the grammar forbids one, and the tokens the
        grammar forces after them close it (``ProposalChain``). A lookup proposer guesses
        before the plan (it costs next to nothing), so the plan weighs each request's guesses
        by how often guesses on the same evidence landed; a model proposer guesses after it,
        as deep as planned. Returns the proposer's seconds and guess depth."""
        if self.proposer is None:
            return 0.0, 0
        decoding = [req for req in running if req.num_computed_tokens == req.num_tokens - 1]
        chains = [chain for chain in (self._chain(req, max_model_len, continuation) for req in decoding)
                  if chain.room > 0]
        started = time.monotonic()
        if self.proposer.guesses_ahead:
            self._look_up(chains)
        seconds = time.monotonic() - started
        lengths, rooms = self._entries(chains)
        planned = plan_lengths(lengths, rooms, len(decoding), len(decoding), self.step_costs)
        more_seconds, depth = self._fill(chains, planned, continuation)
        return seconds + more_seconds, depth

    def _chain(self, req: Request, max_model_len: int, continuation: Continuation) -> ProposalChain:
        room = _room(req, max_model_len)
        room = min(room, self.fixed_length) if self.fixed_length else room
        guided = req.params.guided is not None
        forced = continuation(req.request_id, [])[1][:room] if guided and room > 0 else []
        return ProposalChain(req, room, guided, forced)

    def _guesses(self, chain: ProposalChain) -> bool:
        """The proposer guesses for this chain: room is left after its forced run, and a
        forced run only precedes guesses of a proposer that can guess ahead of the KV."""
        return (chain.room > len(chain.forced) and self.proposer.guesses
                and (not chain.forced or self.proposer.guesses_ahead))

    def _look_up(self, chains: list[ProposalChain]) -> None:
        """A lookup proposer's guesses after each chain's whole forced run, as many as may
        go (the plan keeps their likeliest prefix), and their evidence."""
        for chain in filter(self._guesses, chains):
            k = min(chain.room - len(chain.forced), MAX_PROPOSALS)
            chain.guesses, chain.evidence = self.proposer.propose_scored(
                chain.req.request_id, chain.req.all_token_ids + chain.forced, k)

    def _entries(self, chains: list[ProposalChain]) -> tuple[list[DraftLength], list[int]]:
        """The plan's entries: each chain's forced run (rate 1) and its guesses (at the rate
        of their evidence, or else of the request), with how many each may take."""
        lengths, rooms, looked_up = [], [], self.proposer.guesses_ahead
        for chain in chains:
            if chain.forced:  # they land for sure: guesses of rate 1, planned like the others
                chain.forced_entry = len(lengths)
                lengths.append(DraftLength(self.fixed_length, rate=1.0, most=len(chain.forced), forced=True))
                rooms.append(len(chain.forced))
            room = len(chain.guesses) if looked_up else chain.room - len(chain.forced)
            if not self._guesses(chain) or room <= 0:
                continue
            chain.guess_entry = len(lengths)
            request = self._request_length(chain.req.request_id)  # it learns either way
            lengths.append(self._evidence_length(chain.evidence) if chain.evidence else request)
            chain.rate = lengths[-1].rate
            rooms.append(room)
        return lengths, rooms

    def _fill(self, chains: list[ProposalChain], planned: list[int], continuation: Continuation) -> tuple[float, int]:
        """Each chain's forced head and guesses as planned (a model proposer guesses now),
        then its grammar's say. Returns the model proposer's seconds and the guess depth."""
        asks, looked_up = [], self.proposer.guesses_ahead
        for chain in chains:
            kf = planned[chain.forced_entry] if chain.forced_entry is not None else 0
            chain.head = chain.forced[:kf]
            kg = planned[chain.guess_entry] if chain.guess_entry is not None else 0
            whole_head = kf == len(chain.forced)  # guesses follow the whole head only
            chain.guesses = chain.guesses[:kg] if looked_up and whole_head else []
            if kg and whole_head and not looked_up:
                asks.append((chain, kg))
        started = time.monotonic()
        if asks:
            proposals = self.proposer.propose_all([(c.req.request_id, c.req.all_token_ids + c.head, k)
                                                   for c, k in asks])
            for (chain, _), guesses in zip(asks, proposals):
                chain.guesses = guesses
        seconds = time.monotonic() - started
        self.chains = {}
        for chain in chains:
            if chain.guided and (chain.head or chain.guesses):
                chain.follow_grammar(continuation)
            if chain.tokens:
                chain.req.spec_token_ids = chain.tokens
                self.chains[chain.req.request_id] = chain
        return seconds, max((len(c.guesses) for c in chains), default=0)

    def _request_length(self, request_id: str) -> DraftLength:
        length = self.draft_lengths.get(request_id)
        if length is None:
            length = self.draft_lengths[request_id] = self._new_length()
        return length

    def _evidence_length(self, evidence: int) -> DraftLength:
        """The rate of guesses on this much evidence, learned across requests."""
        bucket = evidence_class(evidence)
        length = self.by_evidence.get(bucket)
        if length is None:
            length = self.by_evidence[bucket] = DraftLength(self.fixed_length)
        return length

    def _new_length(self) -> DraftLength:
        """A request's first guesses land as often as the other requests' lately did."""
        return DraftLength(self.fixed_length, rate=self.recent.rate)

    def reset(self) -> None:
        """Forget what was learned across requests (a benchmark run starts from nothing)."""
        self.recent, self.by_evidence = DraftLength(), {}
        if self.proposer is not None:
            self.proposer.reset()

    def record(self, sched_out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Each checked proposal's fate (for adaptive lengths and the metrics): a request's rate
        learns from its guesses alone (a grammar's forced tokens always land)."""
        for s in sched_out.scheduled:
            if s.num_proposed and s.request_id in sampled:
                accepted = len(sampled[s.request_id]) - 1
                self.stats.record(s.num_proposed, accepted)
                length, chain = self.draft_lengths.get(s.request_id), self.chains.get(s.request_id)
                if length is None:
                    continue
                if chain is None:  # proposed elsewhere (before a hand-off): all guesses
                    guessed, landed = s.num_proposed, accepted
                else:
                    guessed = min(len(chain.guesses), s.num_proposed - len(chain.head))
                    landed = min(max(0, accepted - len(chain.head)), guessed)
                if guessed > 0:
                    length.record(guessed, landed)
                    self.recent.record(guessed, landed)
                    if chain is not None and chain.evidence:
                        self._evidence_length(chain.evidence).record(guessed, landed)

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
