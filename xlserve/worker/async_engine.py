"""Runs the engine on its own thread and streams its outputs to asyncio consumers.

The event loop never runs model code, so HTTP stays responsive while a step runs
(torch releases the GIL inside its kernels). Commands (add, abort) travel to the
engine thread through a queue; outputs come back with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import AsyncIterator, Sequence

from xlserve.engine.llm_engine import LLMEngine
from xlserve.engine.outputs import RequestOutput
from xlserve.engine.request import HandOff
from xlserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineBusy(Exception):
    """The waiting queue is full; the caller should retry later."""


class EngineDead(Exception):
    """The engine thread stopped after an internal error."""


class RequestStream:
    """The outputs of one request. However it ends (finished, error, closed, or dropped
    without ever being read), the request is released and, if unfinished, aborted."""

    def __init__(self, owner: "AsyncEngine", request_id: str):
        self.owner = owner
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self._end(abort=False)
            raise item
        if item.finished:
            self._end(abort=False)
        return item

    def _end(self, abort: bool) -> None:
        if not self.done:
            self.done = True
            self.owner.release(self.request_id, abort)

    def close(self) -> None:
        self._end(abort=True)

    async def aclose(self) -> None:
        self.close()

    def __del__(self):
        self.close()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int):
        self.engine = engine
        # Requests beyond what one step can run, plus this many queued, are refused as busy.
        self.max_pending = engine.config.scheduler.max_num_seqs + max_waiting
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.stats()
        self._stop = threading.Event()
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="xlserve-engine", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> dict:
        return self._stats  # refreshed by the engine thread after every step

    def num_pending(self) -> int:
        return len(self._streams)

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
               handoff: HandOff | None = None) -> AsyncIterator[RequestOutput]:
        """Check and enqueue now (raising ``ValueError``, ``EngineBusy`` or ``EngineDead``
        before any byte of a response is sent), then stream the outputs. Closing the
        stream early (client gone) aborts the request and frees its blocks."""
        if self.dead is not None:
            raise EngineDead(str(self.dead))
        if len(self._streams) >= self.max_pending:
            raise EngineBusy(f"{len(self._streams)} requests are in flight (limit {self.max_pending})")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = list(prompt_ids)
        self.engine.validate_request(prompt_ids, params, handoff)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = (asyncio.get_running_loop(), stream.queue)
        self._commands.put(("add", request_id, prompt_ids, params, handoff))
        return stream

    def release(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort:
            self._commands.put(("abort", request_id))

    async def call(self, fn, *args):
        """Run ``fn(engine, *args)`` on the engine thread (the engine is single-threaded)."""
        if self.dead is not None:
            raise EngineDead(str(self.dead))
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, args, future))
        return await asyncio.wrap_future(future)

    def call_blocking(self, fn, *args, timeout: float = 30.0):
        """``call`` for plain threads (the KV transfer server's handlers)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, args, future))
        return future.result(timeout=timeout)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("stop",))
        self._thread.join(timeout=10)

    # -- engine thread ------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _handle(self, command) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, ids, params, handoff = command
            if request_id not in self._streams:
                return  # the client left before the request reached the engine
            try:
                self.engine.add_request(request_id, ids, params, handoff)
            except ValueError as e:
                self._deliver(request_id, e)
        elif kind == "abort":
            self.engine.abort_request(command[1])
        elif kind == "call":
            _, fn, args, future = command
            try:
                future.set_result(fn(self.engine, *args))
            except Exception as e:  # delivered to the caller
                future.set_exception(e)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished_requests()
                try:
                    command = self._commands.get(block=block, timeout=0.5 if block else None)
                    self._handle(command)
                    while True:
                        self._handle(self._commands.get_nowait())
                except queue.Empty:
                    pass
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                self._stats = self.engine.stats()
        except BaseException as e:  # surface to every waiter instead of hanging them
            log.exception("engine thread died")
            self.dead = e
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDead(f"engine failed: {e}"))
