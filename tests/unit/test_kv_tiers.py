"""KV tiers: host memory and disk on their own (LRU, restart, corrupt and truncated blocks,
a full disk), then under the engine: a session evicted from the device pool to host memory
and on to disk comes back as a prefix hit with output identical to a run that never evicted."""

import os

import numpy as np
import pytest

from xlserve import LLM, SamplingParams
from xlserve.kvstore.base import layout_digest
from xlserve.kvstore.disk import DiskTier
from xlserve.kvstore.host import HostTier
from xlserve.kvstore.tiered import TieredKV

GIB = 1024 ** 3
DIGEST = layout_digest("test layout")
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)


def _blocks(n, size=64, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


def _keys(n, start=0):
    return [i.to_bytes(16, "little") for i in range(start, start + n)]


def test_host_tier_is_lru_and_hands_its_evictions_on():
    tier = HostTier(64, gib=3 * 64 / GIB)
    data = _blocks(4)
    assert tier.put(_keys(3), list(data[:3])) == []
    assert tier.get(_keys(1))[0] == data[0].tobytes()  # key 0 is now the most recent
    evicted = tier.put(_keys(1, start=3), [data[3]])
    assert [k for k, _ in evicted] == _keys(1, start=1)
    assert bytes(evicted[0][1]) == data[1].tobytes()
    assert tier.contains(_keys(4)) == [True, False, True, True]
    assert tier.num_blocks == 3 and tier.stats.evictions == 1


def test_disk_tier_survives_a_restart_in_lru_order(tmp_path):
    tier = DiskTier(64, str(tmp_path), 3 * (64 + 45) / GIB, DIGEST)
    data = _blocks(3)
    tier.put(_keys(3), list(data))
    again = DiskTier(64, str(tmp_path), 3 * (64 + 45) / GIB, DIGEST)
    assert [bytes(b) for b in again.get(_keys(3))] == [row.tobytes() for row in data]
    other_layout = DiskTier(64, str(tmp_path), 1.0, layout_digest("another layout"))
    assert other_layout.get(_keys(1)) == [None]  # blocks of another layout are misses
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete"])
def test_a_damaged_disk_block_is_a_miss_and_is_removed(tmp_path, damage):
    tier = DiskTier(64, str(tmp_path), 1.0, DIGEST)
    tier.put(_keys(2), list(_blocks(2)))
    path = tier._path(_keys(1)[0])
    raw = bytearray(path.read_bytes())
    if damage == "flip a byte":
        raw[-1] ^= 0xFF
        path.write_bytes(raw)
    elif damage == "truncate":
        path.write_bytes(raw[:-10])
    else:
        path.unlink()
    got = tier.get(_keys(2))
    assert got[0] is None and bytes(got[1]) == _blocks(2)[1].tobytes()
    assert not path.exists() and tier.contains(_keys(1)) == [False]
    assert tier.stats.failures == 1


def test_a_full_disk_takes_the_tier_out_and_the_rest_goes_on(full_disk, caplog):
    tier = DiskTier(4096, str(full_disk), 1.0, DIGEST)
    blocks = _blocks(40, size=4096)
    tier.put(_keys(40), list(blocks))  # 160 KiB into 64 KiB
    assert not tier.enabled and tier.stats.failures == 1
    assert sum("is off after a write failed" in r.message for r in caplog.records) == 1
    stored = tier.num_blocks
    assert 0 < stored < 40
    assert bytes(tier.get(_keys(1))[0]) == blocks[0].tobytes()  # what is there still reads
    tier.put(_keys(1, start=50), [blocks[0]])
    assert tier.stats.dropped >= 1 and tier.num_blocks == stored
    assert not [p for p in os.listdir(full_disk) if p.startswith(".tmp-")]


def test_tiered_lookup_takes_each_block_from_the_first_tier_holding_it(tmp_path):
    host = HostTier(64, gib=2 * 64 / GIB)
    disk = DiskTier(64, str(tmp_path), 1.0, DIGEST)
    tiers = TieredKV([host, disk], timeout=2.0)
    data = _blocks(5)
    keys = _keys(5)
    tiers.offer_evicted(keys, data)  # host keeps the last two, the first three go on to disk
    assert tiers.flush()
    assert host.contains(keys) == [False, False, False, True, True]
    assert disk.contains(keys) == [True, True, True, False, False]
    load = tiers.lookup(keys + _keys(1, start=9)).result(timeout=5)
    assert load.hashes == keys and load.data == data.tobytes()
    assert load.from_tiers == {"host": 2, "disk": 3}
    assert tiers.lookup(_keys(1, start=9)) is None  # no local tier has the first block: nothing to ask
    tiers.close()


def test_writes_past_the_budget_are_dropped_and_counted():
    tiers = TieredKV([HostTier(64, gib=1e-3)], timeout=2.0, max_pending_bytes=64 * 3)
    tiers._writers["local"].pending.take(64 * 3)  # the writer is busy with three blocks already
    tiers.offer_evicted(_keys(2), _blocks(2))
    assert tiers.dropped_writes == 2
    tiers._writers["local"].pending.give(64 * 3)
    tiers.close()


def _session(seed, n):
    rng = np.random.default_rng(seed)
    return rng.integers(3, 320, n).tolist()


def _answer(out) -> tuple[list[int], list[float]]:
    return out.outputs[0].token_ids, [entry["logprob"] for entry in out.outputs[0].logprobs]


def test_a_session_evicted_to_host_then_disk_comes_back_identical(tiny_llama_dir, tmp_path):
    """A pool of 12 blocks of 16 tokens, a host tier of 4 blocks, then disk: the 96-token
    session is evicted by other prompts, and its second turn loads 6 blocks instead of
    computing them."""
    never = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=4096)  # never evicts the session
    probe = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=192)
    block_bytes = probe.engine.kv.layout.block_bytes
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=192, kv_tiers="host,disk",
              kv_host_gib=4 * block_bytes / GIB, kv_disk_dir=str(tmp_path / "kv"))
    session = _session(1, 96)
    first = llm.generate(session + [5], GREEDY)[0]
    for seed in range(2, 6):  # 4 x 80 tokens push the session out of the device pool
        llm.generate(_session(seed, 80), GREEDY)
    tiers = llm.engine.kv.tiers
    assert tiers.flush()
    stats = tiers.stats()["tiers"]
    assert stats["host"]["evictions"] > 0 and stats["disk"]["stored"] > 0
    second = llm.generate(session + [6], GREEDY)[0]
    assert second.cached_tokens == 96
    # the same bits as where the session stayed on the device: computed whole, then a prefix hit
    assert _answer(first) == _answer(never.generate(session + [5], GREEDY)[0])
    kept = never.generate(session + [6], GREEDY)[0]
    assert kept.cached_tokens == 96 and _answer(second) == _answer(kept)
    stats = tiers.stats()["tiers"]
    assert stats["disk"]["hits"] > 0 and stats["host"]["hits"] + stats["disk"]["hits"] == 6
    assert llm.engine.stats()["kv_blocks_used"] == 0 and llm.engine.stats()["num_loading"] == 0


def test_a_tier_slower_than_computing_is_passed_over_but_probed(tmp_path):
    disk = DiskTier(64, str(tmp_path), 1.0, DIGEST)
    tiers = TieredKV([disk], timeout=2.0, block_size=16)
    disk.put(_keys(2), list(_blocks(2)))
    tiers.costs.computed(tokens=1000, seconds=0.001)  # 1 µs a token: 16 µs a block
    tiers.costs.read("disk", blocks=1, seconds=0.01)  # 10 ms a block
    loads = [tiers.lookup(_keys(2)).result(timeout=5) for _ in range(16)]
    assert [len(load.hashes) for load in loads].count(2) == 1  # one lookup in 16 probes it
    assert tiers.stats()["tiers"]["disk"]["skipped"] == 15
    tiers.costs.computed(tokens=1000, seconds=100.0)  # computing got slow (a big model): the disk pays again
    assert len(tiers.lookup(_keys(2)).result(timeout=5).hashes) == 2
    tiers.close()
