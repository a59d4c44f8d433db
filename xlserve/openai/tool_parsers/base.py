"""What every tool-call parser shares: the snapshot contract and the streamer that turns
snapshots into OpenAI deltas.

A parser reads the whole output so far (``scan``) as content plus calls. Invariant: scans
of a growing text only extend — content and each call's arguments grow, calls are only
added, and a call appears once its whole name is known — so the streamer sends each piece
once, in order: the first delta of a call carries its name, later ones append argument
text, and the pieces concatenate to what a single scan of the whole output gives. Text
that cannot be a call is content: a malformed call is never lost and never raises.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from xlserve.json_schema import JSON_LAYOUT, closed_objects
from xlserve.markers import pending_marker_length
from xlserve.sampling_params import GuidedSpec


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallState:
    """One call as far as the output shows it."""
    name: str
    arguments: str  # JSON text so far; complete (parseable) once ``done``
    done: bool = False
    id: str | None = None  # the id the model gave (Kimi K2's ``functions.name:0``), if any


@dataclass
class Snapshot:
    content: str = ""
    calls: list[CallState] = field(default_factory=list)


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallDelta:
    """A piece of call ``index``: its first piece has ``id`` and ``name``."""
    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        function = {"arguments": self.arguments}
        if self.name is None:
            return {"index": self.index, "function": function}
        return {"index": self.index, "id": self.id, "type": "function", "function": {"name": self.name, **function}}


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ToolParser(ABC):
    """A tool-call format. Subclasses implement ``scan`` (see the module docstring) and,
    where the format allows, ``call_rule`` for forced calls."""

    name = ""
    template_markers: tuple[str, ...] = ()  # all present in a chat template: it uses this format
    separator = "\n"  # between parallel forced calls
    calls_begin = calls_end = ""  # around all of them

    @abstractmethod
    def scan(self, text: str, final: bool) -> Snapshot:
        """The output so far as content and calls; ``final``: nothing more will come (hold
        nothing back for a marker that might still be completing)."""

    def call_rule(self, name: str, schema: str) -> str:
        """A Lark expression for one call of ``name`` with arguments matching the JSON
        ``schema``; ``calls_rule`` arranges them."""
        raise ValueError(f"a forced tool call (tool_choice 'required' or a named tool) is not available with "
                         f"the {self.name} tool-call format; use tool_choice 'auto'")

    def __init__(self, special_tokens: dict[str, int] | None = None):
        """``special_tokens``: the tokenizer's special tokens (text -> id). A forced call's
        grammar names them by id: a special token has no spelling in ordinary tokens, so a
        quoted marker would make the model spell it out instead."""
        self.special_tokens = special_tokens or {}

    def lit(self, text: str) -> str:
        """``text`` as a Lark expression: special tokens by id, the rest as strings."""
        if not text:
            return '""'
        parts, pos = [], 0
        while pos < len(text):
            hits = [(text.find(t, pos), t) for t in self.special_tokens if text.find(t, pos) >= 0]
            at, token = min(hits, key=lambda h: (h[0], -len(h[1]))) if hits else (len(text), "")
            if at > pos:
                parts.append(lark_literal(text[pos:at]))
            if token:
                parts.append(f"<[{self.special_tokens[token]}]>")
            pos = at + len(token)
        return " ".join(parts)

    def calls_rule(self, parallel: bool) -> str:
        """The Lark start rule around the ``call`` rule: one call, or several in a row."""
        more = f" ({self.lit(self.separator)} call)*" if parallel else ""
        begin = f"{self.lit(self.calls_begin)} " if self.calls_begin else ""
        end = f" {self.lit(self.calls_end)}" if self.calls_end else ""
        return f"start: {begin}call{more}{end}"

    def forced_call_grammar(self, tools: list[dict], name: str | None, parallel: bool) -> GuidedSpec:
        """A constraint that makes the model call a tool (``name``, or any of ``tools``);
        ``parallel`` allows several calls in a row."""
        chosen = [t for t in tools if name is None or t["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        calls = [self.call_rule(t["function"]["name"], json.dumps({**closed_objects(t["function"].get("parameters") or {
            "type": "object"}), "x-guidance": dict(JSON_LAYOUT)})) for t in chosen]
        return GuidedSpec("lark", f"{self.calls_rule(parallel)}\ncall: {' | '.join(calls)}\n")

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """The whole output -> (content or None, calls), exactly what streaming it gives."""
        stream = ToolCallStream(self)
        stream.feed(text, final=True)
        return stream.content.strip() or None, stream.calls()


class ToolCallStream:
    """Feeds one choice's output to a parser and sends each new piece once."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.content = ""
        self.sent: list[CallState] = []  # what each call's deltas added up to

    def feed(self, delta: str, final: bool = False) -> StreamDelta:
        self.text += delta
        snap = self.parser.scan(self.text, final)
        out = StreamDelta(snap.content[len(self.content):] if snap.content.startswith(self.content) else "")
        self.content += out.content
        for index, call in enumerate(snap.calls):
            if index == len(self.sent):
                taken = call.id is None or any(c.id == call.id for c in self.sent)
                self.sent.append(CallState(call.name, "", id=new_call_id() if taken else call.id))
                out.calls.append(CallDelta(index, id=self.sent[index].id, name=call.name))
            sent = self.sent[index]
            if len(call.arguments) > len(sent.arguments) and call.arguments.startswith(sent.arguments):
                piece = call.arguments[len(sent.arguments):]
                if out.calls and out.calls[-1].index == index:
                    out.calls[-1].arguments += piece
                else:
                    out.calls.append(CallDelta(index, piece))
                sent.arguments = call.arguments
            sent.done = call.done
        return out

    def calls(self) -> list[ParsedToolCall]:
        return [ParsedToolCall(c.name, c.arguments, c.id) for c in self.sent]


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def held_back(text: str, markers: tuple[str, ...], final: bool) -> str:
    """``text`` without a tail that may still become one of ``markers``."""
    return text if final else text[: len(text) - pending_marker_length(text, markers)]
