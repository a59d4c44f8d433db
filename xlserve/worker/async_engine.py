"""Runs the engine on its own thread and streams its outputs to asyncio consumers.

The event loop never runs model code, so HTTP stays responsive while a step runs
(torch releases the GIL inside its kernels). Commands (add, abort) travel to the
engine thread through a queue; outputs come back with ``call_soon_threadsafe``.

A request is checked off the loop (a grammar compiles in milliseconds to seconds), then
the engine thread takes it and answers ``ACCEPTED``, or the refusal, before any output:
so a server awaits ``LocalStream.accepted()`` and turns every refusal into a 400
before any byte of a response, streamed or not. A request that fails inside a step
ends with ``RequestFailed``; the others go on. If the engine itself cannot continue,
every stream gets ``EngineDead`` and ``on_fatal`` runs (a worker exits non-zero).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Callable, Sequence

from xlserve.engine.errors import FATAL_ERRORS, describe
from xlserve.engine.llm_engine import LLMEngine
from xlserve.engine.outputs import RequestOutput
from xlserve.engine.request import HandOff
from xlserve.openai.engine_client import EngineBusy, EngineClient, EngineDead, RequestFailed, RequestStream
from xlserve.sampling_params import SamplingParams

__all__ = ["ACCEPTED", "AsyncEngine", "EngineBusy", "EngineDead", "LocalStream", "RequestFailed"]

log = logging.getLogger(__name__)


ACCEPTED = object()  # the engine took the request; its outputs follow


def _refusal(error: Exception) -> Exception:
    """What a stream gets when its request is not taken: a ``ValueError`` is the client's
    mistake (a 400); anything else failed this request alone."""
    return error if isinstance(error, ValueError) else RequestFailed(describe(error))


class LocalStream(RequestStream):
    """The outputs of one request. However it ends (finished, error, closed, or dropped
    without ever being read), the request is released and, if unfinished, aborted."""

    def __init__(self, owner: "AsyncEngine", request_id: str):
        self.owner = owner
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        self.is_accepted = False

    def __aiter__(self):
        return self

    async def accepted(self) -> None:
        """Until the engine has taken the request; its refusal (``ValueError``) raises here."""
        if not self.is_accepted:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self._end(abort=False)
                raise item
            assert item is ACCEPTED, "the engine answers a request's acceptance before its outputs"
            self.is_accepted = True

    async def __anext__(self) -> RequestOutput:
        await self.accepted()
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


class AsyncEngine(EngineClient):
    def __init__(self, engine: LLMEngine, max_waiting: int,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.on_fatal = on_fatal
        # Requests beyond what one step can run, plus this many queued, are refused as busy.
        self.max_pending = engine.config.scheduler.max_num_seqs + max_waiting
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.stats()
        self._stop = threading.Event()
        self.dead: BaseException | None = None
        self.step_started: float | None = None  # monotonic start of the step running now
        # Request checks (grammar compiles) run here, off the event loop and the engine thread.
        self._checks = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="xlserve-check")
        self._thread = threading.Thread(target=self._run, name="xlserve-engine", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> dict:
        return self._stats  # refreshed by the engine thread after every step

    def num_pending(self) -> int:
        return len(self._streams)

    def health_problem(self, hang_timeout: float) -> str | None:
        """Why this engine cannot serve now (stopped, or one step running past
        ``hang_timeout`` seconds: hung), or None."""
        if self.dead is not None:
            return f"engine stopped: {describe(self.dead)}"
        started = self.step_started
        busy = time.monotonic() - started if started is not None else 0.0
        if busy > hang_timeout:
            return f"engine hung: one step has run for {busy:.0f} s (limit {hang_timeout:g} s)"
        return None

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
               handoff: HandOff | None = None) -> LocalStream:
        """Enqueue (``EngineBusy`` or ``EngineDead`` raise at once); the stream's
        ``accepted()`` then raises the engine's refusal (``ValueError``) before any output.
        Closing the stream early (client gone) aborts the request and frees its blocks."""
        if self.dead is not None:
            raise EngineDead(str(self.dead))
        if len(self._streams) >= self.max_pending:
            raise EngineBusy(f"{len(self._streams)} requests are in flight (limit {self.max_pending})")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = LocalStream(self, request_id)
        self._streams[request_id] = (asyncio.get_running_loop(), stream.queue)
        self._checks.submit(self._check_then_add, request_id, list(prompt_ids), params, handoff)
        return stream

    def _check_then_add(self, request_id, prompt_ids, params, handoff) -> None:
        if request_id not in self._streams:
            return  # the client left while the request queued for its check
        try:
            self.engine.validate_request(prompt_ids, params, handoff)
        except Exception as e:  # noqa: BLE001 - see _refusal
            self._deliver(request_id, _refusal(e))
            return
        self._commands.put(("add", request_id, prompt_ids, params, handoff))

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

    @property
    def running(self) -> bool:
        """Whether the engine thread still runs (``shutdown`` waits a bounded time for it)."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("stop",))
        self._thread.join(timeout=10)
        self._checks.shutdown(wait=False, cancel_futures=True)

    # -- engine thread ------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            if isinstance(item, RequestOutput) and item.error is not None:
                item = EngineBusy(item.error) if item.retry_after is not None else RequestFailed(item.error)
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # that loop is closed: nobody is left to read
                self._streams.pop(request_id, None)

    def _handle(self, command) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, ids, params, handoff = command
            if request_id not in self._streams:
                return  # the client left before the request reached the engine
            try:
                self.engine.add_request(request_id, ids, params, handoff, checked=True)
            except FATAL_ERRORS:
                raise
            except Exception as e:  # noqa: BLE001 - see _refusal: this request only
                self.engine.abort_request(request_id)
                self._deliver(request_id, _refusal(e))
                return
            self._deliver(request_id, ACCEPTED)
        elif kind == "abort":
            self.engine.abort_request(command[1])
        elif kind == "call":
            _, fn, args, future = command
            try:
                future.set_result(fn(self.engine, *args))
            except FATAL_ERRORS as e:  # the caller learns it, and the engine stops (e.g. a rank died)
                future.set_exception(e)
                raise
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
                self.engine.between_steps()
                if self.engine.has_unfinished_requests():
                    self.step_started = time.monotonic()
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                    self.step_started = None
                self._stats = self.engine.stats()
        except BaseException as e:  # surface to every waiter instead of hanging them
            log.exception("engine thread died")
            self.dead = e
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDead(f"engine failed: {describe(e)}"))
            if self.on_fatal is not None:
                self.on_fatal(e)
