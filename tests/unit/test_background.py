"""A task nobody awaits lives until it ends (router/background.py)."""

import asyncio
import gc
import logging
import weakref

from xlserve.router import background


async def _wait_for_nothing(started: asyncio.Event) -> None:
    started.set()
    await asyncio.get_running_loop().create_future()  # held only by this frame: nothing wakes it


async def _dropped_task_survives_a_collection(start) -> bool:
    started = asyncio.Event()
    task = weakref.ref(start(_wait_for_nothing(started)))
    await started.wait()
    gc.collect()
    alive = task() is not None
    if alive:
        task().cancel()
        await asyncio.sleep(0)
    return alive


def test_a_spawned_task_is_held_until_it_ends_and_a_dropped_one_is_not():
    assert asyncio.run(_dropped_task_survives_a_collection(background.spawn))
    assert background.held() == 0  # cancelled, so let go
    # the hazard it guards against, in this Python: the loop alone does not keep a task alive
    assert not asyncio.run(_dropped_task_survives_a_collection(lambda work: asyncio.ensure_future(work)))


def test_a_failure_is_logged_and_the_task_let_go(caplog):
    async def fails():
        raise ValueError("pin gone")

    async def main():
        background.spawn(fails())
        await asyncio.sleep(0.01)

    with caplog.at_level(logging.WARNING, logger="xlserve.router.background"):
        asyncio.run(main())
    assert "fails" in caplog.text and "pin gone" in caplog.text
    assert background.held() == 0
