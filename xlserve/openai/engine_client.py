"""What the OpenAI layer needs of an engine: the local one (``AsyncEngine``, the model on
this process) and the router's remote one (``RemoteEngine``, workers over HTTP) both are
an ``EngineClient``. This module imports no torch, so neither does the router.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import AsyncIterator, Sequence

from xlserve.engine.outputs import RequestOutput
from xlserve.engine.request import HandOff
from xlserve.sampling_params import SamplingParams


class EngineBusy(Exception):
    """The waiting queue is full; the caller should retry later."""


class EngineDead(Exception):
    """The engine thread stopped after an internal error."""


class RequestFailed(Exception):
    """The request failed inside the engine (not the client's mistake); others went on."""


class RequestStream(ABC):
    """The outputs of one request. ``accepted()`` returns once the engine took it and
    raises its refusal (``ValueError``: a 400) before any output; ``close()`` ends it
    early (client gone) and aborts the request wherever it runs."""

    @abstractmethod
    async def accepted(self) -> None: ...

    @abstractmethod
    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    @abstractmethod
    def close(self) -> None: ...


class EngineClient(ABC):
    """Invariants: ``submit`` never blocks and raises only ``EngineBusy`` / ``EngineDead``
    / ``ValueError`` (a duplicate id); every other outcome arrives through the stream, a
    refusal before any output. ``stats`` is a dict of counters (may be empty)."""

    stats: dict

    @abstractmethod
    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
               handoff: HandOff | None = None) -> RequestStream: ...

    @abstractmethod
    def health_problem(self, hang_timeout: float) -> str | None:
        """Liveness: why this process should be restarted (engine stopped or hung), or None."""

    def readiness_problem(self) -> str | None:
        """Readiness, besides liveness: why requests should not be sent here now (the
        router: a stage without a healthy worker), or None."""
        return None

    def placement(self) -> dict[str, str]:
        """Where the request being served in this context ran (session, workers), for its
        log line; empty for a local engine."""
        return {}
