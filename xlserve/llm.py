"""Offline API: ``LLM(model=...).generate(prompts, params)`` and ``.chat(conversations, params)``."""

from __future__ import annotations

import itertools
from typing import Sequence

from tqdm.auto import tqdm

from xlserve.config import EngineConfig
from xlserve.engine.llm_engine import LLMEngine
from xlserve.engine.outputs import RequestOutput
from xlserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str = "default", **engine_options):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (they also stop when this process exits)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, params_list):
                self.engine.add_request(request_id, prompt, p)
        except ValueError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, conversations: list[dict] | list[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             tools: list[dict] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has none")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.encode_chat(conv, tools=tools) for conv in conversations]
        return self.generate(prompts, params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in ids:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
