"""The router's engine: the same ``submit() -> stream of RequestOutput`` contract as the
worker's ``AsyncEngine``, served by remote workers. So the router reuses the worker's
whole OpenAI layer (chat templates, tools, n, usage, SSE) unchanged.

Per request: pick a prefill worker and a decode worker; the prefill worker computes the
prompt and answers the first token (emitted at once: TTFT is the prefill's) with a KV
handle; the decode worker pulls the blocks and streams the rest. ``cached_tokens`` is the
prefill's. A worker that fails before the first token is marked down and the request is
retried on another. The decode worker resumes the answer after the prefill's token
(``HandOff``), so seeds, penalties, grammars, stop strings and text carry over.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time

import httpx
from pydantic import ValidationError

from xlserve.engine.outputs import CompletionOutput, RequestOutput
from xlserve.engine.request import FinishReason
from xlserve.hashing import block_hashes
from xlserve.openai.engine_client import EngineBusy, EngineClient, RequestFailed, RequestStream
from xlserve.router import background
from xlserve.router.admission_gate import AdmissionGate
from xlserve.router.connections import sse_lines, streamed
from xlserve.router.faults import NoWorker, WorkerFailed, describe, error_of
from xlserve.router.index import PrefixIndex
from xlserve.router.kv_pin import PinnedKV
from xlserve.router.policies import RouteRequest, RoutingPolicy
from xlserve.router.pool import XLSERVE, Worker, WorkerPool
from xlserve.sampling_params import SamplingParams
from xlserve.worker.messages import GenerateResult, LogprobEntry, StreamEvent

log = logging.getLogger(__name__)
SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("session", default=None)
SERVED_BY: contextvars.ContextVar[list | None] = contextvars.ContextVar("served_by", default=None)
# The xlserve worker the dispatcher already chose for this request's prompt (router/dispatch.py).
PINNED: contextvars.ContextVar[Worker | None] = contextvars.ContextVar("pinned", default=None)


def worker_error(error: dict, status: int) -> Exception:
    """A worker's error (OpenAI shape) as the exception that puts the fault where it lies:
    the client's input (``ValueError``), this request alone (``RequestFailed``), or the worker."""
    message, code = str(error.get("message", "")), error.get("code")
    if status == 400 or code == 400:
        return ValueError(message)
    if status == 429 or code == 429:  # busy, not broken: the worker stays up
        return EngineBusy(message)
    if code == "request_failed":
        return RequestFailed(message)
    return WorkerFailed(f"status {status}: {message}")


def _reason(reason: FinishReason | None) -> str | None:
    return reason.value if reason is not None else None


def _logprobs(entries: list[LogprobEntry] | None) -> list[dict] | None:
    """As the engine keeps them (``token_id``, ``logprob``, ``top`` pairs)."""
    return [e.model_dump() for e in entries] if entries is not None else None


def refusal(worker: Worker, status: int, body: bytes) -> Exception:
    """A worker's error answer as an exception (``worker_error``); a 429 marks it full, so
    the router refuses at once, before any parsing, while every worker of a stage is."""
    error = worker_error(error_of(body), status)
    if isinstance(error, EngineBusy):
        worker.mark_full()
    return error


class _Accumulator:
    """Builds cumulative ``RequestOutput``s from token/text deltas."""

    def __init__(self, request_id: str, prompt_ids: list[int]):
        self.request_id, self.prompt_ids = request_id, prompt_ids
        self.ids: list[int] = []
        self.text, self.logprobs, self.cached = "", [], 0

    def add(self, ids, text, logprobs, finish) -> RequestOutput:
        self.ids += ids
        self.text += text
        self.logprobs += logprobs or []
        completion = CompletionOutput(0, self.text, list(self.ids), finish, list(self.logprobs))
        return RequestOutput(self.request_id, self.prompt_ids, [completion], finish is not None, self.cached,
                             text, list(ids))


class RemoteStream(RequestStream):
    """The worker-side ``RequestStream`` contract over an async generator: ``accepted()``
    waits for the first output (a worker's refusal raises there, before the router sends a
    byte); ``close()`` from synchronous code ends it (releasing pins, closing the decode
    stream, which aborts the request on the worker)."""

    def __init__(self, gen):
        self.gen = gen
        self.closed = False
        self.first: RequestOutput | None = None

    def __aiter__(self):
        return self

    async def accepted(self) -> None:
        if self.first is None:
            self.first = await self.gen.__anext__()

    async def __anext__(self) -> RequestOutput:
        if self.first is not None:
            first, self.first = self.first, None
            return first
        return await self.gen.__anext__()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                background.spawn(self.gen.aclose())
            except RuntimeError:  # no loop (interpreter exit): nothing left to release
                pass

    async def aclose(self) -> None:
        self.closed = True
        await self.gen.aclose()


class RemoteEngine(EngineClient):
    def __init__(self, pool: WorkerPool, policy: RoutingPolicy, index: PrefixIndex, info: dict,
                 gates: tuple[AdmissionGate, AdmissionGate], metrics=None, max_inflight: int = 1024):
        self.pool, self.policy, self.index, self.metrics = pool, policy, index, metrics
        # Room in the stack before a prefill, then room on a decode worker (router/admission_gate.py).
        self.gate, self.decode_slots = gates
        self.block_size, self.max_model_len = int(info["block_size"]), int(info["max_model_len"])
        self.extra_key = bytes.fromhex(info.get("kv_extra_key", ""))
        self.max_inflight, self.inflight = max_inflight, 0
        self.stats = {}

    def health_problem(self, hang_timeout: float = 0.0) -> str | None:
        return None  # the router process is alive; its workers' state is readiness

    def readiness_problem(self) -> str | None:
        """A stage with no healthy worker, or None."""
        missing = [stage for stage in ("prefill", "decode") if not self.pool.candidates(stage, None)]
        return f"no healthy {' or '.join(missing)} worker" if missing else None

    def placement(self) -> dict[str, str]:
        return {"session": SESSION.get() or "-", "workers": ",".join(dict.fromkeys(SERVED_BY.get() or [])) or "-"}

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               handoff: None = None) -> RemoteStream:
        if handoff is not None:
            raise ValueError("the router splits answers itself; it takes no hand-off")
        if self.inflight >= self.max_inflight:
            raise EngineBusy(f"{self.inflight} requests in flight (limit {self.max_inflight})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context is {self.max_model_len}")
        # Route now, before any byte of the answer, so the response headers can name the workers.
        route = self.route_for(prompt_ids)
        pinned = PINNED.get()
        prefill = self.chosen("prefill", pinned, route) if pinned is not None and pinned.healthy \
            else self.pick("prefill", route, set())
        single = prefill.role == "both"
        decode = prefill if single else self.pick("decode", route, set())
        route.served_by.append(f"{'worker' if single else 'prefill'}={prefill.url}")
        if not single:
            route.served_by.append(f"decode={decode.url}")
        return RemoteStream(self._run(request_id, list(prompt_ids), params, route, prefill, decode))

    def wake(self) -> None:
        """The stages may have grown or shrunk (a health round): let waiters in."""
        self.gate.wake()
        self.decode_slots.wake()

    def route_for(self, prompt_ids) -> RouteRequest:
        served = SERVED_BY.get()
        return RouteRequest(block_hashes(list(prompt_ids), self.block_size, self.extra_key), len(prompt_ids),
                            SESSION.get(), served_by=served if served is not None else [])

    def pick(self, stage: str, route: RouteRequest, exclude: set[str], kinds=frozenset({XLSERVE}),
              observe: bool = True) -> Worker:
        """The policy's choice among healthy workers of ``stage`` and ``kinds`` (None: any kind)."""
        candidates = [w for w in self.pool.candidates(stage, kinds) if w.url not in exclude]
        if not candidates:
            raise NoWorker(f"no healthy {stage} worker")
        urls = [w.url for w in candidates]
        worker = self.policy.pick(candidates, route, self.index.cache_scores(route.block_hashes, urls))
        return self.chosen(stage, worker, route) if observe else worker

    def chosen(self, stage: str, worker: Worker, route: RouteRequest) -> Worker:
        route.predicted_cached[worker.url] = self.index.cached_blocks(route.block_hashes, [worker.url])[worker.url] \
            * self.block_size
        if self.metrics is not None:
            self.metrics.observe_route(stage, worker.url)
        return worker

    def observe_cached(self, route: RouteRequest, worker: Worker, actual: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_cache(route.predicted_cached.get(worker.url, 0), actual)

    async def _run(self, request_id, prompt_ids, params, route, prefill, decode):
        self.inflight += 1
        try:
            acc = _Accumulator(request_id, prompt_ids)
            async for out in self._pd(request_id, prompt_ids, params, route, acc, prefill, decode):
                yield out
        finally:
            self.inflight -= 1

    async def _retrying(self, stage: str, route: RouteRequest, stream_on, first: Worker):
        """Stream from ``first``, a worker of ``stage``; one that fails before its first output is
        marked down and the request moves to another (a failure after that reaches the client)."""
        tried: set[str] = set()
        worker = first
        while True:
            if tried:
                failed, worker = worker, self.pick(stage, route, tried)
                self._moved(route, failed, worker)
            started = False
            try:
                async for out in stream_on(worker):
                    started = True
                    yield out
                self.index.record(route.block_hashes, worker.url)  # it holds the prompt's blocks now
                return
            except WorkerFailed as e:
                if started:
                    raise
                self.pool.mark_down(worker, str(e))
                tried.add(worker.url)

    async def _pd(self, request_id, prompt_ids, params, route, acc, prefill, decode):
        if decode is prefill:  # the whole request on one worker
            async for out in self._retrying("prefill", route, lambda w: self._stream(
                    w, prompt_ids, params, None, acc, request_id, route=route), prefill):
                yield out
            return
        async with self.gate.slot():  # room in the stack before the prefill's work (router/admission_gate.py)
            async for out in self._split(request_id, prompt_ids, params, route, acc, prefill, decode):
                yield out

    async def _split(self, request_id, prompt_ids, params, route, acc, prefill, decode):
        """The prefill on one worker, its KV pulled by the decode worker, which answers the rest."""
        tried: set[str] = set()
        while True:  # retry the prefill on another worker if one fails before the first token
            if tried:
                failed, prefill = prefill, self.pick("prefill", route, tried)
                self._moved(route, failed, prefill)
            try:
                first = await self._prefill(prefill, prompt_ids, params, request_id)
                break
            except WorkerFailed as e:
                self.pool.mark_down(prefill, str(e))
                tried.add(prefill.url)
        self.index.record(route.block_hashes, prefill.url)
        acc.cached = first.cached_tokens
        self.observe_cached(route, prefill, acc.cached)
        paused = first.finish_reason == FinishReason.PAUSED  # else the answer ended with its first token
        pin = PinnedKV(self.pool.http, prefill.url, first.kv)
        try:  # however the answer ends (a client that leaves at the first token too), the pin goes
            yield acc.add(first.token_ids, first.text, _logprobs(first.logprobs),
                          None if paused else _reason(first.finish_reason))
            if not paused:
                return
            async with self.decode_slots.slot():
                async for out in self._retrying("decode", route, lambda w: self._stream(
                        w, prompt_ids, params, pin, acc, request_id, resume=first.token_ids), decode):
                    yield out
        except EngineBusy:  # a full decode worker: the prompt was computed for nothing
            if self.metrics is not None:
                self.metrics.prefills_wasted.inc()
            raise
        finally:
            await pin.release()

    async def _prefill(self, worker: Worker, ids, params, request_id) -> GenerateResult:
        """The prefill's answer. A client that leaves meanwhile does not cancel the call:
        the worker pins the blocks anyway, so the router waits for the handle and releases it
        (else the pin would hold those blocks until it expires)."""
        call = asyncio.ensure_future(self._prefill_call(worker, ids, params, request_id))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            background.keep(call).add_done_callback(lambda done: self._release_orphan(worker, done))
            raise

    def _release_orphan(self, worker: Worker, call: asyncio.Future) -> None:
        if not call.cancelled() and call.exception() is None:
            background.spawn(PinnedKV(self.pool.http, worker.url, call.result().kv).release())

    async def _prefill_call(self, worker: Worker, ids, params, request_id) -> GenerateResult:
        body = {"request_id": f"{request_id}-p", "prompt_token_ids": ids, "sampling": params.to_wire(),
                "kv_export": True}
        worker.prefill_tokens += len(ids)
        try:
            r = await self.pool.http.post(f"{worker.url}/internal/generate", json=body)
        except httpx.HTTPError as e:
            raise WorkerFailed(f"prefill request failed: {type(e).__name__} {e}") from e
        finally:
            worker.prefill_tokens -= len(ids)
        # a slow answer came as a 200 with heartbeats before its outcome (worker/heartbeat.py)
        if r.status_code != 200 or r.content.lstrip().startswith(b'{"error"'):
            raise refusal(worker, r.status_code, r.content)
        worker.mark_free()  # its request ended: a slot is free again
        try:
            return GenerateResult.model_validate_json(r.content)
        except ValidationError as e:
            raise WorkerFailed(f"malformed prefill answer: {e.errors()[0]['msg']}") from e

    @staticmethod
    def _moved(route: RouteRequest, failed: Worker, worker: Worker) -> None:
        """A retry moved a stage: the header of a response not yet sent names the new worker."""
        route.served_by[:] = [s.replace(f"={failed.url}", f"={worker.url}") if s.endswith(f"={failed.url}") else s
                              for s in route.served_by]

    async def _stream(self, worker, ids, params, pin: PinnedKV | None, acc, request_id, resume=(), route=None):
        """``pin``: the prefill's KV this worker pulls, handed back once it has."""
        handle = pin.handle if pin is not None else None
        body = {"request_id": f"{request_id}-d", "prompt_token_ids": ids, "sampling": params.to_wire(),
                "stream": True, "kv_import": handle.model_dump() if handle is not None else None,
                "resume_token_ids": list(resume)}
        worker.decode_tokens += len(ids)
        started, admitted = time.monotonic(), False
        try:
            async with streamed(self.pool.http, "POST", f"{worker.url}/internal/generate", json=body,
                                on_abandoned=pin.release_after if pin is not None else None) as r:
                if r.status_code != 200:
                    raise refusal(worker, r.status_code, await r.aread())
                admitted = True
                first_event = True
                async for line in sse_lines(r):
                    if not line.startswith("data: {"):
                        continue
                    try:
                        raw = json.loads(line[6:])
                    except ValueError as e:
                        raise WorkerFailed(f"malformed stream event: {line[:80]!r}") from e
                    if "error" in raw:
                        raise worker_error(raw["error"], r.status_code)
                    try:
                        event = StreamEvent.model_validate(raw)
                    except ValidationError as e:
                        raise WorkerFailed(f"malformed stream event: {e.errors()[0]['msg']}") from e
                    if first_event and pin is not None:  # it pulled
                        background.spawn(pin.release())
                    first_event = False
                    if event.finish_reason and route is not None:  # this worker computed the prompt
                        acc.cached = event.cached_tokens or 0
                        self.observe_cached(route, worker, acc.cached)
                    if event.kv_import and self.metrics is not None:
                        self.metrics.observe_transfer(event.kv_import.model_dump())
                    yield acc.add(event.token_ids, event.text, _logprobs(event.logprobs), _reason(event.finish_reason))
                    if event.finish_reason:
                        return
            raise WorkerFailed("decode stream ended without a finish")
        except httpx.HTTPError as e:
            self.pool.mark_down(worker, describe(e))
            raise WorkerFailed(f"decode worker {worker.url} failed after {time.monotonic() - started:.1f}s: "
                               f"{describe(e)}") from e
        finally:
            worker.decode_tokens -= len(ids)
            if admitted:
                worker.mark_free()
