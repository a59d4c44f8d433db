"""POST /v1/completions: text or token-id prompts (one or many), n choices, logprobs, echo."""

from __future__ import annotations

from typing import AsyncIterator

from xlserve.openai.choices import ChoiceRun, RequestRun, start_choices
from xlserve.openai.errors import ApiError
from xlserve.openai.protocol import CompletionRequest
from xlserve.openai.serving_common import (
    WorkerState,
    chunk_sse,
    completion_logprobs,
    framed_sse,
    new_id,
    now,
    resolve_max_tokens,
)


class CompletionHandler:
    def __init__(self, state: WorkerState):
        self.state = state

    def prepare(self, req: CompletionRequest) -> RequestRun:
        self.state.check_model(req.model)
        choices = []
        try:
            constraint = req.constraint()
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        for p_index, prompt in enumerate(req.prompts()):
            try:
                ids = self.state.engine.tokenize(prompt)
                max_tokens = resolve_max_tokens(self.state, len(ids), req.max_tokens)
                params = [req.sampling_params(max_tokens, req.logprobs, i, constraint) for i in range(req.n)]
            except ValueError as e:
                raise ApiError(400, str(e), "prompt") from e
            choices += [ChoiceRun(p_index * req.n + i, ids, p, primary=(i == 0)) for i, p in enumerate(params)]
        return RequestRun(new_id("cmpl"), choices, prices=self.state.prices)

    def _echo(self, req: CompletionRequest, choice: ChoiceRun) -> str:
        if not req.echo or self.state.tokenizer is None:
            return ""
        return self.state.tokenizer.decode(choice.prompt_ids)

    async def complete(self, req: CompletionRequest, run: RequestRun) -> dict:
        async for _ in await start_choices(self.state.async_engine, run, self.state.metrics):
            pass
        choices = []
        for c in run.choices:
            out = c.final.outputs[0]
            prefix = self._echo(req, c)
            logprobs = (completion_logprobs(self.state.tokenizer, out.logprobs, len(prefix))
                        if req.logprobs is not None else None)
            choices.append({"index": c.index, "text": prefix + out.text, "logprobs": logprobs,
                            "finish_reason": out.finish_reason})
        return {"id": run.request_id, "object": "text_completion", "created": now(),
                "model": self.state.model_name, "choices": choices, "usage": run.usage()}

    async def stream(self, req: CompletionRequest, run: RequestRun) -> AsyncIterator[str]:
        """Bad input and a full queue raise here, before any byte is sent."""
        events = await start_choices(self.state.async_engine, run, self.state.metrics)
        return framed_sse(self._sse(run, req, events), events)

    async def _sse(self, run: RequestRun, req: CompletionRequest, events) -> AsyncIterator[str]:
        created, model = now(), self.state.model_name
        finished = 0
        offsets = {c.index: 0 for c in run.choices}

        def chunk(choices: list, usage: dict | None = None) -> str:
            return chunk_sse(run.request_id, "text_completion", created, model, choices, usage)

        for c in run.choices:
            if self._echo(req, c):
                text = self._echo(req, c)
                offsets[c.index] = len(text)
                yield chunk([{"index": c.index, "text": text, "logprobs": None, "finish_reason": None}])
        async for choice, out in events:
            logprobs = None
            if req.logprobs is not None and out.outputs[0].logprobs:
                logprobs = completion_logprobs(self.state.tokenizer, out.outputs[0].logprobs[-1:],
                                               offsets[choice.index])
            offsets[choice.index] += len(out.new_text)
            finished += out.finished
            last = out.finished and finished == len(run.choices) and not req.include_usage
            yield chunk([{"index": choice.index, "text": out.new_text, "logprobs": logprobs,
                          "finish_reason": out.outputs[0].finish_reason if out.finished else None}],
                        run.usage() if last else None)
        if req.include_usage:
            yield chunk([], run.usage())
