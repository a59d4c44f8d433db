"""The typed messages between the router and its workers, imported by both sides.

Requests (router -> worker) are strict; answers and stream events (worker -> router)
refuse unknown fields too: a field one side adds never silently vanishes on the other.
Sampling parameters travel in ``SamplingParams``' own wire form; finish reasons are the
engine's ``FinishReason`` (``paused``: the prefill stopped at the hand-off).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from xlserve.engine.request import FinishReason
from xlserve.sampling_params import WIRE_CONFIG, SamplingParams

MAX_PROMPT_IDS = 1_000_000
MAX_BLOCKS = 65536


# JSON parsing caches no string value: these carry fresh hex (block hashes, pin ids,
# secrets) that never repeat, and pydantic-core's cache (16,384 strings, on by default) kept
# them live in the router: ~4 allocations a request, 332 KiB after 944 requests, filling
# through the first hours of traffic (memray across the soak's load, docs/reliability.md).
STRINGS = ConfigDict(cache_strings="keys")


class Request(BaseModel):
    model_config = WIRE_CONFIG | STRINGS  # strict: no "5" for 5


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid") | STRINGS


class KVHandle(Request):
    """A capability for one pin's blocks on one KV server (see ``engine/kv_blocks.py``)."""
    transport: str = Field(max_length=32)
    host: str = Field(max_length=255)
    port: int = Field(ge=1, le=65535)
    pin_id: str = Field(max_length=64)
    secret: str = Field(max_length=128)
    block_hashes: list[str] = Field(max_length=MAX_BLOCKS)


class GenerateRequest(Request):
    """``POST /internal/generate``: the prefill (``kv_export``) or the decode half
    (``kv_import`` + ``resume_token_ids``) of one answer, or a whole one."""
    request_id: str | None = Field(default=None, max_length=128)
    prompt_token_ids: list[int] = Field(min_length=1, max_length=MAX_PROMPT_IDS)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    kv_export: bool = False
    kv_import: KVHandle | None = None
    resume_token_ids: list[int] = Field(default_factory=list, max_length=4096)
    on_pull_failure: Literal["recompute", "fail"] | None = None


class PullReport(Answer):
    blocks: int
    bytes: int
    seconds: float
    error: str | None = None


class LogprobEntry(Answer):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class GenerateResult(Answer):
    """The answer to a non-streamed generate: on a prefill worker, the first token, the
    finish reason (``paused`` unless the answer ended there) and the KV handle."""
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    kv_import: PullReport | None = None
    logprobs: list[LogprobEntry] | None = None
    kv: KVHandle | None = None


class StreamEvent(Answer):
    """One event of a streamed generate; the last one carries the finish and the counts."""
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[LogprobEntry] | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    kv_import: PullReport | None = None


class KVRelease(Request):
    pin_id: str = Field(max_length=64)


class KVPeer(Request):
    host: str = Field(max_length=255)
    port: int = Field(ge=1, le=65535)


class KVPeers(Request):
    peers: list[KVPeer] = Field(max_length=1024)
    # Who registers them: each router replaces its own set, so routers with other prefill
    # workers can share a decode worker ("": one anonymous registrant).
    router: str = Field("", max_length=64)
