"""Block pool and KV cache manager invariants, with exact block ids."""

import pytest

from xlserve.engine.block_pool import BlockPool
from xlserve.engine.kv_cache_manager import KVCacheManager
from xlserve.engine.request import Request
from xlserve.hashing import ROOT_HASH, block_hashes, hash_block
from xlserve.sampling_params import SamplingParams


def _req(rid, ids, bs=4):
    return Request(rid, ids, SamplingParams(max_tokens=4), set(), bs)


def test_allocate_in_order_and_refcounts():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert [x.block_id for x in a] == [0, 1]
    assert [x.block_id for x in b] == [2, 3, 4]
    assert all(x.ref_cnt == 1 for x in a + b)
    assert pool.num_free_blocks == 1
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    pool.free(list(reversed(a)))
    assert list(pool.free_queue) == [5, 1, 0]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[0]])


def test_lru_reuse_and_eviction_of_cached_blocks():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, blk in enumerate(blocks):
        pool.cache_block(blk, bytes([i]) * 16)
    pool.free([blocks[2], blocks[0]])  # freed first: evicted first
    pool.free([blocks[3]])
    assert list(pool.free_queue) == [2, 0, 3]
    assert pool.lookup(bytes([2]) * 16) is blocks[2]
    got = pool.allocate(1)
    assert got[0].block_id == 2
    assert pool.lookup(bytes([2]) * 16) is None  # evicted on reuse
    assert pool.lookup(bytes([0]) * 16) is blocks[0]  # still cached while free
    pool.touch([blocks[0]])  # a prefix hit revives it
    assert blocks[0].ref_cnt == 1 and list(pool.free_queue) == [3]


def test_prefix_hit_shares_blocks_and_nothing_leaks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    assert kv.block_ids("a") == [[0, 1, 2]]  # one table: one layer group
    b = _req("b", list(range(8)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits[0]] == [0, 1] and n == 8
    assert kv.allocate_slots(b, 3, hits)
    assert kv.block_ids("b") == [[0, 1, 3]]
    assert kv.pool.blocks[0].ref_cnt == 2
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_used_blocks == 0
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    # freed tail first: b's block 3, then 1, 0; then a's 2 ... in LRU order after the never-used ones
    assert list(kv.pool.free_queue) == [4, 5, 6, 7, 2, 3, 1, 0]


def test_full_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    b = _req("b", list(range(8)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and [h.block_id for h in hits[0]] == [0]


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = _req("a", list(range(12)))
    assert not kv.allocate_slots(a, 13)
    assert kv.pool.num_free_blocks == 3 and kv.block_ids("a") == []


def test_block_hash_is_chained_and_stable():
    hs = block_hashes(list(range(8)), 4, b"m")
    assert hs[0] == hash_block(ROOT_HASH, [0, 1, 2, 3], b"m")
    assert hs[1] == hash_block(hs[0], [4, 5, 6, 7], b"m")
    assert block_hashes(list(range(8)), 4, b"other")[0] != hs[0]
    assert block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4, b"m")[1] != hs[1]  # prefix changes every later hash
    assert hs[0].hex() == hash_block(ROOT_HASH, [0, 1, 2, 3], b"m").hex()
