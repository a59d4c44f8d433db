"""POST /v1/chat/completions: streamed and not, n choices, logprobs, tool calls and
reasoning, both streamed as they are generated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from xlserve.openai.choices import ChoiceRun, RequestRun, start_choices
from xlserve.openai.conversation import chat_prompt_ids
from xlserve.openai.errors import ApiError
from xlserve.openai.protocol import ChatCompletionRequest
from xlserve.openai.reasoning import ReasoningStream, reasoning_enabled, starts_inside
from xlserve.openai.serving_common import (
    WorkerState,
    chat_logprobs,
    chunk_sse,
    framed_sse,
    new_id,
    now,
    resolve_max_tokens,
)
from xlserve.openai.tool_parsers import AUTO, ToolCallStream, detect_tool_parser, get_tool_parser


@dataclass
class ChatPlan:
    run: RequestRun
    parse_tools: bool  # tools were given and tool_choice is not "none"
    think: bool  # split reasoning off the answer
    think_open: bool  # the prompt left a <think> block open: the answer starts inside it


class ChoiceOutput:
    """One choice's text through the reasoning splitter, then the tool-call parser."""

    def __init__(self, handler: "ChatHandler", plan: ChatPlan):
        self.reasoning = ReasoningStream(plan.think_open) if plan.think else None
        self.tools = ToolCallStream(get_tool_parser(handler.tool_parser)) if plan.parse_tools else None

    def feed(self, text: str, final: bool) -> tuple[str, str, list]:
        """New (reasoning, content, call deltas)."""
        thought, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        if self.tools is None:
            return thought, content, []
        parsed = self.tools.feed(content, final)
        return thought, parsed.content, parsed.calls


class ChatHandler:
    def __init__(self, state: WorkerState, tool_parser: str = AUTO, reasoning_parser: str = AUTO):
        """Unknown parser names raise ``ValueError`` here, at start-up."""
        self.state = state
        template = state.tokenizer.chat_template if state.tokenizer is not None else None
        source = template.source if template is not None else ""
        if tool_parser == AUTO:  # a template that renders no tools gets our Hermes tool prompt
            tool_parser = detect_tool_parser(source) if template is not None and template.mentions_tools else "hermes"
        get_tool_parser(tool_parser)
        self.tool_parser = tool_parser
        self.think = reasoning_enabled(reasoning_parser, source)

    def prepare(self, req: ChatCompletionRequest) -> ChatPlan:
        state = self.state
        state.check_model(req.model)
        if state.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; use /v1/completions with token ids")
        try:  # tool_choice "none" keeps the tools in the prompt: the cached prefix of the next turn matches
            ids = chat_prompt_ids(state.tokenizer, req.messages, req.tools or None)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from e
        max_tokens = resolve_max_tokens(state, len(ids), req.requested_max_tokens())
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        try:
            guided = self._guided(req, parse_tools)
            params = [req.sampling_params(max_tokens, req.num_logprobs(), i, guided) for i in range(req.n)]
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        choices = [ChoiceRun(i, ids, p, primary=(i == 0)) for i, p in enumerate(params)]
        think_open = self.think and starts_inside(state.tokenizer.decode(ids[-16:], skip_special_tokens=False))
        return ChatPlan(RequestRun(new_id("chatcmpl"), choices, prices=state.prices), parse_tools, self.think,
                        think_open)

    def _guided(self, req: ChatCompletionRequest, parse_tools: bool):
        """The one constraint of a request: a forced tool call, response_format, or
        structured_outputs / guided_*."""
        required, name = req.forced_tool()
        if required and not parse_tools:
            raise ValueError("tool_choice requires a tool call but no tools were given")
        constraint = req.constraint()
        candidates = {"a forced tool call": required, "response_format": req.response_format is not None
                      and req.response_format.type != "text", "structured_outputs": constraint is not None}
        if sum(candidates.values()) > 1:
            raise ValueError(f"one constraint at a time; got {' and '.join(k for k, v in candidates.items() if v)}")
        if required:
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
            parser = get_tool_parser(self.tool_parser, self.state.tokenizer.special_token_ids)
            return parser.forced_call_grammar(tools, name, bool(req.parallel_tool_calls))
        return req.response_format.guided() if req.response_format else constraint

    async def complete(self, req: ChatCompletionRequest, plan: ChatPlan) -> dict:
        run = plan.run
        async for _ in await start_choices(self.state.async_engine, run, self.state.metrics):
            pass
        return {"id": run.request_id, "object": "chat.completion", "created": now(),
                "model": self.state.model_name,
                "choices": [self._choice(c, plan, req) for c in run.choices],
                "usage": run.usage()}

    def _choice(self, choice: ChoiceRun, plan: ChatPlan, req: ChatCompletionRequest) -> dict:
        out = choice.final.outputs[0]
        parts = ChoiceOutput(self, plan)
        thought, content, _ = parts.feed(out.text, final=True)
        calls = parts.tools.calls() if parts.tools else []
        message = {"role": "assistant", "content": (content.strip() or None) if calls else content}
        if thought:
            message["reasoning_content"] = thought
        reason = finish_reason(out.finish_reason, bool(calls), req.legacy_functions)
        if calls and req.legacy_functions:  # the pre-tools answer: one call, as message.function_call
            message["function_call"] = calls[0].to_openai()["function"]
        elif calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        logprobs = chat_logprobs(self.state.tokenizer, out.logprobs) if req.logprobs else None
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    async def stream(self, req: ChatCompletionRequest, plan: ChatPlan) -> AsyncIterator[str]:
        """Bad input and a full queue raise here, before any byte is sent."""
        events = await start_choices(self.state.async_engine, plan.run, self.state.metrics)
        return framed_sse(self._sse(plan, req, events), events)

    async def _sse(self, plan: ChatPlan, req: ChatCompletionRequest, events) -> AsyncIterator[str]:
        run, created, model = plan.run, now(), self.state.model_name
        outputs = {c.index: ChoiceOutput(self, plan) for c in run.choices}
        finished = 0

        def chunk(choices: list, usage: dict | None = None) -> str:
            return chunk_sse(run.request_id, "chat.completion.chunk", created, model, choices, usage)

        for c in run.choices:
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        async for choice, out in events:
            thought, content, calls = outputs[choice.index].feed(out.new_text, final=out.finished)
            delta = {"reasoning_content": thought} if thought else {}
            if content:
                delta["content"] = content
            delta.update(_call_deltas(calls, req.legacy_functions))
            logprobs = None
            if req.logprobs and out.outputs[0].logprobs:
                logprobs = chat_logprobs(self.state.tokenizer, out.outputs[0].logprobs[-1:])
            if delta or logprobs:
                yield chunk([{"index": choice.index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": None}])
            if out.finished:
                finished += 1
                tools = outputs[choice.index].tools
                reason = finish_reason(out.outputs[0].finish_reason, bool(tools and tools.sent),
                                       req.legacy_functions)
                last = finished == len(run.choices) and not req.include_usage
                yield chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                              "finish_reason": reason}], run.usage() if last else None)
        if req.include_usage:
            yield chunk([], run.usage())


def finish_reason(engine_reason: str | None, called: bool, legacy: bool) -> str | None:
    """``tool_calls`` (``function_call`` for the legacy API) when the answer called a tool,
    unless it was cut short: a call cut by max_tokens stays ``length``."""
    if not called or engine_reason == "length":
        return engine_reason
    return "function_call" if legacy else "tool_calls"


def _call_deltas(calls: list, legacy: bool) -> dict:
    if not calls:
        return {}
    if not legacy:
        return {"tool_calls": [c.to_openai() for c in calls]}
    first = [c for c in calls if c.index == 0]  # the pre-tools answer carries the first call only
    if not first:
        return {}
    call = {"arguments": first[0].arguments}
    return {"function_call": {"name": first[0].name, **call} if first[0].name else call}
