"""POST /v1/chat/completions: streamed and not, n choices, logprobs, tool calls."""

from __future__ import annotations

from typing import AsyncIterator

from xlserve.openai.choices import ChoiceRun, RequestRun, start_choices
from xlserve.openai.conversation import chat_prompt_ids
from xlserve.openai.errors import ApiError
from xlserve.openai.protocol import ChatCompletionRequest
from xlserve.openai.serving_common import WorkerState, chat_logprobs, chunk_sse, new_id, now, resolve_max_tokens, sse
from xlserve.openai.tool_parser import get_tool_parser


class ChatHandler:
    def __init__(self, state: WorkerState, tool_parser: str = "hermes"):
        self.state = state
        self.tool_parser = tool_parser

    def prepare(self, req: ChatCompletionRequest) -> tuple[RequestRun, bool]:
        state = self.state
        state.check_model(req.model)
        if state.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; use /v1/completions with token ids")
        use_tools = bool(req.tools) and req.tool_choice != "none"
        try:
            ids = chat_prompt_ids(state.tokenizer, req.messages, req.tools if use_tools else None)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from e
        max_tokens = resolve_max_tokens(state, len(ids), req.requested_max_tokens())
        try:
            guided = self._guided(req, use_tools)
            params = [req.sampling_params(max_tokens, req.num_logprobs(), i, guided) for i in range(req.n)]
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        choices = [ChoiceRun(i, ids, p, primary=(i == 0)) for i, p in enumerate(params)]
        return RequestRun(new_id("chatcmpl"), choices, prices=state.prices), use_tools

    def _guided(self, req: ChatCompletionRequest, use_tools: bool):
        required, name = req.forced_tool()
        if use_tools and required:
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
            return get_tool_parser(self.tool_parser).forced_call_grammar(tools, name, bool(req.parallel_tool_calls))
        if required:
            raise ValueError("tool_choice requires a tool call but no tools were given")
        return req.response_format.guided() if req.response_format else None

    async def complete(self, req: ChatCompletionRequest, prepared: tuple[RequestRun, bool]) -> dict:
        run, use_tools = prepared
        async for _ in await start_choices(self.state.async_engine, run, self.state.metrics):
            pass
        return {"id": run.request_id, "object": "chat.completion", "created": now(),
                "model": self.state.model_name,
                "choices": [self._choice(c, use_tools, req) for c in run.choices],
                "usage": run.usage()}

    def _choice(self, choice: ChoiceRun, use_tools: bool, req: ChatCompletionRequest) -> dict:
        out = choice.final.outputs[0]
        content, calls = out.text, []
        if use_tools:
            content, calls = get_tool_parser(self.tool_parser).parse(out.text)
        message = {"role": "assistant", "content": content}
        reason = out.finish_reason
        if calls and req.legacy_functions:  # the pre-tools answer: one call, as message.function_call
            message["function_call"], reason = calls[0].to_openai()["function"], "function_call"
        elif calls:
            message["tool_calls"], reason = [c.to_openai() for c in calls], "tool_calls"
        logprobs = chat_logprobs(self.state.tokenizer, out.logprobs) if req.logprobs else None
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    async def stream(self, req: ChatCompletionRequest, prepared: tuple[RequestRun, bool]) -> AsyncIterator[str]:
        """Bad input and a full queue raise here, before any byte is sent."""
        run, use_tools = prepared
        events = await start_choices(self.state.async_engine, run, self.state.metrics)
        return self._sse(run, use_tools, req, events)

    async def _sse(self, run: RequestRun, use_tools: bool, req: ChatCompletionRequest,
                   events) -> AsyncIterator[str]:
        created, model = now(), self.state.model_name
        parsers = {c.index: get_tool_parser(self.tool_parser) if use_tools else None for c in run.choices}
        num_calls = {c.index: 0 for c in run.choices}
        finished = 0

        def chunk(choices: list, usage: dict | None = None) -> str:
            return chunk_sse(run.request_id, "chat.completion.chunk", created, model, choices, usage)

        for c in run.choices:
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        try:
            async for choice, out in events:
                delta = {}
                parser = parsers[choice.index]
                if parser is None:
                    if out.new_text:
                        delta["content"] = out.new_text
                else:
                    parsed = parser.feed(out.new_text, final=out.finished)
                    if parsed.content:
                        delta["content"] = parsed.content
                    if parsed.tool_calls and req.legacy_functions:
                        if not num_calls[choice.index]:  # the pre-tools answer: the first call only
                            delta["function_call"] = parsed.tool_calls[0].to_openai()["function"]
                        num_calls[choice.index] += len(parsed.tool_calls)
                    elif parsed.tool_calls:
                        delta["tool_calls"] = [c.to_openai(num_calls[choice.index] + i)
                                               for i, c in enumerate(parsed.tool_calls)]
                        num_calls[choice.index] += len(parsed.tool_calls)
                logprobs = None
                if req.logprobs and out.outputs[0].logprobs:
                    logprobs = chat_logprobs(self.state.tokenizer, out.outputs[0].logprobs[-1:])
                if delta or logprobs:
                    yield chunk([{"index": choice.index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": None}])
                if out.finished:
                    finished += 1
                    reason = out.outputs[0].finish_reason
                    if num_calls[choice.index]:
                        reason = "function_call" if req.legacy_functions else "tool_calls"
                    last = finished == len(run.choices) and not req.include_usage
                    yield chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                                  "finish_reason": reason}], run.usage() if last else None)
            if req.include_usage:
                yield chunk([], run.usage())
        except ApiError as e:
            yield sse(e.body())
        except ValueError as e:
            yield sse(ApiError(400, str(e)).body())
        except Exception as e:  # noqa: BLE001 - the stream must end with an error event, not hang
            yield sse(ApiError(500, f"generation failed: {e}").body())
        finally:
            await events.aclose()
        yield sse("[DONE]")
