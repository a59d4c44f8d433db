"""KV events: the journal, snapshots on reset, and the router index that follows them."""

from xlserve.engine.block_pool import BlockPool
from xlserve.engine.kv_events import KVEventLog
from xlserve.router.index import PrefixIndex


def _h(i):
    return bytes([i]) * 16


def test_pool_journals_stored_and_removed_blocks():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, _h(1))
    pool.cache_block(b, _h(2))
    first = pool.events.since(0, "", lambda: list(pool.cached))
    assert first["reset"] and sorted(first["snapshot"]) == [_h(1).hex(), _h(2).hex()]
    pool.free([a, b])
    pool.allocate(1)  # evicts block a's hash
    feed = pool.events.since(first["seq"], first["epoch"], lambda: list(pool.cached))
    assert not feed["reset"] and feed["events"] == [["removed", _h(1).hex()]]


def test_reader_behind_the_journal_or_of_another_epoch_gets_a_snapshot():
    log = KVEventLog(capacity=2)
    for i in range(5):
        log.stored(_h(i))
    assert log.since(1, log.epoch, lambda: [_h(9)])["reset"]  # events 2..3 were dropped
    assert not log.since(3, log.epoch, lambda: [])["reset"]
    assert log.since(5, "another-epoch", lambda: [_h(9)])["snapshot"] == [_h(9).hex()]


def test_index_follows_events_and_snapshots():
    index = PrefixIndex()
    index.apply_events("w", {"reset": True, "snapshot": [_h(1).hex(), _h(2).hex()]})
    assert index.cached_blocks([_h(1), _h(2)], ["w"]) == {"w": 2}
    index.apply_events("w", {"reset": False, "events": [["removed", _h(2).hex()], ["stored", _h(3).hex()]]})
    assert index.cached_blocks([_h(1), _h(2)], ["w"]) == {"w": 1}
    assert index.blocks_on("w") == 2
    index.apply_events("w", {"reset": True, "snapshot": []})  # the worker restarted empty
    assert index.blocks_on("w") == 0


def test_tier_events_and_snapshots_say_where_a_block_is():
    log = KVEventLog()
    log.tier_snapshots["host"] = lambda: [_h(4)]
    log.stored(_h(1))
    log.stored(_h(2), "host")
    log.removed(_h(1))
    feed = log.since(0, log.epoch, lambda: [])
    assert feed["events"] == [["stored", _h(1).hex()], ["stored", _h(2).hex(), "host"], ["removed", _h(1).hex()]]
    reset = log.since(0, "new reader", lambda: [_h(3)])
    assert reset["snapshot"] == [_h(3).hex()] and reset["tier_snapshot"] == {"host": [_h(4).hex()]}


def test_index_prefers_the_device_then_host_and_counts_the_cluster_for_everyone():
    index = PrefixIndex()
    prefix = [_h(1), _h(2), _h(3)]
    index.apply_events("a", {"reset": False, "events": [["stored", h.hex(), "host"] for h in prefix]})
    index.apply_events("b", {"reset": False, "events": [["stored", h.hex()] for h in prefix[:2]]})
    assert index.cached_blocks(prefix, ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 0}
    scores = index.cache_scores(prefix[:2], ["a", "b"])
    assert scores["b"] > scores["a"] > 0  # the same two blocks: in b's device pool, in a's host memory
    index.apply_events("c", {"reset": False, "events": [["stored", _h(3).hex(), "mooncake"]]})
    index.apply_events("a", {"reset": False, "events": [["stored", _h(1).hex(), "mooncake"],
                                                        ["stored", _h(2).hex(), "mooncake"]]})
    assert index.cached_blocks(prefix, ["b", "c"]) == {"b": 3, "c": 3}  # the cluster store serves anyone
    index.apply_events("a", {"reset": False, "events": [["removed", h.hex(), "host"] for h in prefix]})
    assert index.cached_blocks(prefix, ["a"]) == {"a": 3}  # still in the cluster
    assert index.tiers_on("b") == {"device": 2}


def test_engine_announces_blocks_moving_to_host_memory(tiny_llama_dir):
    from xlserve import LLM, SamplingParams
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=64, kv_tiers="host", kv_host_gib=0.01)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate(list(range(3, 40)), greedy)
    llm.generate(list(range(50, 90)), greedy)  # pushes the first prompt's blocks out of the pool
    assert llm.engine.kv.tiers.flush()
    events = llm.engine.kv_events(0, llm.engine.kv.pool.events.epoch)["events"]
    moved = {h for kind, h, *tier in events if kind == "stored" and tier == ["host"]}
    removed = {h for kind, h, *tier in events if kind == "removed" and not tier}
    assert moved and moved <= removed
