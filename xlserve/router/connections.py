"""Opening HTTP responses from workers so that a client who leaves never leaks a connection.

httpcore 1.0.9 (the latest; httpx gets no more releases) leaves a connection in its pool
for good when the task that asked for it is cancelled while the connection is being set
up (encode/httpcore#1093): neither idle nor closed, it is never reaped nor reused. The
router's tasks are cancelled whenever a client disconnects, and the 30-minute soak (8
agentic clients, one request in six left early) leaked 47 router -> decode connections:
the pool's 100 would have been gone within about an hour, and then every request waits
for a pool timeout. So the send runs in a task of its own that nobody cancels; a caller
that is cancelled meanwhile leaves it to finish and close the response.

What a peer sends is bounded: an answer read whole by ``MAX_BODY_BYTES`` (``bounded_client``),
an event stream, which may go on for as long as a generation does, by its line length
(``sse_lines``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

import httpx

from xlserve.router import background
from xlserve.router.faults import WorkerFailed

# The largest answer the router reads whole: a worker's GenerateResult or a foreign server's
# JSON completion. 32k tokens with 20 top logprobs each are ~32 MB of JSON.
MAX_BODY_BYTES = 64 * 1024 * 1024
# The router asks every peer for its answers as they are: a bound on compressed bytes would not
# bound what they expand to (a gzip body of 64 MiB can inflate a thousandfold).
IDENTITY = {"Accept-Encoding": "identity"}
# The extension a request carries when its answer is read as an event stream (by sse_lines,
# which bounds each line): only such an answer, with status 200 and an event-stream type, is
# not bounded in length.
EVENT_STREAM = "xlserve.event_stream"


class _BoundedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, request: httpx.Request, max_bytes: int):
        self.inner, self.request, self.max_bytes = inner, request, max_bytes

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read = 0
        async for chunk in self.inner:
            read += len(chunk)
            if read > self.max_bytes:
                raise httpx.ReadError(f"{self.request.url} answered over {self.max_bytes} bytes", request=self.request)
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


def _refusal(response: httpx.Response, max_bytes: float) -> str | None:
    """Why an answer is refused before its body is read: compressed against ``IDENTITY``, or
    announcing more than ``max_bytes``."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        return f"answered {encoding}-encoded (asked for identity)"
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        return f"announced {length} bytes (at most {max_bytes})"
    return None


class BoundedBodies(httpx.AsyncBaseTransport):
    """httpx's transport, each answer's body bounded to ``max_bytes`` (past it, reading raises
    ``httpx.ReadError``: the peer failed) unless the request carries ``EVENT_STREAM`` and the
    answer is a 200 event stream; an answer compressed against ``IDENTITY`` is refused."""

    def __init__(self, limits: httpx.Limits, max_bytes: int = MAX_BODY_BYTES):
        self.inner, self.max_bytes = httpx.AsyncHTTPTransport(limits=limits), max_bytes

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        event_stream = (request.extensions.get(EVENT_STREAM) and response.status_code == 200
                        and response.headers.get("content-type", "").startswith("text/event-stream"))
        refusal = _refusal(response, self.max_bytes if not event_stream else float("inf"))
        if refusal:
            await response.aclose()
            raise httpx.ReadError(f"{request.url} {refusal}", request=request)
        if event_stream:
            return response
        response.stream = _BoundedStream(response.stream, request, self.max_bytes)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def fetch(method: str, url: str, max_bytes: int = MAX_BODY_BYTES, **kwargs) -> tuple[int, bytes]:
    """Synchronous ``httpx.request``, its answer bounded as ``BoundedBodies`` bounds one: (status,
    body). For the calls made outside the server's event loop (startup, chat rendering)."""
    kwargs["headers"] = {**IDENTITY, **(kwargs.get("headers") or {})}
    with httpx.stream(method, url, **kwargs) as response:
        refusal = _refusal(response, max_bytes)
        if refusal:
            raise httpx.ReadError(f"{url} {refusal}", request=response.request)
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise httpx.ReadError(f"{url} answered over {max_bytes} bytes", request=response.request)
        return response.status_code, bytes(body)


def bounded_client(timeout: httpx.Timeout, limits: httpx.Limits, headers: dict | None = None) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` on ``BoundedBodies``, asking for answers as they are (``IDENTITY``)."""
    return httpx.AsyncClient(timeout=timeout, headers={**IDENTITY, **(headers or {})}, transport=BoundedBodies(limits))


async def open_response(http: httpx.AsyncClient, request: httpx.Request,
                        on_abandoned: Callable[[asyncio.Future], None] | None = None) -> httpx.Response:
    """``http.send(request, stream=True)``, never cancelled half way. ``on_abandoned(sending)``:
    the caller was cancelled while the send was in flight (it goes on; ``sending`` settles later)."""
    sending = asyncio.ensure_future(http.send(request, stream=True))
    try:
        return await asyncio.shield(sending)
    except asyncio.CancelledError:
        background.keep(sending).add_done_callback(_close_unwanted)  # nobody awaits it now
        if on_abandoned is not None:
            on_abandoned(sending)
        raise


def _close_unwanted(sending: asyncio.Future) -> None:
    if not sending.cancelled() and sending.exception() is None:
        background.spawn(sending.result().aclose())


@contextlib.asynccontextmanager
async def streamed(http: httpx.AsyncClient, method: str, url: str, on_abandoned=None,
                   **kwargs) -> AsyncIterator[httpx.Response]:
    """``http.stream(method, url, ...)`` on ``open_response``, read as an event stream."""
    request = http.build_request(method, url, extensions={EVENT_STREAM: True}, **kwargs)
    response = await open_response(http, request, on_abandoned)
    try:
        yield response
    finally:
        await response.aclose()


# An event is one token's delta, or a tool call's arguments at most: far below this. A peer
# that streams without ever ending a line would otherwise grow the router's memory unbounded.
MAX_SSE_LINE_BYTES = 16 * 1024 * 1024


async def sse_lines(response: httpx.Response, max_line_bytes: int = MAX_SSE_LINE_BYTES) -> AsyncIterator[str]:
    """The lines of an event stream, ended where the SSE format ends one (CRLF, LF or CR) and
    nowhere else. httpx's ``aiter_lines`` also ends a line at U+2028, U+2029, U+0085 and
    U+001C-U+001E (``str.splitlines``), and a JSON string may hold the first three raw: a
    decode worker's token with one of them cut its event in two, and the router answered 500.
    A line longer than ``max_line_bytes`` raises ``WorkerFailed`` (the sender is broken)."""
    parts: list[bytes] = []  # the line so far, joined only when a chunk may end it: linear time
    size = 0
    async for chunk in response.aiter_bytes():
        if b"\n" not in chunk and b"\r" not in chunk and not (parts and parts[-1].endswith(b"\r")):
            parts.append(chunk)
            size += len(chunk)
            _check(size, max_line_bytes, response)
            continue
        pending = b"".join(parts) + chunk
        # a CR last may be the first half of a CRLF: it waits for the next chunk
        ready, held = (pending[:-1], b"\r") if pending.endswith(b"\r") else (pending, b"")
        *lines, rest = ready.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        for line in lines:
            _check(len(line), max_line_bytes, response)
            yield line.decode("utf-8", "replace")
        _check(len(rest), max_line_bytes, response)
        parts, size = [rest + held], len(rest) + len(held)
    pending = b"".join(parts)
    if pending:
        yield pending.rstrip(b"\r").decode("utf-8", "replace")


def _check(line_bytes: int, max_line_bytes: int, response: httpx.Response) -> None:
    if line_bytes > max_line_bytes:
        raise WorkerFailed(f"{response.request.url} sent an event-stream line over {max_line_bytes} bytes")
