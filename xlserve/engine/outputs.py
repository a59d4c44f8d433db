"""What the engine hands back per request and step (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict] | None = None  # per token: token_id, logprob, top [(id, logprob)]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    cached_tokens: int = 0
    new_text: str = ""  # text released in this step (streaming)
    new_token_ids: list[int] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # arrival, first token, finish times (monotonic)
    error: str | None = None  # the request failed in the engine (finish_reason "error"); others went on
    retry_after: float | None = None  # with error: refused for lack of capacity (busy), try again later

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
