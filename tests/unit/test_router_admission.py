"""The router's admission on plain worker records, no model: a stage is full while every
worker of it refused and none freed a slot since."""

import time

from xlserve.router.pool import WorkerPool


def _pool(prefill: int = 2, decode: int = 1) -> WorkerPool:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(prefill + decode)]
    return WorkerPool(urls[:prefill], urls[prefill:], [])


def test_a_stage_is_full_while_every_healthy_worker_of_it_refused_and_freed_nothing():
    pool = _pool()
    p1, p2, d = pool.workers
    assert pool.full_stage() is None
    p1.mark_full()
    assert pool.full_stage() is None  # p2 has room
    p2.mark_full()
    assert pool.full_stage() == "prefill"
    p2.mark_free()  # a request of ours there ended
    assert pool.full_stage() is None
    p2.healthy = False  # a worker that is down is no room either
    assert pool.full_stage() == "prefill"
    p1.mark_free()
    d.mark_full(0.05)
    assert pool.full_stage() == "decode"
    time.sleep(0.06)  # a slot another client freed is looked for again after Retry-After
    assert pool.full_stage() is None
