"""Server-sent events that end their source the moment the client leaves.

Starlette's ``StreamingResponse`` (ASGI 2.4, as uvicorn speaks it) notices a disconnect
only when a later write fails, and never closes its body iterator: the generator chain
behind it (the engine request, or on the router the decode worker's stream and its
socket) waited for the garbage collector. Seen: 64 disconnected streams left 64 router
sockets in CLOSE-WAIT for minutes, and the decode worker generating to max_tokens.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def until_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        streaming = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(until_disconnect())
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            results = await asyncio.gather(streaming, watching, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()  # runs the source's cleanup now, not at some GC
        error = results[0]
        if isinstance(error, Exception) and not isinstance(error, OSError):
            log.error("event stream failed: %s: %s", type(error).__name__, error)
