"""Continuous-batching scheduler with one token budget per step.

Each step hands tokens to requests so that ``num_computed_tokens`` catches up with
``num_tokens``: running requests first (oldest first), then waiting ones, each taking
what the budget leaves (chunked prefill). When the KV pool runs dry, the newest running
request is preempted: its blocks are freed and it is recomputed later (prefix hits make
that cheap). The output is plain data; tensors never cross into the scheduler.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from xlserve.config import CacheConfig, SchedulerConfig
from xlserve.engine.kv_cache_manager import KVCacheManager
from xlserve.engine.kv_groups import KVGroup
from xlserve.engine.request import FinishReason, Request, RequestStatus
from xlserve.sampling_params import SamplingParams

LOAD_AT_ONCE_S = 0.005  # a tier load that takes longer waits off the queue while others run


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_position: int  # == num_computed_tokens before the step
    block_ids: list[int]  # KV layer group 0's table
    sample: bool  # the chunk reaches the last known token: sample the next one
    params: SamplingParams
    seed: int | None
    output_index: int  # how many output tokens precede the one this step samples
    prompt_token_ids: list[int] | None = None  # only when penalties need the history
    output_token_ids: list[int] | None = None
    window_block_ids: tuple[list[int], ...] = ()  # windowed groups' tables (-1: freed, outside the window)
    num_proposed: int = 0  # speculative decoding: the last this many of token_ids are proposals to check
    dp_rank: int = 0  # data-parallel attention: the rank whose KV pool the blocks are in, which runs the chunk


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    finished_request_ids: list[str] = field(default_factory=list)  # since the last step


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig, num_blocks: int, max_model_len: int,
                 kv_groups: tuple[KVGroup, ...] = (KVGroup(None, ()),)):
        self.config = config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, kv_groups)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_ids: list[str] = []
        self.num_preemptions = 0
        # requests whose prefix the KV tiers are fetching: id -> (request, future, deadline)
        self.loading: dict[str, tuple[Request, Future, float]] = {}
        self.num_tier_timeouts = 0

    def add_request(self, request: Request) -> None:
        """Queued behind every waiting request of the same or a lower ``priority`` value
        (first come, first served within a priority); preempted requests stay in front."""
        self.requests[request.request_id] = request
        priority = request.params.priority
        at = len(self.waiting)
        while at > 0 and self.waiting[at - 1].status == RequestStatus.WAITING \
                and self.waiting[at - 1].params.priority > priority:
            at -= 1
        self.waiting.insert(at, request)

    def overdue(self, timeout: float, now: float) -> list[str]:
        """Requests that have waited longer than ``timeout`` seconds without ever running."""
        return [r.request_id for r in self.waiting
                if r.status == RequestStatus.WAITING and r.num_preemptions == 0 and now - r.arrival_time > timeout]

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        if self.loading:
            self._collect_loads(time.monotonic())
        preempted = self._schedule_running(scheduled, budget)
        budget -= sum(len(s.token_ids) for s in scheduled)
        if not preempted:
            self._schedule_waiting(scheduled, budget)
        finished, self.finished_ids = self.finished_ids, []
        return SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled), finished)

    def _schedule_running(self, scheduled: list, budget: int) -> bool:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            # proposals ride along when the known tokens fit and budget is left, never taking
            # the token each running request after this one needs
            spare = budget - n - (len(self.running) - i - 1)
            proposed = req.spec_token_ids[:max(0, spare)] if n == req.num_tokens - req.num_computed_tokens else []
            if proposed and not self.kv.allocate_slots(req, n + len(proposed)):
                proposed = []  # no room for a guess: nobody is preempted for one
            while not proposed and not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            scheduled.append(self._scheduled(req, n, proposed))
            budget -= n + len(proposed)
            i += 1
        return preempted

    def _schedule_waiting(self, scheduled: list, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self.kv.tiers is not None and not req.tiers_asked and self._start_load(req):
                continue
            hits, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.kv.record_lookup(req.num_tokens, num_hit)
            self.waiting.popleft()
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(self._scheduled(req, n))
            budget -= n

    # -- KV tiers: a request whose prefix a tier holds waits for it off the queue ----------
    def _start_load(self, req: Request) -> bool:
        """Ask the tiers for the request's prefix; True when it must wait off the queue (a load
        that arrives at once, as host memory's does, is taken now)."""
        req.tiers_asked = True
        future = self.kv.start_load(req)
        if future is None:
            return False
        if wait([future], LOAD_AT_ONCE_S).done:
            self.kv.finish_load(req, future.result() if future.exception() is None else None)
            return False
        self.waiting.popleft()
        self.loading[req.request_id] = (req, future, time.monotonic() + self.kv.tiers.timeout)
        return True

    def _collect_loads(self, now: float) -> None:
        """Loads that arrived go into the pool; their requests (and those past the deadline,
        which compute what did not arrive) return to the front of the queue."""
        back = []
        for request_id, (req, future, deadline) in list(self.loading.items()):
            if not future.done() and now < deadline:
                continue
            del self.loading[request_id]
            back.append(req)
            arrived = future.done() and not future.cancelled() and future.exception() is None
            if not future.done():
                self.num_tier_timeouts += 1
                future.cancel()  # a load still running finishes into nothing
            self.kv.finish_load(req, future.result() if arrived else None)
        for req in reversed(back):
            self.waiting.appendleft(req)

    def wait_for_loads(self, timeout: float) -> None:
        """Block until a tier load arrives (or ``timeout``), when there is nothing else to do."""
        if self.loading:
            wait([f for _, f, _ in self.loading.values()], timeout, return_when=FIRST_COMPLETED)

    def _scheduled(self, req: Request, n: int, proposed: list[int] = ()) -> ScheduledRequest:
        start = req.num_computed_tokens
        penalties = req.params.has_penalties
        tables = self.kv.block_ids(req.request_id)
        return ScheduledRequest(
            request_id=req.request_id, token_ids=req.all_token_ids[start:start + n] + list(proposed),
            start_position=start, block_ids=tables[0], window_block_ids=tuple(tables[1:]),
            sample=start + n == req.num_tokens, params=req.params, seed=req.params.seed,
            output_index=req.num_output_tokens,
            prompt_token_ids=req.prompt_token_ids if penalties else None,
            output_token_ids=list(req.output_token_ids) if penalties else None, num_proposed=len(proposed))

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.tiers_asked = False  # its blocks may have moved to a tier by the time it runs again
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]],
               logprobs: dict[str, list[dict]]) -> list[tuple[Request, int]]:
        """Advance the scheduled requests; returns those that produced tokens, with how many.
        A request that checked proposals keeps the KV of those accepted (one fewer than the
        tokens it emits); a rejected proposal's slot is computed again next step."""
        advanced = []
        for s in output.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.spec_token_ids = []
            if not s.sample:
                req.num_computed_tokens += len(s.token_ids)
                continue
            tokens = sampled[s.request_id]
            req.num_computed_tokens += len(s.token_ids) - s.num_proposed + len(tokens) - 1
            if s.start_position < len(req.prompt_token_ids) <= req.num_computed_tokens:
                self.kv.write_through(req)  # the prompt is in: other workers may want it before the answer ends
            for i, token in enumerate(tokens, start=1):
                req.append_token(token)
                if s.request_id in logprobs:
                    req.output_logprobs.append(logprobs[s.request_id][i - 1])
                if req.check_stop(self.max_model_len):  # the tokens after a stop are dropped
                    self.finish(req.request_id, req.finish_reason)
                    break
            advanced.append((req, i))
        return advanced

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.loading.pop(request_id, None) is not None:
            self.kv.finish_load(req, None)
        if reason != FinishReason.ERROR:  # an error's blocks may be half-written
            self.kv.write_through(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.finished_ids.append(request_id)
        return req
