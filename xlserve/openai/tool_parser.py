"""Tool-call parsers, chosen per model family from a registry.

A parser turns generated text into ``(content, tool_calls)``, whole or as streamed
deltas. Invariant: text that does not parse as a call is returned as content, so a
malformed call is never lost and never raises.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from xlserve.sampling_params import GuidedSpec


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser(ABC):
    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """Whole output -> (content or None, calls)."""

    @abstractmethod
    def feed(self, delta: str, final: bool = False) -> StreamDelta:
        """Streamed output, piece by piece; ``final`` flushes what is held back."""

    @abstractmethod
    def forced_call_grammar(self, tools: list[dict], name: str | None, parallel: bool) -> GuidedSpec:
        """A constraint that makes the model call a tool (``name``, or any of ``tools``);
        ``parallel`` allows several calls in a row."""


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen, many others)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def __init__(self):
        self._buffer = ""
        self._in_call = False

    @staticmethod
    def _call_from_json(body: str) -> ParsedToolCall | None:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                json.loads(args)
            except json.JSONDecodeError:
                return None
            return ParsedToolCall(obj["name"], args)
        return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def forced_call_grammar(self, tools, name, parallel):
        chosen = [t for t in tools if name is None or t["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": t["function"]["name"]},
                                 "arguments": t["function"].get("parameters") or {"type": "object"}}}
                 for t in chosen]
        schema = json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls})
        block = '"<tool_call>\\n" call "\\n</tool_call>"'
        more = f' ("\\n" {block})*' if parallel else ""
        lark = f"start: {block}{more}\ncall: %json {schema}\n"
        return GuidedSpec("lark", lark)

    def parse(self, text):
        if self.OPEN not in text:
            return text, []
        calls = [self._call_from_json(m.group(1)) for m in self._BLOCK.finditer(text)]
        if not calls or any(c is None for c in calls):
            return text, []  # malformed: keep it all as text
        content = text[: text.index(self.OPEN)].strip()
        return content or None, calls

    def feed(self, delta, final=False):
        self._buffer += delta
        out = StreamDelta()
        while True:
            if not self._in_call:
                i = self._buffer.find(self.OPEN)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self._buffer, self.OPEN)
                    out.content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                out.content += self._buffer[:i]
                self._buffer = self._buffer[i:]
                self._in_call = True
            j = self._buffer.find(self.CLOSE)
            if j < 0 and not final:
                return out
            end = len(self._buffer) if j < 0 else j + len(self.CLOSE)
            block = self._buffer[:end]
            call = self._call_from_json(block[len(self.OPEN): len(block) - (len(self.CLOSE) if j >= 0 else 0)])
            if call is None:
                out.content += block
            else:
                out.tool_calls.append(call)
            self._buffer = self._buffer[end:].lstrip("\n") if call else self._buffer[end:]
            self._in_call = False
            if final and not self._buffer:
                return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that starts ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


TOOL_PARSERS = {"hermes": HermesToolParser}


def get_tool_parser(name: str = "hermes") -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool parser {name!r} unknown; available: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


HERMES_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}}\n</tool_call>"
)
