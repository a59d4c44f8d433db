"""Holds disaggregated requests back so that no prompt is computed for a decode worker that
would refuse it.

Why: the decode worker is a PD pair's bottleneck (a prefill does one token of a request's
work, the decode worker the rest). Without a gate a request could pass its prefill and then
meet a full decode worker: its computed prompt thrown away with a 429. Under 10x the
admitted load half the prompts the prefill worker computed went that way
(docs/reliability.md).

The router uses two gates (``RemoteEngine``). Before its prefill a request takes one of
the stack's slots (what its prefill and decode workers hold together: each its running
plus waiting limit, from ``/internal/info``); one that finds none free waits in a queue,
first come first served, of at most ``queue`` requests (0: as many as the slots), for at
most ``timeout`` seconds (0: as long as it takes); beyond either, 429 with Retry-After.
Past its prefill it takes a decode slot, waiting for one without a bound of its own (the
first gate bounds how many can): a decode worker then never has more requests than it
holds, and the prefill worker keeps computing the next prompts while it decodes. (One gate
of the decode slots alone, taken before the prefill, left the decode worker short of work
while the next prompts were computed: 69 answers in 20 s against 79 without a gate.)

Invariants: ``holding`` counts the requests between ``slot()``'s entry and exit, each
once; a slot handed to a waiter that gave up meanwhile is handed on, never lost; while a
stage's size is unknown (a worker not yet described) or none of its workers is up, nothing
is held back (the worker's own 429, or the router's 503, answers instead).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import AsyncIterator, Callable

from xlserve.openai.engine_client import EngineBusy

UNBOUNDED = 1 << 30  # a queue another gate bounds


class AdmissionGate:
    def __init__(self, capacity: Callable[[], int | None], queue: int = 0, timeout: float = 0.0):
        self._capacity, self._queue, self.timeout = capacity, queue, timeout
        self.holding = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _room(self) -> bool:
        capacity = self._capacity()
        return capacity is None or self.holding < capacity

    def queue_limit(self) -> int:
        return self._queue or (self._capacity() or 0)

    @property
    def full(self) -> bool:
        """Every slot taken and the queue at its limit: a request now would be refused."""
        return not self._room() and self.waiting >= self.queue_limit()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self._enter()
        try:
            yield
        finally:
            self.holding -= 1
            self.wake()

    async def _enter(self) -> None:
        self.wake()  # the stage may have grown, or become unknown, since the last request ended
        if not self._waiters and self._room():
            self.holding += 1
            return
        if self.waiting >= self.queue_limit():
            raise EngineBusy(f"the workers are full and {self.waiting} requests wait for room")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.timeout or None):
                await asyncio.shield(waiter)
        except (TimeoutError, asyncio.CancelledError) as e:
            self._give_up(waiter)
            if isinstance(e, TimeoutError):
                raise EngineBusy(f"waited {self.timeout:g} s for room on the workers") from None
            raise

    def _give_up(self, waiter: asyncio.Future) -> None:
        if waiter.done():  # the slot came as the wait ended: hand it on
            self.holding -= 1
            self.wake()
        else:
            waiter.cancel()
            self._waiters.remove(waiter)

    def wake(self) -> None:
        """Hands free slots to the longest waiters (after a request ends, or the stage
        grew or became unknown)."""
        while self._waiters and self._room():
            self.holding += 1
            self._waiters.popleft().set_result(None)
