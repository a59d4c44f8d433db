"""Heartbeats on the internal answers: a worker that computes is never silent.

The router takes ``--worker-timeout`` seconds of silence from a worker for a hang: it fails
the request over and marks the worker down. A prompt can take longer than that to prefill
on a CPU (a 1,500-token prompt of the default model took over 60 s on a busy 2-core Zen,
which failed CI), and before its first token a worker has nothing to send. So while the
engine is healthy (``alive``: running, no step past ``--hang-timeout``) a waiting answer
sends a heartbeat every ``HEARTBEAT_S``; a hung or stopped engine sends none and the
router's timeout still finds it.

- A streamed answer (SSE) sends a comment line, which every SSE reader skips.
- A JSON answer that is not ready within ``HEARTBEAT_S`` starts as a 200 and sends spaces
  (whitespace before a JSON value is valid JSON); its outcome, the result or an OpenAI
  error object, is the body's one value. Answers ready sooner keep their status codes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi.responses import JSONResponse, Response

from xlserve.openai.event_stream import EventStreamResponse

HEARTBEAT_S = 0.25  # under any --worker-timeout worth setting; a write of 11 bytes
SSE_HEARTBEAT = ": working\n\n"


async def with_heartbeats(lines: AsyncIterator[str], alive: Callable[[], bool],
                          every: float = HEARTBEAT_S) -> AsyncIterator[str]:
    """``lines``, with ``SSE_HEARTBEAT`` after each ``every`` seconds without one while ``alive()``."""
    source = aiter(lines)
    pending = asyncio.ensure_future(anext(source))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                if alive():
                    yield SSE_HEARTBEAT
                continue
            try:
                line = pending.result()
            except StopAsyncIteration:
                return
            yield line
            pending = asyncio.ensure_future(anext(source))
    finally:
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await source.aclose()


async def json_with_heartbeats(work: Awaitable[dict], alive: Callable[[], bool],
                               error_body: Callable[[Exception], dict], every: float = HEARTBEAT_S) -> Response:
    """``work``'s answer: as plain JSON if ready within ``every`` seconds (its errors raise as
    usual), else a 200 that sends a space per ``every`` seconds while ``alive()`` and then the
    JSON of the result or of ``error_body(error)``. A client that leaves cancels ``work``."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=every)
    if done:
        return JSONResponse(task.result())

    async def body() -> AsyncIterator[str]:
        try:
            while not (await asyncio.wait({task}, timeout=every))[0]:
                if alive():
                    yield " "
            error = task.exception()
            yield json.dumps(error_body(error) if error is not None else task.result())
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return EventStreamResponse(body(), media_type="application/json")
