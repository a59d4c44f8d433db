"""The router's admission on plain worker records, no model: a stage is full while every
worker of it refused and none freed a slot since; an admission gate hands a stage's
slots out first come first served, within its queue and its wait."""

import asyncio
import time

import pytest

from xlserve.openai.engine_client import EngineBusy
from xlserve.router.admission_gate import AdmissionGate
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


def test_the_decode_capacity_is_the_healthy_decode_workers_once_all_are_described():
    pool = WorkerPool(["http://127.0.0.1:9000"], ["http://127.0.0.1:9001", "http://127.0.0.1:9002"], [])
    _, d1, d2 = pool.workers
    d1.capacity = 4
    assert pool.decode_capacity() is None  # d2 not described yet: nothing is held back
    d2.capacity = 6
    assert pool.decode_capacity() == 10
    d2.healthy = False
    assert pool.decode_capacity() == 4
    pool.workers[0].capacity = 3
    assert pool.split_capacity() == 3 + 4  # in prefill and in decode
    d1.forget_process()  # it may come back with other limits
    d1.healthy = d2.healthy = True
    assert pool.decode_capacity() is None


class Stage:
    """A decode stage of ``capacity`` slots and a log of the order requests got theirs."""

    def __init__(self, capacity, queue=0, timeout=0.0):
        self.capacity = capacity
        self.gate = AdmissionGate(lambda: self.capacity, queue, timeout)
        self.order: list[int] = []
        self.release: dict[int, asyncio.Event] = {}

    async def request(self, i: int) -> str:
        self.release[i] = asyncio.Event()
        try:
            async with self.gate.slot():
                self.order.append(i)
                await self.release[i].wait()
        except EngineBusy:
            return "429"
        return "ok"


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_decode_slots_go_first_come_first_served_within_the_queue():
    async def run():
        stage = Stage(capacity=2)  # queue 0: as many waiting as there are slots
        tasks = [asyncio.create_task(stage.request(i)) for i in range(5)]
        await _settle()
        assert stage.order == [0, 1] and stage.gate.holding == 2 and stage.gate.waiting == 2
        assert stage.gate.full
        assert await tasks[4] == "429"  # the queue was full when it came
        stage.release[1].set()
        await _settle()
        assert stage.order == [0, 1, 2]  # the longest waiter, not a newcomer
        late = asyncio.create_task(stage.request(9))
        stage.release[0].set()
        await _settle()
        assert stage.order == [0, 1, 2, 3]
        for i in (2, 3, 9):
            await _settle()
            stage.release[i].set()
        assert [await t for t in (*tasks[:4], late)] == ["ok"] * 5
        assert stage.gate.holding == 0 and stage.gate.waiting == 0
    asyncio.run(run())


def test_a_waiter_that_leaves_or_times_out_loses_no_slot():
    async def run():
        stage = Stage(capacity=1, queue=3, timeout=0.2)
        first = asyncio.create_task(stage.request(0))
        gone, slow = asyncio.create_task(stage.request(1)), asyncio.create_task(stage.request(2))
        await _settle()
        gone.cancel()  # its client left while it waited
        await _settle()
        assert stage.gate.waiting == 1
        assert await slow == "429"  # waited its 0.2 s
        assert stage.gate.waiting == 0 and stage.gate.holding == 1
        granted = asyncio.create_task(stage.request(3))
        await _settle()
        stage.release[0].set()
        granted.cancel()  # left the moment its slot came: the slot is handed on, not lost
        await _settle()
        assert stage.gate.holding == 0 and stage.order == [0]
        assert await first == "ok"
        with pytest.raises(asyncio.CancelledError):
            await granted
    asyncio.run(run())


def test_a_stage_that_grows_or_becomes_unknown_lets_its_waiters_in():
    async def run():
        stage = Stage(capacity=1, queue=4)
        tasks = [asyncio.create_task(stage.request(i)) for i in range(4)]
        await _settle()
        assert stage.order == [0]
        stage.capacity = 2  # a decode worker came back
        stage.gate.wake()
        await _settle()
        assert stage.order == [0, 1]
        stage.capacity = None  # none described (all down): the worker or the router answers instead
        stage.gate.wake()
        await _settle()
        assert stage.order == [0, 1, 2, 3] and not stage.gate.full
        for i in range(4):
            stage.release[i].set()
        assert [await t for t in tasks] == ["ok"] * 4
        assert stage.gate.holding == 0
    asyncio.run(run())
