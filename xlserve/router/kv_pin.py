"""A prefill worker's pin on one request's KV, held by the router from the prefill's answer
until a decode worker has pulled it.

The pin is handed back once: when the decode worker's first event shows it pulled, when the
request ends, or, when the client left while a decode worker was being asked, once that
worker has answered. A decode worker pulls before it answers; a pin released sooner refuses
its pull, and under ``--kv-pull-failure recompute`` the decode worker computes the whole
prompt again for a client who is gone (8 of 12 clients that left at their first token cost
it that, before the pin waited).
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from xlserve.router import background
from xlserve.router.faults import describe
from xlserve.worker.messages import KVHandle

log = logging.getLogger(__name__)


class PinnedKV:
    def __init__(self, http: httpx.AsyncClient, worker_url: str, handle: KVHandle | None):
        self.http, self.worker_url, self.handle = http, worker_url, handle
        self._released = handle is None
        self._pulling: asyncio.Future | None = None  # a decode call left in flight by a client who went

    async def release(self) -> None:
        """Hands the pin back now, unless a decode call left in flight may still be pulling it."""
        if self._pulling is None or self._pulling.done():
            await self._release_now()

    def release_after(self, sending: asyncio.Future) -> None:
        """The client left while ``sending``, a decode call that imports this KV, was in flight:
        the pin goes once that call settled (its worker pulled, or failed)."""
        self._pulling = sending
        sending.add_done_callback(lambda _: background.spawn(self._release_now()))

    async def _release_now(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            await self.http.post(f"{self.worker_url}/internal/kv/release", json={"pin_id": self.handle.pin_id})
        except httpx.HTTPError as e:  # the pin expires on its own
            log.warning("releasing KV pin on %s failed: %s", self.worker_url, describe(e))
