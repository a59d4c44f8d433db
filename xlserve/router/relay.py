"""A foreign server's answer on its way to the client: the router's model name, the
``cached_tokens`` of the server that computed the prompt, the price, and the in-flight
token accounting and prefix index brought up to date when it ends.

The client asked for usage in the stream or not; the router always asks (it prices every
request), so a usage-only chunk the client did not ask for is dropped here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable

import httpx

from xlserve.openai.errors import ApiError
from xlserve.openai.pricing import PriceTable
from xlserve.openai.serving_common import sse
from xlserve.router.backend import Answer, ForeignCall, cached_tokens_of
from xlserve.router.faults import WorkerFailed

log = logging.getLogger(__name__)
PREFILL_REPORT_WAIT_S = 5.0  # how long the final usage waits for a prefill running beside the decode


def priced_usage(usage: dict, cached: int, prompt_tokens: int, prices: PriceTable) -> dict:
    prompt = int(usage.get("prompt_tokens") or prompt_tokens)
    completion = int(usage.get("completion_tokens") or 0)
    details = {**(usage.get("prompt_tokens_details") or {}), "cached_tokens": cached}
    return {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": details,
            "cost": prices.cost(prompt, cached, completion)}


class Relay:
    """Rewrites one answer; ``on_end(cached_tokens)`` runs once, however it ends."""

    def __init__(self, call: ForeignCall, answer: Answer, prices: PriceTable, on_end: Callable[[int], None]):
        self.call, self.answer, self.prices, self.on_end = call, answer, prices, on_end
        self.cached = answer.cached_tokens
        self.ended = False

    async def _cached(self) -> int:
        if self.cached is None and self.answer.prefill is not None:
            try:
                self.cached = await asyncio.wait_for(asyncio.shield(self.answer.prefill), PREFILL_REPORT_WAIT_S)
            except asyncio.TimeoutError:
                log.warning("the prefill did not report its cached tokens within %.0f s", PREFILL_REPORT_WAIT_S)
        return self.cached or 0

    def _read(self, event: dict) -> None:
        """A server without a disaggregated prefill reports its own cache hits."""
        if self.answer.cached_tokens is None and self.answer.prefill is None:
            seen = cached_tokens_of(event)
            if seen is not None:
                self.cached = seen

    async def _rewrite(self, event: dict) -> dict | None:
        self._read(event)
        event["model"] = self.call.model_name
        if event.get("usage"):
            event["usage"] = priced_usage(event["usage"], await self._cached(), self.call.prompt_tokens, self.prices)
            if self.call.stream and not self.call.client_wants_usage:
                if not event.get("choices"):
                    return None
                del event["usage"]
        return event

    async def body(self) -> dict:
        try:
            return await self._rewrite(self.answer.json)
        finally:
            await self._end()

    async def events(self) -> AsyncIterator[str]:
        """The stream, ended as every stream of ours ends: an error event if the server
        breaks off mid-answer, then ``[DONE]``."""
        try:
            event = await self._rewrite(self.answer.first)
            if event is not None:
                yield sse(event)
            async for event in self.answer.rest:
                event = await self._rewrite(event)
                if event is not None:
                    yield sse(event)
        except (WorkerFailed, httpx.HTTPError) as e:
            yield sse(ApiError(502, f"the backend failed mid-answer: {e}").body())
        finally:
            await self._end()
        yield sse("[DONE]")

    async def _end(self) -> None:
        if not self.ended:
            self.ended = True
            prefill = self.answer.prefill
            if self.cached is None and prefill is not None and prefill.done() and not prefill.cancelled():
                self.cached = prefill.result()
            await self.answer.close()
            self.on_end(self.cached or 0)
