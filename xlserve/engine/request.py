"""Request state: ``num_computed_tokens`` catches up with ``num_tokens`` one step at a time.

Prefill, chunked prefill, prefix hits, resumed preemption and speculative verification
are all the same thing to the scheduler: tokens not yet in the KV cache.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from xlserve.hashing import BlockHash, extend_block_hashes
from xlserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    PAUSED = "paused"  # stopped at a hand-off point; the answer continues on another worker
    ERROR = "error"  # the request failed inside the engine (``Request.error`` says why); others go on


@dataclass(frozen=True)
class HandOff:
    """One answer generated on two workers (prefill -> decode).

    ``pause_after``: the prefill side stops after this many output tokens without ending
    the answer (held-back text such as a possible stop-string prefix stays held back).
    ``resume``: the decode side starts with these output tokens already generated, so
    penalties, seeded draws, grammar state, stop strings and text continue exactly as on
    one worker.
    """
    pause_after: int | None = None
    resume: tuple[int, ...] = ()

    def __post_init__(self):
        if self.pause_after is not None and self.pause_after < 1:
            raise ValueError(f"pause_after must be at least 1; got {self.pause_after}")


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int], block_size: int, extra_key: bytes = b"",
                 handoff: HandOff | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = list(handoff.resume) if handoff else []
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        self.pause_after = handoff.pause_after if handoff else None
        # What another worker already delivered: outputs report only what follows.
        self.num_resumed_tokens = len(self.output_token_ids)
        self.num_resumed_chars = 0
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix hit at first schedule; -1 until then
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None  # set with FinishReason.ERROR
        self.block_size = block_size
        self.extra_key = extra_key
        self.block_hashes: list[BlockHash] = []
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self.output_logprobs: list[dict] = []
        self.spec_token_ids: list[int] = []  # proposed next tokens, checked in the next step
        self.tiers_asked = False  # the KV tiers were asked for this request's prefix (once per admission)
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def update_block_hashes(self) -> None:
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self.extra_key)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.update_block_hashes()

    def drop_output_after(self, count: int) -> None:
        """Keep only the first ``count`` output tokens (a stop string ended the answer inside a
        step's run of accepted tokens: what followed it was never the answer)."""
        extra = self.num_output_tokens - count
        if extra > 0:
            del self.output_token_ids[count:], self.all_token_ids[-extra:]
            if self.output_logprobs:  # one per token of the step when they are asked for
                del self.output_logprobs[-extra:]
            del self.block_hashes[len(self.all_token_ids) // self.block_size:]

    def check_stop(self, max_model_len: int) -> bool:
        """Token-level stop conditions; stop strings are checked by the detokenizer."""
        last = self.output_token_ids[-1]
        if last in self.eos_token_ids or last in self.stop_token_ids:
            self.finish_reason = FinishReason.STOP
        elif self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = FinishReason.LENGTH
        elif self.pause_after is not None and self.num_output_tokens >= self.pause_after:
            self.finish_reason = FinishReason.PAUSED
        return self.finish_reason is not None
