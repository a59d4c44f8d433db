"""The kinds of inference server the router fronts, chosen per worker URL by a scheme
prefix: ``openai+http://HOST:PORT``, ``vllm-pd+http://...``, ``sglang-pd+http://...``; a bare
URL is an xlserve worker.

An xlserve worker takes token ids and hands KV over our own transport (``RemoteEngine``).
A foreign server takes the client's OpenAI request itself: the router still tokenizes it
(for routing and accounting), picks the server, and rewrites the answer (its model name,
``cached_tokens``, the price) as it relays it (``router/relay.py``).

Invariants of a ``Backend``: a fault of the server (unreachable, 5xx, a stream that breaks
before its first event) raises ``WorkerFailed`` before any byte reaches the client, so the
request can be retried elsewhere; the client's own mistakes (the server's 4xx) come back as
``ApiError`` with the server's message; an ``Answer``'s ``cached_tokens`` is the prompt
tokens the server that computed the prompt served from its cache (for a disaggregated pair:
the prefill's, never the decode's count of what it received).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import AsyncIterator, ClassVar
from urllib.parse import parse_qsl, urlsplit

import httpx

from xlserve.openai.errors import ApiError
from xlserve.router.backend_probe import BackendInfo, probe_backend
from xlserve.router.connections import sse_lines
from xlserve.router.faults import WorkerFailed, error_of

log = logging.getLogger(__name__)


class BackendKind(str, enum.Enum):
    XLSERVE = "xlserve"
    OPENAI = "openai"
    VLLM_PD = "vllm-pd"
    SGLANG_PD = "sglang-pd"


@dataclass(frozen=True)
class WorkerAddress:
    kind: BackendKind
    url: str  # http(s)://host:port, without the scheme prefix, options or trailing slash
    options: tuple[tuple[str, str], ...] = ()  # ?key=value after the URL (sglang-pd: bootstrap_port)

    def option(self, key: str, default: str | None = None) -> str | None:
        return dict(self.options).get(key, default)


def parse_worker_address(spec: str) -> WorkerAddress:
    """``[KIND+]http(s)://HOST:PORT[?key=value...]`` -> its parts; ``ValueError`` names the kinds."""
    kind, _, rest = spec.rpartition("+") if "+" in spec.split("://", 1)[0] else ("", "", spec)
    try:
        backend = BackendKind(kind or BackendKind.XLSERVE.value)
    except ValueError:
        raise ValueError(f"unknown backend {kind!r} in {spec!r}; use one of "
                         f"{', '.join(k.value for k in BackendKind)} (a bare URL is an xlserve worker)") from None
    parts = urlsplit(rest)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker URL {spec!r} must be [KIND+]http(s)://HOST:PORT")
    url = f"{parts.scheme}://{parts.netloc}{parts.path}".rstrip("/")
    return WorkerAddress(backend, url, tuple(parse_qsl(parts.query)))


@dataclass
class ForeignCall:
    """One client request on its way to a foreign server."""
    path: str  # "/v1/chat/completions" or "/v1/completions"
    body: dict  # the client's JSON, as sent
    prompt_tokens: int  # as the router counted them
    model_name: str  # the router's name for the model: what the client sees in "model"

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def client_wants_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))


@dataclass
class Answer:
    """A server's answer, opened: a JSON body, or a stream whose first event has arrived."""
    json: dict | None = None
    first: dict | None = None
    rest: AsyncIterator[dict] | None = None
    cached_tokens: int | None = None  # known before the answer (a disaggregated prefill's), else read from it
    prefill: asyncio.Future | None = None  # or known when this prefill, run beside the answer, ends
    served: list[str] = field(default_factory=list)  # "stage=url" for x-xlserve-served-by
    decode: object = None  # the Worker streaming the answer, where a retry moved it
    closers: list = field(default_factory=list)  # awaitables' factories run when the answer ends

    async def close(self) -> None:
        for closer in self.closers:
            try:
                await closer()
            except Exception as e:  # noqa: BLE001 - closing must not fail the relay
                log.debug("closing an upstream answer: %s", e)


def cached_tokens_of(body: dict) -> int | None:
    """What a server reports served from its cache: OpenAI's ``usage.prompt_tokens_details``,
    or llama-server's ``timings.cache_n``."""
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    if isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    timings = body.get("timings") or {}
    return timings["cache_n"] if isinstance(timings.get("cache_n"), int) else None


async def sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON events of an OpenAI-style event stream, until ``[DONE]`` or its end; an
    ``error`` event raises (a server fault: ``WorkerFailed``)."""
    async for line in sse_lines(response):
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError as e:
            raise WorkerFailed(f"malformed event from {response.url}: {data[:80]!r}") from e
        if isinstance(event, dict) and "error" in event:
            raise WorkerFailed(f"{response.url} ended its stream with an error: {event['error']}")
        if isinstance(event, dict):
            yield event


def raise_for_answer(status: int, body: bytes, url: str) -> None:
    """A 4xx is the client's (passed on in the OpenAI shape, with the server's message); a
    5xx or anything else that is not 200 is the server's."""
    if status == 200:
        return
    error = error_of(body)
    message = error.get("message", str(error))
    if status in (401, 403):  # the router's key for it is wrong: the client can do nothing about that
        raise WorkerFailed(f"{url} refused the router's backend key ({status}): {message}")
    if 400 <= status < 500 and status != 408:  # 429 included: busy, not broken, and the client may retry
        raise ApiError(status, f"{message} (from {url})")
    raise WorkerFailed(f"{url} answered {status}: {message}")


class Backend(ABC):
    """How the router talks to one kind of server. Stateless: one instance serves every
    worker of its kind."""
    kind: ClassVar[BackendKind]
    roles: ClassVar[tuple[str, ...]]  # the roles a worker of this kind may have

    def __init__(self, http: httpx.AsyncClient, headers: dict[str, str]):
        self.http, self.headers = http, headers

    async def healthy(self, url: str) -> bool:
        try:
            r = await self.http.get(f"{url}/health", headers=self.headers, timeout=2)
            if r.status_code == 404:  # a plain OpenAI-compatible server: is it listing models?
                r = await self.http.get(f"{url}/v1/models", headers=self.headers, timeout=2)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def describe(self, url: str) -> BackendInfo:
        """The model id and limits, from ``/v1/models`` and what the server says of its cache."""
        return await probe_backend(self.http, url, self.headers)

    @abstractmethod
    async def open(self, call: ForeignCall, worker, decode, retry_decode) -> Answer:
        """Send ``call`` to ``worker`` (and for a disaggregated pair, the decode side to
        ``decode``; ``retry_decode(failed, why)`` marks a decode server that failed before
        its first event down and gives another). Returns once the answer has begun."""
