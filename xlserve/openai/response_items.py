"""Output items of a Responses answer (reasoning, message, function calls), built from
the pieces the chat output splitter yields, with the streaming events that announce them.
One writer serves both paths: a non-streamed answer is the same pieces with the events
dropped."""

from __future__ import annotations

import json
import uuid


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponseItems:
    """Items in order; ``*_delta`` and ``call_start`` return the SSE events they cause."""

    def __init__(self, response_id: str):
        self.response_id = response_id
        self.items: list[dict] = []
        self.calls: dict[int, dict] = {}  # tool-call index -> its item
        self._open: dict | None = None  # the item still being written
        self._seq = 0

    def event(self, kind: str, **fields) -> str:
        self._seq += 1
        data = json.dumps({"type": kind, "sequence_number": self._seq - 1, **fields}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _start(self, item: dict) -> list[str]:
        out = self.close()
        self.items.append(item)
        self._open = item
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                              item={**item, "status": "in_progress"}))
        return out

    def _text_item(self, kind: str, part_type: str, prefix: str, extra: dict) -> list[str]:
        if self._open is not None and self._open["type"] == kind:
            return []
        item = {"type": kind, "id": _id(prefix), "status": "completed", **extra,
                "content": [{"type": part_type, "text": ""} | ({"annotations": []} if kind == "message" else {})]}
        out = self._start(item)
        out.append(self.event("response.content_part.added", **self._where(item), content_index=0,
                              part=item["content"][0]))
        return out

    def reasoning_delta(self, text: str) -> list[str]:
        out = self._text_item("reasoning", "reasoning_text", "rs", {"summary": []})
        self._open["content"][0]["text"] += text
        return out + [self.event("response.reasoning_text.delta", **self._where(self._open), content_index=0,
                                 delta=text)]

    def text_delta(self, text: str) -> list[str]:
        out = self._text_item("message", "output_text", "msg", {"role": "assistant"})
        self._open["content"][0]["text"] += text
        return out + [self.event("response.output_text.delta", **self._where(self._open), content_index=0,
                                 delta=text)]

    def call_delta(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[str]:
        out = []
        if name is not None:
            self.calls[index] = {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name,
                                 "arguments": "", "status": "completed"}
            out += self._start(self.calls[index])
        item = self.calls[index]
        if arguments:
            item["arguments"] += arguments
            out.append(self.event("response.function_call_arguments.delta", **self._where(item), delta=arguments))
        return out

    def close(self) -> list[str]:
        """Finish the open item (its ``done`` events)."""
        item, self._open = self._open, None
        if item is None:
            return []
        where = self._where(item)
        if item["type"] == "function_call":
            out = [self.event("response.function_call_arguments.done", **where, arguments=item["arguments"])]
        else:
            part = item["content"][0]
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            out = [self.event(done, **where, content_index=0, text=part["text"]),
                   self.event("response.content_part.done", **where, content_index=0, part=part)]
        return out + [self.event("response.output_item.done", output_index=where["output_index"], item=item)]

    def as_chat_message(self) -> dict:
        """The answer as the assistant turn of a chat conversation (for the next response)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        message: dict = {"role": "assistant", "content": text or None}
        calls = [i for i in self.items if i["type"] == "function_call"]
        if calls:
            message["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        return message
