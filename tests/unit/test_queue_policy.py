"""Who leaves the waiting queue first (request priority), and who is refused after
waiting too long (--queue-timeout): scheduler decisions without a model, then the engine."""

import time

import pytest

from xlserve import SamplingParams
from xlserve.config import CacheConfig, EngineConfig, SchedulerConfig
from xlserve.engine.llm_engine import LLMEngine
from xlserve.engine.request import Request, RequestStatus
from xlserve.engine.scheduler import Scheduler


def _scheduler(max_num_seqs=1):
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs), CacheConfig(block_size=16), 64, 512)


def _request(rid, priority=0):
    return Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=4, priority=priority), {0}, 16)


def test_a_lower_priority_value_leaves_the_queue_first_and_ties_keep_arrival_order():
    sched = _scheduler()
    for rid, priority in (("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", -1)):
        sched.add_request(_request(rid, priority))
    assert [r.request_id for r in sched.waiting] == ["c", "e", "a", "d", "b"]
    assert [s.request_id for s in sched.schedule().scheduled] == ["c"]


def test_a_preempted_request_stays_in_front_of_any_priority():
    sched = _scheduler()
    sched.add_request(_request("old"))
    sched.waiting[0].status = RequestStatus.PREEMPTED
    sched.add_request(_request("urgent", -100))
    assert [r.request_id for r in sched.waiting] == ["old", "urgent"]


def test_overdue_requests_are_those_that_waited_too_long_without_running():
    sched = _scheduler()
    early, late = _request("early"), _request("late")
    early.arrival_time -= 10
    sched.add_request(early)
    sched.add_request(late)
    assert sched.overdue(5.0, time.monotonic()) == ["early"]


def test_priority_out_of_range_is_refused():
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=10**9)


def test_the_engine_refuses_requests_past_the_queue_timeout_as_busy(tiny_llama_dir):
    engine = LLMEngine(EngineConfig.from_kwargs(model=tiny_llama_dir, kv_cache_tokens=1024, max_num_seqs=1,
                                                queue_timeout=0.05))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for rid in ("first", "second"):
        engine.add_request(rid, [5, 6, 7, 8], params)
    ended = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ended[out.request_id] = out
        time.sleep(0.02)  # the first runs 6 steps: the second waits more than 0.05 s
    assert ended["first"].error is None and ended["first"].outputs[0].finish_reason == "length"
    assert ended["second"].retry_after is not None and "queue-timeout" in ended["second"].error
    assert engine.stats()["kv_blocks_used"] == 0
