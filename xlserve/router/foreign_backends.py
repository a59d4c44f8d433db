"""The foreign servers' protocols: a plain OpenAI-compatible server, vLLM's disaggregated
prefill/decode (``kv_transfer_params``) and SGLang's (a bootstrap host, port and room).

The protocols, as those projects document them in their own proxies:
- vLLM (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` and the KV connectors'
  ``request_finished``): the prefill gets the request with ``max_tokens`` 1, no stream, and
  ``kv_transfer_params`` asking for a remote decode; its answer's ``kv_transfer_params``
  (engine id, block ids, host, port) go unchanged into the decode request.
- SGLang (``python/sglang/srt/disaggregation/mini_lb.py``): both sides get the same request
  at once with the prefill's ``bootstrap_host``, ``bootstrap_port`` and a ``bootstrap_room``;
  the decode's answer is the client's. The room is the pair's only shared secret, so it is
  drawn from ``secrets`` (63 bits, as SGLang takes), never counted up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from urllib.parse import urlsplit

import httpx

from xlserve.openai.errors import ApiError
from xlserve.router.backend import (
    Answer,
    Backend,
    BackendKind,
    ForeignCall,
    cached_tokens_of,
    raise_for_answer,
    sse_events,
)
from xlserve.router.backend_probe import BackendInfo
from xlserve.router.connections import EVENT_STREAM, open_response
from xlserve.router.faults import WorkerFailed

log = logging.getLogger(__name__)
SGLANG_BOOTSTRAP_PORT = 8998  # SGLang's default --disaggregation-bootstrap-port
# Fields that steer a server's KV hand-off: only the router sets them. From a client they
# would make a decode server pull blocks from a host of the client's choosing, or join
# another request's bootstrap room.
HAND_OFF_FIELDS = frozenset({"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"})


def for_server(call: ForeignCall, worker, **changes) -> dict:
    """The client's body as ``worker`` wants it: its model id, no hand-off fields but the
    router's, and usage in the stream (the router prices every request)."""
    body = {k: v for k, v in call.body.items() if k not in HAND_OFF_FIELDS}
    body.update(model=worker.info.model if worker.info else call.body.get("model"), **changes)
    if body.get("stream"):
        body["stream_options"] = {**(call.body.get("stream_options") or {}), "include_usage": True}
    return body


class OpenAIBackend(Backend):
    kind = BackendKind.OPENAI
    roles = ("both",)

    async def post(self, url: str, path: str, body: dict) -> Answer:
        """Send; return when the JSON answer, or the stream's first event, is in."""
        request = self.http.build_request("POST", f"{url}{path}", json=body, headers=self.headers,
                                          extensions={EVENT_STREAM: True} if body.get("stream") else {})
        try:
            response = await open_response(self.http, request)
        except httpx.HTTPError as e:
            raise WorkerFailed(f"{url}: {type(e).__name__} {e}") from e
        try:
            if response.status_code != 200:
                raise_for_answer(response.status_code, await response.aread(), url)
            if not body.get("stream"):
                data = json.loads(await response.aread())
                await response.aclose()
                if not isinstance(data, dict):
                    raise WorkerFailed(f"{url} answered JSON that is not an object")
                return Answer(json=data)
            events = sse_events(response)
            first = await events.__anext__()
            return Answer(first=first, rest=events, closers=[events.aclose, response.aclose])
        except StopAsyncIteration:
            await response.aclose()
            raise WorkerFailed(f"{url} ended its stream before the first event") from None
        except (WorkerFailed, ApiError):
            await response.aclose()
            raise
        except (httpx.HTTPError, ValueError) as e:
            await response.aclose()
            raise WorkerFailed(f"{url}: {type(e).__name__} {e}") from e

    async def open(self, call, worker, decode, retry_decode) -> Answer:
        answer = await self.post(worker.url, call.path, for_server(call, worker))
        answer.served.append(f"worker={worker.url}")
        return answer


class VllmPDBackend(OpenAIBackend):
    kind = BackendKind.VLLM_PD
    roles = ("prefill", "decode")
    ASK_REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                         "remote_block_ids": None, "remote_host": None, "remote_port": None}

    async def open(self, call, worker, decode, retry_decode) -> Answer:
        body = for_server(call, worker, stream=False, max_tokens=1, kv_transfer_params=dict(self.ASK_REMOTE_DECODE))
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        for unsupported_on_prefill in ("stream_options", "min_tokens", "min_completion_tokens"):
            body.pop(unsupported_on_prefill, None)
        prefill = (await self.post(worker.url, call.path, body)).json
        params = prefill.get("kv_transfer_params")
        if not isinstance(params, dict):  # no connector on the prefill side: the decode computes the prompt
            log.warning("vllm-pd prefill %s answered without kv_transfer_params (started without a KV "
                        "connector as producer?); the decode server computes the prompt itself", worker.url)
        cached = cached_tokens_of(prefill)
        while True:
            extra = {"kv_transfer_params": params} if isinstance(params, dict) else {}
            try:
                answer = await self.post(decode.url, call.path, for_server(call, decode, **extra))
                break
            except WorkerFailed as e:  # the prefill keeps the blocks until its timeout: another decode can pull
                decode = retry_decode(decode, str(e))
        # The decode server counts the blocks it pulled as cached: the client's figure is the prefill's.
        answer.cached_tokens = cached if cached is not None else 0
        answer.served += [f"prefill={worker.url}", f"decode={decode.url}"]
        answer.decode = decode
        return answer


class SglangPDBackend(OpenAIBackend):
    kind = BackendKind.SGLANG_PD
    roles = ("prefill", "decode")

    async def describe(self, url: str) -> BackendInfo:
        info = await super().describe(url)
        try:
            r = await self.http.get(f"{url}/get_server_info", headers=self.headers, timeout=5)
            port = r.json().get("disaggregation_bootstrap_port") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            port = None
        return BackendInfo(info.model, info.max_model_len, info.cache_tokens,
                           int(port) if isinstance(port, int) else None)

    def bootstrap(self, worker) -> dict:
        port = worker.address.option("bootstrap_port") or (worker.info and worker.info.bootstrap_port) \
            or SGLANG_BOOTSTRAP_PORT
        return {"bootstrap_host": urlsplit(worker.url).hostname, "bootstrap_port": int(port),
                "bootstrap_room": secrets.randbits(63)}

    async def open(self, call, worker, decode, retry_decode) -> Answer:
        while True:  # a decode that fails takes its room with it: the pair starts again in a new one
            pair = self.bootstrap(worker)
            prefill = asyncio.ensure_future(self.post(worker.url, call.path, for_server(call, worker, **pair)))
            try:
                answer = await self.post(decode.url, call.path, for_server(call, decode, **pair))
                break
            except WorkerFailed as e:
                await _abandon(prefill)
                decode = retry_decode(decode, str(e))
            except BaseException:
                await _abandon(prefill)
                raise
        answer.prefill = asyncio.ensure_future(self._drain(prefill))
        answer.closers.append(lambda: _cancel(answer.prefill))
        answer.served += [f"prefill={worker.url}", f"decode={decode.url}"]
        answer.decode = decode
        return answer

    @staticmethod
    async def _drain(prefill: asyncio.Future) -> int | None:
        """Read the prefill's own answer to its end; its cached tokens are the client's."""
        try:
            answer = await prefill
        except (WorkerFailed, ApiError) as e:
            log.warning("sglang-pd prefill failed after its decode started: %s", e)
            return None
        try:
            if answer.json is not None:
                return cached_tokens_of(answer.json)
            cached = cached_tokens_of(answer.first)
            async for event in answer.rest:
                cached = cached_tokens_of(event) if cached_tokens_of(event) is not None else cached
            return cached
        except (WorkerFailed, httpx.HTTPError) as e:
            log.warning("sglang-pd prefill stream broke: %s", e)
            return None
        finally:
            await answer.close()


async def _cancel(task: asyncio.Future | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _abandon(prefill: asyncio.Future) -> None:
    """Stop a prefill whose decode failed: cancel the call, or close the answer it opened."""
    await _cancel(prefill)
    if not prefill.cancelled() and prefill.exception() is None:
        await prefill.result().close()


BACKENDS: dict[BackendKind, type[Backend]] = {b.kind: b for b in (OpenAIBackend, VllmPDBackend, SglangPDBackend)}
