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
