"""The router's view of its workers: role, health, and in-flight load in tokens."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass, field

import httpx

from xlserve.router.backend import BackendKind, WorkerAddress, parse_worker_address
from xlserve.router.backend_probe import BackendInfo, model_card
from xlserve.router.connections import bounded_client, fetch
from xlserve.router.faults import WorkerFailed
from xlserve.router.foreign_backends import BACKENDS

log = logging.getLogger(__name__)
XLSERVE = BackendKind.XLSERVE
# How long a worker that answered 429 counts as full when none of our requests there ends
# first: the Retry-After a worker sends, so a slot freed by another client is found again.
FULL_FOR_S = 1.0


@dataclass
class Worker:
    url: str
    role: str  # "prefill", "decode" or "both"
    address: WorkerAddress | None = None  # its kind of server (xlserve when None) and options
    info: BackendInfo | None = None  # a foreign server's model id and cache size, once it answered
    healthy: bool = True
    prefill_tokens: int = 0  # uncached prompt tokens of requests in prefill here
    decode_tokens: int = 0  # context tokens of requests decoding here
    failures: int = 0
    last_check: float = field(default_factory=time.monotonic)
    kv_seq: int = 0  # KV events read so far, and the worker's epoch they belong to
    kv_epoch: str = ""
    described: bool = False  # /internal/info read since it last came up (xlserve workers)
    kv_server: tuple[str, int] | None = None  # its KV transfer server (prefill roles), from /internal/info
    capacity: int | None = None  # requests it holds, running and waiting, from /internal/info
    peers_sent: frozenset | None = None  # KV servers last registered with it (decode roles)
    engine_stats: dict = field(default_factory=dict)  # its engine's counters as of the last health check
    full_until: float = 0.0  # it answered 429: full until a request of ours there ends, or until then

    def mark_full(self, seconds: float = FULL_FOR_S) -> None:
        self.full_until = time.monotonic() + seconds

    def mark_free(self) -> None:
        self.full_until = 0.0

    @property
    def full(self) -> bool:
        return time.monotonic() < self.full_until

    def forget_process(self) -> None:
        """It may come back as a new process: with another KV port, without registrations,
        (a foreign server) with another model or cache size."""
        self.kv_server, self.peers_sent, self.info = None, None, None
        self.described, self.capacity = False, None

    @property
    def kind(self) -> BackendKind:
        return self.address.kind if self.address is not None else XLSERVE

    @property
    def load(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    def can(self, stage: str) -> bool:
        return self.healthy and self.role in (stage, "both")


def _workers(specs: list[str], role: str) -> list[Worker]:
    workers = []
    for spec in specs:
        address = parse_worker_address(spec)
        if address.kind is not XLSERVE and role not in BACKENDS[address.kind].roles:
            raise ValueError(f"{spec}: a {address.kind.value} server can be "
                             f"{' or '.join('--' + r for r in BACKENDS[address.kind].roles)}, not --{role}")
        workers.append(Worker(address.url, role, address))
    return workers


# Idle connections to workers are dropped before uvicorn drops them (after 5 s, httpx's own
# default): at equal timeouts a request can go out on a connection the server is closing.
CLIENT_LIMITS = httpx.Limits(keepalive_expiry=2.0)
# Foreign servers get a connection per request: llama-server closes connections after a
# streamed answer without saying so, and the next request on it failed with "Server
# disconnected without sending a response" (a healthy server marked down). A loopback or
# LAN connect costs well under a millisecond beside a generation.
FOREIGN_LIMITS = httpx.Limits(max_keepalive_connections=0)
FOREIGN_BLOCK_SIZE = 16  # the router's block for hashing prompts it sends to foreign servers
FOREIGN_DEFAULT_CONTEXT = 131072  # when a server names no context: it refuses longer prompts itself


def foreign_info(models: dict) -> dict:
    """The router's facts from a foreign server's /v1/models (a pool without xlserve workers)."""
    model, context = model_card(models)
    return {"model": model, "block_size": FOREIGN_BLOCK_SIZE, "max_model_len": context or FOREIGN_DEFAULT_CONTEXT,
            "kv_extra_key": ""}


class WorkerPool:
    def __init__(self, prefill: list[str], decode: list[str], both: list[str], api_key: str = "",
                 worker_timeout: float = 60.0, backend_api_key: str = ""):
        self.workers = _workers(prefill, "prefill") + _workers(decode, "decode") + _workers(both, "both")
        self.router_id = secrets.token_hex(8)  # registers this router's KV peers apart from other routers'
        if not self.workers:
            raise ValueError("the router needs at least one worker: --prefill/--decode URLs or --both URLs")
        for kind in dict.fromkeys(w.kind for w in self.workers):  # a request starts and ends on one kind
            roles = {w.role for w in self.workers if w.kind is kind}
            if not roles & {"prefill", "both"} or not roles & {"decode", "both"}:
                raise ValueError(f"the router needs a {kind.value} worker for each stage: prefill (or both) "
                                 "and decode (or both)")
        # A worker that sends nothing for worker_timeout (stopped, hung) fails the request over.
        timeout = httpx.Timeout(worker_timeout, connect=5)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = bounded_client(timeout, CLIENT_LIMITS, headers)
        # Foreign servers get their own key, never the internal one.
        self.backend_headers = {"Authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}
        self.foreign_http = bounded_client(timeout, FOREIGN_LIMITS)
        self.backends = {kind: cls(self.foreign_http, self.backend_headers) for kind, cls in BACKENDS.items()}

    @property
    def xlserve_workers(self) -> list[Worker]:
        return [w for w in self.workers if w.kind is XLSERVE]

    def candidates(self, stage: str, kinds: frozenset | None = frozenset({XLSERVE})) -> list[Worker]:
        """Healthy workers that can take ``stage``, of ``kinds`` (None: any kind)."""
        return [w for w in self.workers if w.can(stage) and (kinds is None or w.kind in kinds)]

    def full_stage(self) -> str | None:
        """A stage whose every healthy worker answered 429 and has not freed a slot since
        (None when any has room, or none is known): a request now would only be refused."""
        for stage in ("prefill", "decode"):
            workers = self.candidates(stage, None)
            if workers and all(w.full for w in workers):
                return stage
        return None

    def mark_down(self, worker: Worker, why: str) -> None:
        if worker.healthy:
            log.warning("worker %s marked down: %s", worker.url, why)
        worker.healthy = False
        worker.failures += 1
        worker.forget_process()

    async def check(self, worker: Worker) -> None:
        if worker.kind is not XLSERVE:
            ok = await self._check_foreign(worker)
        else:
            try:
                ok = (await self.http.get(f"{worker.url}/health", timeout=2)).status_code == 200
            except httpx.HTTPError:
                ok = False
        if ok and not worker.healthy:
            log.info("worker %s is back", worker.url)
        if not ok:
            worker.forget_process()
        worker.healthy, worker.last_check = ok, time.monotonic()

    async def _check_foreign(self, worker: Worker) -> bool:
        """Up, and described (model id, cache size) since it last came up."""
        backend = self.backends[worker.kind]
        if not await backend.healthy(worker.url):
            return False
        if worker.info is None:
            try:
                worker.info = await backend.describe(worker.url)
                log.info("%s server %s serves %r (cache %s tokens)", worker.kind.value, worker.url,
                         worker.info.model, worker.info.cache_tokens or "unknown")
            except WorkerFailed as e:
                log.warning("%s: %s", worker.url, e)
                return False
        return True

    def capacity(self, stage: str) -> int | None:
        """Requests the healthy xlserve workers of ``stage`` hold together; None while one of
        them is not yet described, or none is up (router/admission_gate.py)."""
        workers = self.candidates(stage)
        if not workers or any(w.capacity is None for w in workers):
            return None
        return sum(w.capacity for w in workers)

    def decode_capacity(self) -> int | None:
        return self.capacity("decode")

    def split_capacity(self) -> int | None:
        """Disaggregated requests the stack holds: in prefill, and in decode."""
        prefill, decode = self.capacity("prefill"), self.capacity("decode")
        return None if prefill is None or decode is None else prefill + decode

    async def describe(self, worker: Worker) -> None:
        """Its KV transfer server and capacity, once per process."""
        try:
            info = (await self.http.get(f"{worker.url}/internal/info", timeout=5)).json()
            kv = info.get("kv")
            worker.kv_server = (str(kv["host"]), int(kv["port"])) if kv and worker.role != "decode" else None
            worker.capacity = int(info["max_requests"]) if "max_requests" in info else None
            worker.described = True
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.debug("/internal/info of %s: %s", worker.url, e)

    async def sync_kv_peers(self) -> None:
        """Tell every decode worker which KV servers it may pull from: those of the prefill
        workers (a decode worker refuses a handle naming any other address)."""
        await asyncio.gather(*(self.describe(w) for w in self.xlserve_workers if w.healthy and not w.described))
        peers = frozenset(w.kv_server for w in self.workers if w.kv_server is not None)
        for w in self.xlserve_workers:
            if w.healthy and w.role in ("decode", "both") and w.peers_sent != peers:
                body = {"peers": [{"host": h, "port": p} for h, p in sorted(peers)], "router": self.router_id}
                try:
                    r = await self.http.post(f"{w.url}/internal/kv/peers", json=body, timeout=5)
                    if r.status_code == 200:
                        w.peers_sent = peers
                except httpx.HTTPError as e:
                    log.debug("registering KV peers with %s: %s", w.url, e)

    async def poll_events(self, worker: Worker, index) -> None:
        if not worker.healthy or worker.kind is not XLSERVE:  # foreign servers publish no KV events
            if worker.info is not None and worker.info.cache_tokens:
                index.set_capacity(worker.url, worker.info.cache_tokens)  # their blocks age out instead
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

    async def poll_stats(self, worker: Worker) -> None:
        """The worker's engine counters, for the router's /metrics (empty while it is down)."""
        if not worker.healthy or worker.kind is not XLSERVE:
            worker.engine_stats = {}
            return
        try:
            stats = (await self.http.get(f"{worker.url}/internal/stats", timeout=5)).json()
            worker.engine_stats = {k: float(v) for k, v in stats.items() if isinstance(v, (int, float))}
            if isinstance(stats.get("kv_tiers"), dict):
                worker.engine_stats["kv_tiers"] = stats["kv_tiers"]
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            log.debug("engine stats of %s: %s", worker.url, e)

    async def health_loop(self, interval: float, index=None, on_checked=lambda: None) -> None:
        """``on_checked()`` after each round: a stage may have grown or shrunk."""
        while True:
            await asyncio.gather(*(self.check(w) for w in self.workers))
            await asyncio.gather(*(self.poll_stats(w) for w in self.workers))
            await self.sync_kv_peers()
            on_checked()
            if index is not None:
                await asyncio.gather(*(self.poll_events(w, index) for w in self.workers))
            await asyncio.sleep(interval)

    def info(self, wait: float = 600.0) -> dict:
        """Facts the router needs from a worker (model, block size, context), waiting up to
        ``wait`` seconds for one to finish loading. Synchronous: it runs before the server's
        event loop, which ``self.http`` belongs to."""
        deadline, last, logged = time.monotonic() + wait, None, 0.0
        asked = self.xlserve_workers or self.workers  # a pool of foreign servers only: theirs
        while True:
            for w in asked:
                try:
                    status, body = fetch("GET", f"{w.url}{'/internal/info' if w.kind is XLSERVE else '/v1/models'}",
                                         headers=self.http.headers if w.kind is XLSERVE else self.backend_headers,
                                         timeout=5)
                    if status == 200:
                        return json.loads(body) if w.kind is XLSERVE else foreign_info(json.loads(body))
                    if status in (401, 403):  # waiting will not help
                        hint = "XLSERVE_INTERNAL_API_KEY or --internal-api-key-file as on the workers" \
                            if w.kind is XLSERVE else "XLSERVE_BACKEND_API_KEY as the server wants"
                        raise RuntimeError(f"{w.url} refuses the router's key ({status}); set {hint}")
                    last = f"{w.url} answered {status}"
                except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                    last = f"{w.url}: {type(e).__name__}"
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"no worker answered /internal/info within {wait:g} s ({last})")
            if now - logged > 10:
                log.info("waiting for a worker to finish loading (%s)", last)
                logged = now
            time.sleep(0.5)
