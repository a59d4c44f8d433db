"""The router's view of its workers: role, health, and in-flight load in tokens."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

log = logging.getLogger(__name__)


@dataclass
class Worker:
    url: str
    role: str  # "prefill", "decode" or "both"
    healthy: bool = True
    prefill_tokens: int = 0  # uncached prompt tokens of requests in prefill here
    decode_tokens: int = 0  # context tokens of requests decoding here
    failures: int = 0
    last_check: float = field(default_factory=time.monotonic)
    kv_seq: int = 0  # KV events read so far, and the worker's epoch they belong to
    kv_epoch: str = ""

    @property
    def load(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    def can(self, stage: str) -> bool:
        return self.healthy and self.role in (stage, "both")


class WorkerPool:
    def __init__(self, prefill: list[str], decode: list[str], both: list[str], api_key: str = "",
                 worker_timeout: float = 60.0):
        self.workers = ([Worker(u.rstrip("/"), "prefill") for u in prefill] + [Worker(u.rstrip("/"), "decode") for u in decode]
                        + [Worker(u.rstrip("/"), "both") for u in both])
        if not self.workers:
            raise ValueError("the router needs at least one worker: --prefill/--decode URLs or --both URLs")
        if not any(w.role in ("prefill", "both") for w in self.workers) or \
                not any(w.role in ("decode", "both") for w in self.workers):
            raise ValueError("the router needs a worker for each stage: prefill (or both) and decode (or both)")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # A worker that sends nothing for worker_timeout (stopped, hung) fails the request over.
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(worker_timeout, connect=5), headers=headers)

    def candidates(self, stage: str) -> list[Worker]:
        return [w for w in self.workers if w.can(stage)]

    def mark_down(self, worker: Worker, why: str) -> None:
        if worker.healthy:
            log.warning("worker %s marked down: %s", worker.url, why)
        worker.healthy = False
        worker.failures += 1

    async def check(self, worker: Worker) -> None:
        try:
            ok = (await self.http.get(f"{worker.url}/health", timeout=2)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok and not worker.healthy:
            log.info("worker %s is back", worker.url)
        worker.healthy, worker.last_check = ok, time.monotonic()

    async def poll_events(self, worker: Worker, index) -> None:
        if not worker.healthy:
            return
        try:
            r = await self.http.get(f"{worker.url}/internal/kv/events",
                                    params={"since": worker.kv_seq, "epoch": worker.kv_epoch}, timeout=5)
            feed = r.json()
        except (httpx.HTTPError, ValueError) as e:
            log.debug("KV events from %s: %s", worker.url, e)
            return
        index.apply_events(worker.url, feed)
        worker.kv_seq, worker.kv_epoch = int(feed["seq"]), str(feed["epoch"])

    async def health_loop(self, interval: float, index=None) -> None:
        while True:
            await asyncio.gather(*(self.check(w) for w in self.workers))
            if index is not None:
                await asyncio.gather(*(self.poll_events(w, index) for w in self.workers))
            await asyncio.sleep(interval)

    def info(self) -> dict:
        """Facts the router needs from a worker (model, block size, context). Synchronous:
        it runs before the server's event loop, which ``self.http`` belongs to."""
        last = None
        for w in self.workers:
            try:
                return httpx.get(f"{w.url}/internal/info", headers=self.http.headers, timeout=5).json()
            except httpx.HTTPError as e:
                last = e
        raise RuntimeError(f"no worker answered /internal/info: {last}")
