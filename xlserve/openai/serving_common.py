"""Pieces the chat and completion handlers share: limits, SSE framing, logprob shapes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, TypeVar

from xlserve.loader.tokenizer import Tokenizer
from xlserve.openai.engine_client import EngineBusy, EngineClient, RequestFailed
from xlserve.openai.errors import ApiError
from xlserve.openai.pricing import PriceTable
from xlserve.worker.metrics import WorkerMetrics

if TYPE_CHECKING:  # the router's state holds a RouterFront instead, and never imports torch
    from xlserve.engine.llm_engine import LLMEngine

T = TypeVar("T")
PREPROCESS_THREADS = 2  # parse, template and tokenize at once; each keeps its own word cache


class Preprocessor:
    """Parses, templates and tokenizes requests on its own threads, so one huge or slow
    request never stalls the event loop (tokenizing 7 MB takes seconds). The time a
    request may take grows with its body: ``base_s`` plus ``per_mib_s`` per MiB."""

    def __init__(self, threads: int = PREPROCESS_THREADS, base_s: float = 10.0, per_mib_s: float = 5.0):
        # Tokenize on these threads, not on rayon's: tokenizers (0.23 on) keeps its BPE word
        # cache per thread (10,000 words, ~0.33 KiB each), and a one-text encode runs on any
        # of rayon's one-per-core workers, so a server's cache memory grew with the host's
        # cores, filling over hours of new words (the router's RSS line in the soak). Serial,
        # there is one cache per preprocessing thread; one text gains nothing from rayon
        # (1.31 ms a 1,400-token prompt either way). A value the user set is kept.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="xlserve-preprocess")
        self.base_s, self.per_mib_s = base_s, per_mib_s

    async def run(self, fn: Callable[[], T], body_bytes: int) -> T:
        limit = self.base_s + self.per_mib_s * body_bytes / 2**20
        future = self.pool.submit(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), limit)
        except asyncio.TimeoutError:
            future.cancel()  # still queued: never runs; running: its result is dropped
            raise ApiError(413, f"the request was not parsed and tokenized within {limit:.0f} s "
                                f"(the bound for a body of {body_bytes} bytes); send a smaller one") from None


@dataclass
class WorkerState:
    engine: LLMEngine  # tokenizer, limits (and on a worker the engine itself)
    async_engine: EngineClient
    metrics: WorkerMetrics
    model_name: str
    prices: PriceTable = field(default_factory=PriceTable)
    preprocessor: Preprocessor = field(default_factory=Preprocessor)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, model: str | None) -> None:
        if model not in (None, "", self.model_name, "default"):
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")


def as_api_error(e: Exception) -> ApiError:
    """An exception met mid-stream as the OpenAI error the stream ends with."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ValueError):
        return ApiError(400, str(e))
    if isinstance(e, EngineBusy):
        return ApiError(429, f"server busy: {e}")
    if isinstance(e, RequestFailed):
        return ApiError(500, str(e), code="request_failed")
    return ApiError(500, f"generation failed: {e}")


async def framed_sse(body: AsyncIterator[str], events: AsyncIterator,
                     error_body: Callable[[Exception], dict] = lambda e: as_api_error(e).body()) -> AsyncIterator[str]:
    """``body``'s SSE lines, ended as every stream here ends: an error event if it fails (a
    stream never hangs), the engine ``events`` it read closed, then ``[DONE]``."""
    try:
        async for line in body:
            yield line
    except Exception as e:  # noqa: BLE001 - the stream must end with an error event, not hang
        yield sse(error_body(e))
    finally:
        await body.aclose()
        await events.aclose()
    yield sse("[DONE]")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def resolve_max_tokens(state: WorkerState, num_prompt: int, requested: int | None) -> int:
    room = state.max_model_len - num_prompt
    if room < 1:
        raise ApiError(400, f"the prompt has {num_prompt} tokens; this model's context is "
                            f"{state.max_model_len} tokens, so a prompt may have at most "
                            f"{state.max_model_len - 1}", "messages", "context_length_exceeded")
    if requested is None:
        return room
    if requested > room:
        raise ApiError(400, f"max_tokens is {requested} but the prompt has {num_prompt} tokens and the "
                            f"context is {state.max_model_len}: at most {room} tokens can be generated",
                       "max_tokens", "context_length_exceeded")
    return requested


def chunk_sse(request_id: str, obj: str, created: int, model: str, choices: list, usage: dict | None = None) -> str:
    """One streamed chunk of a completion (``obj``: its OpenAI object name)."""
    body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return sse(body)


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def chat_logprobs(tokenizer: Tokenizer | None, entries: list[dict]) -> dict:
    def token_info(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else str(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**token_info(e["token_id"], e["logprob"]),
                         "top_logprobs": [token_info(t, lp) for t, lp in e["top"]]} for e in entries]}


def completion_logprobs(tokenizer: Tokenizer | None, entries: list[dict], offset: int) -> dict:
    tokens, logprobs, tops, offsets = [], [], [], []
    for e in entries:
        text = tokenizer.decode([e["token_id"]], skip_special_tokens=False) if tokenizer else ""
        tokens.append(text)
        logprobs.append(e["logprob"])
        tops.append({(tokenizer.decode([t], skip_special_tokens=False) if tokenizer else str(t)): lp
                     for t, lp in e["top"]})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
