"""Routing policies on plain Worker records: exact choices."""

import pytest

from xlserve.router.index import PrefixIndex
from xlserve.router.policies import CacheAware, LeastTokens, RoundRobin, RouteRequest, SessionAffinity, make_policy
from xlserve.router.pool import Worker


def _workers(*loads):
    return [Worker(f"http://w{i}", "both", decode_tokens=load) for i, load in enumerate(loads)]


def _req(session=None, blocks=4):
    return RouteRequest([bytes([i]) * 16 for i in range(blocks)], blocks * 16, session)


def test_round_robin_and_least_tokens():
    ws = _workers(0, 0, 0)
    rr = RoundRobin()
    assert [rr.pick(ws, _req(), {}).url for _ in range(4)] == ["http://w0", "http://w1", "http://w2", "http://w0"]
    assert LeastTokens().pick(_workers(50, 10, 30), _req(), {}).url == "http://w1"


def test_cache_aware_prefers_cache_within_the_load_bound():
    ws = _workers(100, 0)
    policy = CacheAware(block_size=16, load_weight=0.1, max_imbalance=1000)
    assert policy.pick(ws, _req(), {"http://w0": 4, "http://w1": 0}).url == "http://w0"
    hot = _workers(5000, 0)  # beyond the imbalance bound: the cache does not win
    assert policy.pick(hot, _req(), {"http://w0": 4, "http://w1": 0}).url == "http://w1"


def test_affinity_sticks_then_spills_on_overload_and_down():
    ws = _workers(0, 0, 0)
    policy = SessionAffinity(LeastTokens(), load_factor=1.5, slack=100)
    home = policy.pick(ws, _req("session-a"), {})
    assert all(policy.pick(ws, _req("session-a"), {}) is home for _ in range(5))
    home.decode_tokens = 10_000  # overloaded: over 1.5x the mean + slack
    moved = policy.pick(ws, _req("session-a"), {})
    assert moved is not home
    home.decode_tokens = 0
    others = [w for w in ws if w is not home]  # home is down: not a candidate
    assert policy.pick(others, _req("session-a"), {}) in others
    assert policy.pick(ws, _req("session-a"), {}) is home  # and back when it returns
    assert policy.pick(ws, _req(None), {}).url == "http://w0"  # no session: the fallback policy


def test_prefix_index_counts_leading_blocks():
    index = PrefixIndex(capacity=100)
    hashes = [bytes([i]) * 16 for i in range(4)]
    index.record(hashes[:3], "http://a")
    index.record(hashes, "http://b")
    assert index.cached_blocks(hashes, ["http://a", "http://b", "http://c"]) == {"http://a": 3, "http://b": 4,
                                                                               "http://c": 0}
    index.forget_worker("http://b")
    assert index.cached_blocks(hashes, ["http://b"]) == {"http://b": 0}
    assert len(index) == 3  # the block only b held is forgotten


def test_prefix_index_forgets_blocks_nobody_holds():
    """Every block a worker reports removed leaves the index: the soak's router kept an empty
    entry per block it ever saw (1.3 KiB more RSS a request, up to a million entries)."""
    index = PrefixIndex()
    for turn in range(50):  # a worker stores and evicts new blocks, in the pool and a tier
        hashes = [bytes([turn, i]) * 8 for i in range(4)]
        index.apply_events("http://a", {"events": [["stored", h.hex()] for h in hashes]
                                        + [["stored", h.hex(), "host"] for h in hashes[:2]]})
        index.apply_events("http://a", {"events": [["removed", h.hex()] for h in hashes]
                                        + [["removed", h.hex(), "host"] for h in hashes[:2]]})
    assert len(index) == 0
    index.record([b"x" * 16], "http://a")
    index.record([b"x" * 16], "http://b", "disk")
    index.forget_worker("http://a")
    assert len(index) == 1
    index.forget_worker("http://b")
    assert len(index) == 0


def test_unknown_policy():
    with pytest.raises(ValueError, match="available"):
        make_policy("random-walk")
