"""Fan one API request out to n engine requests and merge their streams.

Also keeps the per-request facts the API reports (usage, timings) and writes the one
log line per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from xlserve.engine.outputs import RequestOutput
from xlserve.engine.request import HandOff
from xlserve.openai.engine_client import EngineClient
from xlserve.openai.errors import ApiError
from xlserve.openai.pricing import PriceTable
from xlserve.sampling_params import SamplingParams
from xlserve.worker.metrics import WorkerMetrics

log = logging.getLogger("xlserve.requests")


@dataclass
class ChoiceRun:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    primary: bool = True  # first choice of its prompt: counts the prompt in metrics
    handoff: HandOff | None = None  # one half of an answer split over prefill and decode workers
    final: RequestOutput | None = None
    last_time: float | None = None


@dataclass
class RequestRun:
    request_id: str
    choices: list[ChoiceRun]
    start: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    prices: PriceTable | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.prompt_ids) for c in {id(c.prompt_ids): c for c in self.choices}.values())

    def usage(self) -> dict:
        done = [c.final for c in self.choices if c.final is not None]
        completion = sum(len(o.outputs[0].token_ids) for o in done)
        # cached tokens of each distinct prompt, taken from its first choice
        firsts = {id(c.prompt_ids): c for c in reversed(self.choices)}
        cached = sum(c.final.cached_tokens for c in firsts.values() if c.final is not None)
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                 "total_tokens": self.prompt_tokens + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self.prices is not None:
            usage["cost"] = self.prices.cost(self.prompt_tokens, cached, completion)
        return usage


async def start_choices(engine: EngineClient, run: RequestRun,
                        metrics: WorkerMetrics) -> AsyncIterator[tuple[ChoiceRun, RequestOutput]]:
    """Submit every choice and wait until the engine took each (bad input is a 400 and a
    full queue a 429 here, before any byte of a response, and nothing is left running),
    then merge their outputs as ``(choice, output)``."""
    streams = []
    try:
        for c in run.choices:
            streams.append(engine.submit(f"{run.request_id}-{c.index}", c.prompt_ids, c.params, c.handoff))
        for stream in streams:
            await stream.accepted()
    except BaseException as e:
        for stream in streams:
            stream.close()
        if isinstance(e, ValueError):
            raise ApiError(400, str(e)) from e
        raise
    return _merge(run, list(zip(run.choices, streams)), metrics, engine)


async def _merge(run: RequestRun, streams: list, metrics: WorkerMetrics, engine: EngineClient):
    """Errors of any choice propagate; leaving early aborts every choice still running
    (counted as ``abort`` in the finished-requests metric)."""
    queue: asyncio.Queue = asyncio.Queue()
    done_marker = object()

    async def pump(choice: ChoiceRun, stream):
        try:
            async for out in stream:
                await queue.put((choice, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put(e)
        finally:
            stream.close()
            await queue.put(done_marker)

    tasks = [asyncio.create_task(pump(c, s)) for c, s in streams]
    remaining = len(tasks)
    status = "aborted"  # unless the loop ends or raises: the consumer left early
    try:
        while remaining:
            item = await queue.get()
            if item is done_marker:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                status = f"error ({type(item).__name__})"
                raise item
            choice, out = item
            _observe(run, choice, out, metrics)
            yield choice, out
        status = "ok"
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if status == "aborted":
            metrics.finished("abort", sum(c.final is None for c in run.choices))
        _log_request(run, status, engine.placement())


def _observe(run: RequestRun, choice: ChoiceRun, out: RequestOutput, metrics: WorkerMetrics) -> None:
    now = time.monotonic()
    if run.first_token is None:
        run.first_token = now
    if choice.last_time is not None:
        metrics.itl.observe(now - choice.last_time)
    choice.last_time = now
    if out.finished:
        choice.final = out
        ttft = run.first_token - run.start if choice.index == 0 else None
        metrics.observe_finished(len(choice.prompt_ids) if choice.primary else 0,
                                 out.cached_tokens if choice.primary else 0,
                                 len(out.outputs[0].token_ids), ttft, now - run.start,
                                 out.outputs[0].finish_reason)


def _log_request(run: RequestRun, status: str, placement: dict[str, str]) -> None:
    """One line per request (``--no-log-requests`` silences the ``xlserve.requests`` logger)."""
    usage = run.usage()
    ttft = f"{(run.first_token - run.start) * 1000:.0f}ms" if run.first_token else "-"
    reasons = ",".join(sorted({c.final.outputs[0].finish_reason or "-" for c in run.choices if c.final})) or "-"
    where = "".join(f" {key}={value}" for key, value in placement.items())
    log.info("request %s:%s status=%s prompt=%d cached=%d generated=%d ttft=%s duration=%.0fms finish=%s",
             run.request_id, where, status, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
             usage["completion_tokens"], ttft, (time.monotonic() - run.start) * 1000, reasons)
