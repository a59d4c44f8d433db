"""Tasks nobody awaits: held until they finish, and their failures logged.

Why: the event loop keeps only weak references to its tasks (the asyncio docs say so at
``create_task``), so a task started and dropped may be collected before it ends. Here the
dropped ones hand back KV pins and close responses a client left: a release lost that way
holds its blocks on the prefill worker until the pin expires."""

from __future__ import annotations

import asyncio
import logging
from typing import Coroutine

log = logging.getLogger(__name__)
_HELD: set[asyncio.Future] = set()


def keep(task: asyncio.Future) -> asyncio.Future:
    """Hold ``task`` until it is done. Its owner reads the outcome (a done callback)."""
    _HELD.add(task)
    task.add_done_callback(_HELD.discard)
    return task


def spawn(work: Coroutine) -> asyncio.Task:
    """Run ``work`` on the running loop with nobody awaiting it; a failure is logged."""
    task = asyncio.get_running_loop().create_task(work)
    keep(task).add_done_callback(_log_failure)
    return task


def held() -> int:
    """How many tasks are held now (tests: back to none once everything settled)."""
    return len(_HELD)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and (error := task.exception()) is not None:
        log.warning("background task %s failed: %r", task.get_coro().__qualname__, error)
