"""Internal worker endpoints for prefill/decode disaggregation (called by the router).

- ``POST /internal/generate``: token ids in, tokens out (streamed or not). With
  ``kv_export`` (prefill role) it computes the prompt, answers the first token and a KV
  handle, and pins the prompt's blocks for a bounded time; unless the answer ends there,
  its finish reason is ``paused`` (held-back text, such as a possible stop-string
  prefix, is not released). With ``kv_import`` (decode role) it first pulls those blocks
  through the transport into its own pool; if the pull fails it recomputes the prefill
  itself, or fails, as the policy says. ``resume_token_ids`` (the prefill's output)
  makes the decode side continue that answer exactly as one worker would.
- ``POST /internal/kv/release``: unpin exported blocks once the decode side has them.
- ``POST /internal/kv/peers``: the KV servers this worker may pull from (each router
  registers its prefill workers', replacing its own last set; ``--kv-peers`` adds fixed
  ones). A handle naming any other address is refused before a connection is made.
- ``GET /internal/kv/events?since=N&epoch=E``: block hashes stored/removed since N, or a
  snapshot when the reader cannot be caught up.
- ``GET /internal/info``: role, model, block size, KV transfer address, and how many
  requests it holds (running and waiting) before it answers 429.
- ``GET /internal/stats``: the engine's counters (running, waiting, KV blocks, prefix
  cache), which the router re-exports in its /metrics with a ``worker`` label.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from fastapi import FastAPI, Request, Response

from xlserve.engine.request import HandOff
from xlserve.openai.choices import ChoiceRun, RequestRun, start_choices
from xlserve.openai.engine_client import EngineBusy, RequestFailed
from xlserve.openai.errors import ApiError, error_body
from xlserve.openai.event_stream import EventStreamResponse
from xlserve.openai.openapi_doc import document_body
from xlserve.openai.serving_common import WorkerState, framed_sse, new_id, sse
from xlserve.sampling_params import SamplingParams
from xlserve.server_config import ServerConfig, parse_peers
from xlserve.transfer.base import TransferError, transport
from xlserve.worker.heartbeat import json_with_heartbeats, with_heartbeats
from xlserve.worker.messages import (
    GenerateRequest,
    GenerateResult,
    KVHandle,
    KVPeers,
    KVRelease,
    PullReport,
    StreamEvent,
)

log = logging.getLogger(__name__)
MAX_ROUTERS = 64  # routers whose KV peers a decode worker keeps apart


class Disaggregation:
    """The worker's side of the P -> D hand-off: a transfer server (prefill) or client (decode)."""

    def __init__(self, state: WorkerState, config: ServerConfig):
        self.state, self.config = state, config
        server_cls, client_cls = transport(config.kv_transport)
        self.client = client_cls()
        self.fixed_peers = parse_peers(config.kv_peers)
        self.peers_by_router: OrderedDict[str, frozenset[tuple[str, int]]] = OrderedDict()  # set by routers
        self.server = None
        self.address: dict | None = None
        if config.role in ("prefill", "both"):
            engine = state.async_engine

            def export(pin_id, secret, hashes):
                return engine.call_blocking(lambda e, *args: e.kv.export_pinned(*args), pin_id, secret, hashes)
            self.server = server_cls(export, config.kv_host, config.kv_port)
            self.address = self.server.start()

    @property
    def registered_peers(self) -> frozenset[tuple[str, int]]:
        return frozenset().union(*self.peers_by_router.values())

    def register_peers(self, router: str, peers: frozenset[tuple[str, int]]) -> None:
        """``router``'s prefill KV servers replace its last set; other routers' stay (the
        oldest registrant beyond ``MAX_ROUTERS`` is forgotten)."""
        self.peers_by_router.pop(router, None)
        self.peers_by_router[router] = peers
        while len(self.peers_by_router) > MAX_ROUTERS:
            self.peers_by_router.popitem(last=False)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def _check_handle(self, handle: KVHandle, prompt_hashes: list) -> None:
        """Refuse, before any connection, a handle to an unknown server or naming blocks
        that are not this prompt's (they would enter the prefix cache under its hashes)."""
        address = (handle.host, handle.port)
        try:
            named = [bytes.fromhex(h) for h in handle.block_hashes]
        except ValueError as e:
            raise TransferError(f"bad KV handle: {e}") from e
        if address not in self.fixed_peers | self.registered_peers:
            raise TransferError(f"{address[0]}:{address[1]} is not a registered KV server; refused")
        if named != prompt_hashes[:len(named)]:
            raise TransferError("the handle names blocks that are not this prompt's")

    async def pull(self, handle: KVHandle, policy: str, prompt_ids: list[int]) -> PullReport:
        start = time.monotonic()
        engine = self.state.engine
        try:
            self._check_handle(handle, await asyncio.to_thread(engine.prompt_block_hashes, prompt_ids))
            payload = await asyncio.to_thread(self.client.pull, handle.model_dump(), self.config.kv_pull_timeout,
                                              engine.kv.layout)
            blocks = await self.state.async_engine.call(lambda e, p: e.kv.import_blocks(p), payload)
            self.state.metrics.kv_pulls.labels(outcome="pulled").inc()
            return PullReport(blocks=blocks, bytes=len(payload.data), seconds=time.monotonic() - start)
        except (TransferError, ValueError) as e:
            self.state.metrics.kv_pulls.labels(outcome="failed" if policy == "fail" else "recomputed").inc()
            if policy == "fail":
                raise ApiError(502, f"KV pull failed and the policy is 'fail': {e}", code="kv_pull_failed") from e
            return PullReport(blocks=0, bytes=0, seconds=time.monotonic() - start, error=str(e))

    async def pin(self, prompt_ids: list[int]) -> KVHandle | None:
        if self.address is None:
            return None
        engine = self.state.async_engine

        def pin(e, ids):
            return e.kv.pin(e.prompt_block_hashes(ids), self.config.kv_pin_seconds)
        grant = await engine.call(pin, prompt_ids)
        return KVHandle(**self.address, pin_id=grant.pin_id, secret=grant.secret,
                        block_hashes=[h.hex() for h in grant.block_hashes])


def add_internal_routes(app: FastAPI, state: WorkerState, config: ServerConfig, api, read_json) -> Disaggregation:
    disagg = Disaggregation(state, config)
    for path, model in (("/internal/kv/peers", KVPeers), ("/internal/kv/release", KVRelease),
                        ("/internal/generate", GenerateRequest)):
        document_body(app, path, model)

    @app.get("/internal/info", dependencies=api)
    async def info():
        return {"role": config.role, "model": state.model_name, "block_size": state.engine.block_size,
                "max_model_len": state.max_model_len, "kv": disagg.address,
                "kv_extra_key": state.engine.extra_key.hex(), "model_path": state.engine.loaded.source.path,
                "max_requests": state.async_engine.max_pending}

    @app.get("/internal/stats", dependencies=api)
    async def stats():
        return state.async_engine.stats

    @app.get("/internal/kv/events", dependencies=api)
    async def kv_events(since: int = 0, epoch: str = ""):
        return await state.async_engine.call(lambda e, s, ep: e.kv_events(s, ep), since, epoch[:64])

    @app.post("/internal/kv/peers", dependencies=api)
    async def peers(request: Request):
        req = await read_json(request, KVPeers, config.max_body_bytes)
        peers = frozenset((p.host, p.port) for p in req.peers)
        disagg.register_peers(req.router, peers)
        return {"peers": len(peers)}

    @app.post("/internal/kv/release", dependencies=api)
    async def release(request: Request):
        req = await read_json(request, KVRelease, config.max_body_bytes)
        return {"released": await state.async_engine.call(lambda e, p: e.kv.unpin(p), req.pin_id)}

    def alive() -> bool:  # heartbeats only while the engine steps (worker/heartbeat.py)
        return state.async_engine.health_problem(config.hang_timeout) is None

    @app.post("/internal/generate", dependencies=api)
    async def generate(request: Request):
        req = await read_json(request, GenerateRequest, config.max_body_bytes)
        if req.kv_export and disagg.address is None:
            raise ApiError(400, f"this worker's role is {config.role!r}; kv_export needs prefill or both")
        if req.stream:
            pulled, run = await _start(req)
            if await request.is_disconnected():  # the router's client left while the KV was pulled
                log.info("request %s: its caller left during the KV pull; not started", run.request_id)
                return Response(status_code=204)
            events = await start_choices(state.async_engine, run, state.metrics)
            return EventStreamResponse(with_heartbeats(framed_sse(_stream(events, pulled), events, stream_error),
                                                       alive))
        return await json_with_heartbeats(_answer(req), alive, stream_error)

    async def _start(req: GenerateRequest) -> tuple[PullReport | None, RequestRun]:
        """The pulled KV (``kv_import``) and the run of an internal request."""
        params, handoff = _request_plan(req)
        pulled = None
        if req.kv_import is not None:
            pulled = await disagg.pull(req.kv_import, req.on_pull_failure or config.kv_pull_failure,
                                       list(req.prompt_token_ids))
        return pulled, RequestRun(req.request_id or new_id("int"),
                                  [ChoiceRun(0, list(req.prompt_token_ids), params, handoff=handoff)])

    async def _answer(req: GenerateRequest) -> dict:
        pulled, run = await _start(req)
        events = await start_choices(state.async_engine, run, state.metrics)
        try:
            async for _ in events:
                pass
        finally:
            await events.aclose()
        kv = await disagg.pin(list(req.prompt_token_ids)) if req.kv_export else None
        return _result(run.choices[0].final, pulled, kv).model_dump(mode="json")

    return disagg


def _request_plan(req: GenerateRequest) -> tuple[SamplingParams, HandOff]:
    """Sampling parameters (checked with the message) and the hand-off of an internal
    request; a bad hand-off is a 400."""
    params = req.sampling
    try:
        return params, HandOff(pause_after=1 if req.kv_export else None, resume=tuple(req.resume_token_ids))
    except ValueError as e:
        raise ApiError(400, str(e)) from e


def stream_error(e: Exception) -> dict:
    """The error event of an internal stream; its code tells the router whose fault it is:
    ``request_failed`` (this request only), 400 (the request's input), 429 (busy: retry
    later), an ``ApiError``'s own, else the worker's."""
    if isinstance(e, ApiError):
        return e.body()
    if isinstance(e, RequestFailed):
        return error_body(500, str(e), code="request_failed")
    if isinstance(e, EngineBusy):
        return error_body(429, str(e))
    if isinstance(e, ValueError):
        return error_body(400, str(e))
    return error_body(503, f"{type(e).__name__}: {e}", code="worker_failed")


def _result(out, pulled: PullReport | None, kv: KVHandle | None) -> GenerateResult:
    completion = out.outputs[0]
    return GenerateResult(request_id=out.request_id, token_ids=completion.token_ids, text=completion.text,
                          finish_reason=completion.finish_reason, prompt_tokens=len(out.prompt_token_ids),
                          cached_tokens=out.cached_tokens, kv_import=pulled, logprobs=completion.logprobs, kv=kv)


async def _stream(events, pulled):
    async for _, out in events:
        logprobs = out.outputs[0].logprobs
        fields = dict(token_ids=out.new_token_ids, text=out.new_text,
                      logprobs=logprobs[-len(out.new_token_ids):] if logprobs and out.new_token_ids else None)
        if out.finished:
            fields |= dict(finish_reason=out.outputs[0].finish_reason, prompt_tokens=len(out.prompt_token_ids),
                           cached_tokens=out.cached_tokens, kv_import=pulled)
        yield sse(StreamEvent(**fields).model_dump(mode="json"))
