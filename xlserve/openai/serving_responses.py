"""POST /v1/responses (and GET / DELETE /v1/responses/{id}): the Responses API over the
chat machinery — the request becomes a chat request (history from ``previous_response_id``
included), its output is split the same way (reasoning, text, tool calls) and written as
Response items and streaming events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from pydantic import ValidationError

from xlserve.openai.choices import start_choices
from xlserve.openai.errors import ApiError
from xlserve.openai.protocol import ChatCompletionRequest
from xlserve.openai.protocol_responses import ResponsesRequest
from xlserve.openai.response_items import ResponseItems, _id
from xlserve.openai.response_store import ResponseStore
from xlserve.openai.serving_chat import ChatHandler, ChatPlan, ChoiceOutput
from xlserve.openai.serving_common import as_api_error, now


@dataclass
class ResponsePlan:
    chat: ChatPlan
    conversation: list[dict]  # history + this input, without instructions
    response_id: str
    created: int


class ResponsesHandler:
    def __init__(self, chat: ChatHandler, store: ResponseStore):
        self.chat, self.store = chat, store

    def prepare(self, req: ResponsesRequest) -> ResponsePlan:
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise ApiError(400, f"previous response {req.previous_response_id!r} is not (or no longer) kept "
                                    "by this server", "previous_response_id", "previous_response_not_found")
            history = previous.conversation
        conversation = history + req.input_messages()
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        try:
            chat_req = ChatCompletionRequest.model_validate(req.chat_fields(system + conversation))
        except ValidationError as e:
            raise ApiError(400, "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                                          for err in e.errors(include_url=False))) from None
        return ResponsePlan(self.chat.prepare(chat_req), conversation, _id("resp"), now())

    def _response(self, req: ResponsesRequest, plan: ResponsePlan, status: str, items: ResponseItems | None,
                  finish: str | None = None) -> dict:
        usage = plan.chat.run.usage() if items is not None else None
        return {
            "id": plan.response_id, "object": "response", "created_at": plan.created, "status": status,
            "model": self.chat.state.model_name, "output": items.items if items else [],
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None, "error": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "temperature": req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": bool(req.parallel_tool_calls), "store": req.store,
            "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
            else req.tool_choice.model_dump(), "tools": [t.model_dump(by_alias=True) for t in req.tools or []],
            "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                                if req.text and req.text.format else {"type": "text"})},
            "truncation": "disabled", "metadata": req.metadata or {},
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": usage["total_tokens"]}}

    def _finish(self, req, plan: ResponsePlan, items: ResponseItems, finish: str | None) -> dict:
        response = self._response(req, plan, "incomplete" if finish == "length" else "completed", items, finish)
        if req.store:
            self.store.put(response, plan.conversation + [items.as_chat_message()])
        return response

    @staticmethod
    def _write(items: ResponseItems, output: ChoiceOutput, text: str, final: bool) -> list[str]:
        thought, content, calls = output.feed(text, final)
        events = items.reasoning_delta(thought) if thought else []
        events += items.text_delta(content) if content else []
        for c in calls:
            events += items.call_delta(c.index, c.id, c.name, c.arguments)
        return events

    async def complete(self, req: ResponsesRequest, plan: ResponsePlan) -> dict:
        run = plan.chat.run
        async for _ in await start_choices(self.chat.state.async_engine, run, self.chat.state.metrics):
            pass
        items, final = ResponseItems(plan.response_id), run.choices[0].final.outputs[0]
        self._write(items, ChoiceOutput(self.chat, plan.chat), final.text, True)
        items.close()
        return self._finish(req, plan, items, final.finish_reason)

    async def stream(self, req: ResponsesRequest, plan: ResponsePlan) -> AsyncIterator[str]:
        """Bad input and a full queue raise here, before any byte is sent."""
        events = await start_choices(self.chat.state.async_engine, plan.chat.run, self.chat.state.metrics)
        return self._events(req, plan, events)

    async def _events(self, req, plan: ResponsePlan, events) -> AsyncIterator[str]:
        items, output, finish = ResponseItems(plan.response_id), ChoiceOutput(self.chat, plan.chat), None
        started = self._response(req, plan, "in_progress", None)
        yield items.event("response.created", response=started)
        yield items.event("response.in_progress", response=started)
        try:
            async for _, out in events:
                for event in self._write(items, output, out.new_text, out.finished):
                    yield event
                finish = out.outputs[0].finish_reason if out.finished else finish
            for event in items.close():
                yield event
            response = self._finish(req, plan, items, finish)
            yield items.event(f"response.{response['status']}", response=response)
        except Exception as e:  # noqa: BLE001 - the stream must end with an error event, not hang
            error = as_api_error(e).body()["error"]
            yield items.event("error", code=error.get("code"), message=error["message"], param=error.get("param"))
            yield items.event("response.failed", response={**self._response(req, plan, "failed", items),
                                                           "error": {"code": error.get("code") or "server_error",
                                                                     "message": error["message"]}})
        finally:
            await events.aclose()
