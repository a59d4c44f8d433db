"""Which server a request goes to when the pool mixes xlserve workers and foreign servers.

1. The OpenAI layer has parsed, rendered and tokenized the request (once, here).
2. The routing policy picks the server that computes the prompt among every healthy one
   that can (prefix overlap from the router's index, in-flight tokens, session affinity).
3. An xlserve worker: the request takes the token path (``RemoteEngine``, pinned to it).
   A foreign server: its backend sends the client's body, the ``Relay`` rewrites the answer.
4. A server that fails before the first byte is marked down and the request goes to the
   next pick, of any kind; once every xlserve worker has failed it, only foreign ones remain.
"""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse

from xlserve.openai.app import until_disconnected
from xlserve.openai.event_stream import EventStreamResponse
from xlserve.openai.pricing import PriceTable
from xlserve.openai.protocol import ChatCompletionRequest, CompletionRequest
from xlserve.router.backend import ForeignCall
from xlserve.router.faults import NoWorker, WorkerFailed
from xlserve.router.pool import XLSERVE, Worker
from xlserve.router.relay import Relay
from xlserve.router.remote_engine import PINNED, RemoteEngine

log = logging.getLogger(__name__)
PATHS = {ChatCompletionRequest: "/v1/chat/completions", CompletionRequest: "/v1/completions"}


def prompt_ids_of(prepared) -> list[int]:
    """The first prompt of a prepared chat (``ChatPlan``) or completion (``RequestRun``)."""
    run = getattr(prepared, "run", prepared)
    return list(run.choices[0].prompt_ids)


class Dispatcher:
    def __init__(self, remote: RemoteEngine, prices: PriceTable, model_name: str, response_headers):
        self.remote, self.pool, self.prices = remote, remote.pool, prices
        self.model_name, self.response_headers = model_name, response_headers

    @property
    def mixed(self) -> bool:
        return any(w.kind is not XLSERVE for w in self.pool.workers)

    async def __call__(self, request: Request, body: bytes, req, prepared, local):
        """``local()``: the token path (xlserve workers), the only one for other endpoints."""
        path = PATHS.get(type(req))
        if path is None or not self.mixed:
            return await local()
        route = self.remote.route_for(prompt_ids_of(prepared))
        call = ForeignCall(path, json.loads(body), route.prompt_tokens, self.model_name)
        tried: set[str] = set()
        while True:
            worker = self.remote.pick("prefill", route, tried, kinds=None, observe=False)
            del route.served_by[:]  # the header names the servers of the attempt that answers
            if worker.kind is XLSERVE:
                PINNED.set(worker)
                try:
                    return await local()
                except NoWorker:  # every xlserve worker failed this request before its first byte
                    tried |= {w.url for w in self.pool.xlserve_workers}
                    continue
            self.remote.chosen("prefill", worker, route)
            try:
                return await self.foreign(request, call, worker, route)
            except NoWorker:  # the prefill went well; no decode server of its kind is left
                raise
            except WorkerFailed as e:
                self.pool.mark_down(worker, str(e))
                tried.add(worker.url)

    async def foreign(self, request: Request, call: ForeignCall, worker: Worker, route):
        backend = self.pool.backends[worker.kind]
        pair = worker.role == "prefill"  # a disaggregated server: its decode side is picked now
        decode = self.remote.pick("decode", route, set(), kinds=frozenset({worker.kind})) if pair else worker
        uncached = max(call.prompt_tokens - route.predicted_cached.get(worker.url, 0), 0)
        worker.prefill_tokens += uncached
        try:
            answer = await until_disconnected(request, backend.open(call, worker, decode, self._retry_decode(route)))
        finally:
            worker.prefill_tokens -= uncached
        route.served_by.extend(answer.served)  # the list the response header reads (SERVED_BY)
        decoder = answer.decode or decode
        decoder.decode_tokens += call.prompt_tokens

        def on_end(cached: int) -> None:
            decoder.decode_tokens -= call.prompt_tokens
            self.remote.index.record(route.block_hashes, worker.url)
            self.remote.observe_cached(route, worker, cached)
        relay = Relay(call, answer, self.prices, on_end)
        headers = self.response_headers()
        if call.stream:
            return EventStreamResponse(relay.events(), headers=headers)
        return JSONResponse(await relay.body(), headers=headers)

    def _retry_decode(self, route):
        """For a backend whose decode side failed after the prefill: mark it down, pick another."""
        failed_urls: set[str] = set()

        def retry(failed: Worker, why: str) -> Worker:
            self.pool.mark_down(failed, why)
            failed_urls.add(failed.url)
            return self.remote.pick("decode", route, failed_urls, kinds=frozenset({failed.kind}))
        return retry
