"""Rank 0's schedulers for data-parallel attention, without a model: where new requests go
(the prefix cache against the queue), each step's chunks tagged with their rank, every
block back in its own pool after the requests end, and one journal of block hashes that
says what the worker holds while any rank holds it. (Hand-offs between ranks' pools:
tests/unit/test_tensor_parallel.py.)"""

import pytest

from xlserve.config import CacheConfig, SchedulerConfig
from xlserve.engine.rank_schedulers import RankSchedulers
from xlserve.engine.request import FinishReason, Request
from xlserve.engine.scheduler import Scheduler
from xlserve.sampling_params import SamplingParams

BLOCK = 16


def _ranks(n: int = 2, blocks: int = 64) -> RankSchedulers:
    return RankSchedulers([Scheduler(SchedulerConfig(max_num_batched_tokens=256), CacheConfig(block_size=BLOCK),
                                     blocks, 1024) for _ in range(n)])


def _request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), set(), BLOCK)


def _step(ranks: RankSchedulers, token: int = 7):
    out = ranks.schedule()
    ranks.update(out, {s.request_id: [token] for s in out.scheduled if s.sample}, {})
    return out


def test_requests_spread_over_idle_ranks_and_chunks_carry_their_rank():
    ranks = _ranks()
    for i in range(4):
        ranks.add_request(_request(f"r{i}", list(range(100 * i, 100 * i + 40))))
    assert ranks.placed == [2, 2]
    out = ranks.schedule()
    assert [(s.request_id, s.dp_rank) for s in out.scheduled] == [("r0", 0), ("r2", 0), ("r1", 1), ("r3", 1)]
    assert [s.block_ids for s in out.scheduled] == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]]  # a pool each


def test_a_cached_prefix_draws_its_turns_until_the_queue_outweighs_it():
    ranks = _ranks()
    system = list(range(1000, 1160))  # 10 blocks
    ranks.add_request(_request("first", system + [1, 2, 3]))
    while ranks.num_unfinished:
        _step(ranks)
    assert ranks.placed == [1, 0]
    ranks.add_request(_request("turn", system + [4, 5, 6]))  # 160 tokens cached on rank 0: it goes there
    assert ranks.rank_of("turn") == 0
    ranks.add_request(_request("other", list(range(5000, 5100))))  # nothing cached: the shorter queue
    assert ranks.rank_of("other") == 1
    ranks.add_request(_request("again", system + [8, 9]))  # rank 0's queue (3 + ...) is still below 160
    assert ranks.rank_of("again") == 0


def test_every_block_returns_and_finished_requests_are_forgotten():
    ranks = _ranks()
    for i in range(6):
        ranks.add_request(_request(f"r{i}", list(range(50 * i, 50 * i + 30)), max_tokens=3))
    _step(ranks)
    assert ranks.finish("r1", FinishReason.ABORT) is not None
    assert ranks.finish("r1", FinishReason.ABORT) is None
    while ranks.num_unfinished:
        _step(ranks)
    _step(ranks)  # the last finished ids are reported (and forgotten) by the next schedule
    assert ranks.kv.num_used_blocks == 0 and ranks.kv.num_blocks == 128
    assert ranks.rank_of("r0") is None and not ranks.requests and not ranks.running and not ranks.waiting
    assert ranks.kv.stats.queried_tokens == 6 * 30  # summed over the ranks


def test_one_journal_of_hashes_held_by_any_rank():
    ranks = _ranks(blocks=4)
    prompt = list(range(2000, 2033))  # two full blocks
    ranks.add_request(_request("a", prompt, max_tokens=1))
    ranks.add_request(_request("b", prompt, max_tokens=1))  # rank 0's queue is longer than the prompt
    assert [ranks.rank_of(r) for r in "ab"] == [0, 1]
    while ranks.num_unfinished:
        _step(ranks)
    epoch = ranks.kv.events.epoch
    events = ranks.kv.events_since(0, epoch)
    assert [kind for kind, _ in events["events"]] == ["stored", "stored"]  # once, though both ranks hold them
    held = sorted(h for _, h in events["events"])
    ranks.add_request(_request("c", list(range(4000, 4064)), max_tokens=1))  # all four of rank 0's blocks
    assert ranks.rank_of("c") == 0
    _step(ranks)
    later = ranks.kv.events_since(events["seq"], epoch)["events"]
    assert all(kind == "stored" for kind, _ in later)  # evicted on rank 0, still on rank 1: not withdrawn
    assert set(held) <= set(ranks.kv.events_since(0, "another epoch")["snapshot"])


def test_kv_tiers_are_refused_clearly():
    with pytest.raises(ValueError, match="data-parallel-attention.*without --kv-tiers"):
        _ranks().kv.attach_tiers(object())
