"""Formats whose calls are JSON objects ``{"name": ..., "arguments": {...}}``: Hermes
(``<tool_call>`` blocks; Qwen and many others), Llama 3 JSON (``parameters``, ``;``
between calls) and Mistral (``[TOOL_CALLS]`` then a JSON array).

Arguments stream as the model writes them once the name is known and the arguments
object has begun (``"name"`` first, the usual order); any other shape is read when its
object is complete.
"""

from __future__ import annotations

import json
import re

from xlserve.openai.tool_parsers.base import CallState, Snapshot, ToolParser, held_back, lark_literal

_NAME_THEN_ARGS = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_CLOSERS = {"{": "}", "[": "]"}


def json_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array opening at ``text[start]``, or None while
    it is incomplete."""
    stack, in_string, escaped = [], False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in _CLOSERS:
            stack.append(_CLOSERS[ch])
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                return i + 1  # unbalanced: end here, json.loads will refuse it
            if not stack:
                return i + 1
    return None


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def json_call(segment: str, complete: bool) -> CallState | None:
    """The call in ``segment`` (which starts with ``{``): streaming while ``complete`` is
    False where the name comes first; None while it is not (yet) a call."""
    m = _NAME_THEN_ARGS.match(segment)
    if m and segment[m.end():m.end() + 1] == "{":
        end = json_end(segment, m.end())
        return CallState(json.loads(m.group(1)), segment[m.end():end or len(segment)], done=end is not None)
    if not complete:
        return None
    try:
        obj = json.loads(segment)
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
        return CallState(obj["name"], args, done=True)
    return CallState(obj["name"], json.dumps(args, ensure_ascii=False), done=True)


def json_call_rule(name: str, schema: str, args_key: str = "arguments") -> str:
    head = lark_literal(f'{{"name": {json.dumps(name)}, "{args_key}": ')
    return f"{head} %json {schema} \"}}\""


class HermesToolParser(ToolParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, repeated."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    template_markers = (OPEN,)

    def scan(self, text, final):
        snap, pos = Snapshot(), 0
        while True:
            start = text.find(self.OPEN, pos)
            gap = text[pos:] if start < 0 else text[pos:start]
            gap = held_back(gap, (self.OPEN,), final or start >= 0)
            snap.content += gap if not snap.calls else gap.strip()
            if start < 0:
                return snap
            body = skip_space(text, start + len(self.OPEN))
            close = text.find(self.CLOSE, body)
            call = json_call(text[body:len(text) if close < 0 else close].rstrip(), complete=close >= 0)
            if call is not None:
                snap.calls.append(call)
            elif close >= 0:  # a closed block that is no call: its text is content
                snap.content += text[start:close + len(self.CLOSE)]
            if close < 0:
                return snap
            pos = close + len(self.CLOSE)

    def call_rule(self, name, schema):
        open_, close = self.lit(self.OPEN + "\n"), self.lit("\n" + self.CLOSE)
        return f"{open_} {json_call_rule(name, schema)} {close}"


class _JsonListParser(ToolParser):
    """Calls as JSON objects after an optional ``prefix``: ``begin`` opens the list (a
    Mistral array, or nothing), ``sep`` parts the calls."""

    prefixes: tuple[str, ...] = ()
    begin, sep = "", ";"
    args_key = "arguments"

    def _start(self, text: str, final: bool) -> tuple[str, int] | None:
        """(content before the calls, where the calls begin), or None: no calls in ``text``."""
        raise NotImplementedError

    def scan(self, text, final):
        found = self._start(text, final)
        if found is None:
            return Snapshot(held_back(text, self.prefixes, final))
        snap, pos = Snapshot(found[0]), found[1]
        while True:
            pos = skip_space(text, pos)
            if text[pos:pos + 1] != "{":
                break
            end = json_end(text, pos)
            call = json_call(text[pos:end or len(text)], complete=end is not None)
            if call is None:
                break
            snap.calls.append(call)
            if end is None:
                return snap
            pos = skip_space(text, end)
            if text[pos:pos + len(self.sep)] != self.sep:
                break
            pos += len(self.sep)
        rest = text[pos:].strip()
        if final and rest not in ("", "]") and rest[0] not in "{[":
            snap.content += rest  # what follows the calls and is not one (a call cut short is dropped)
        return snap

    def call_rule(self, name, schema):
        return json_call_rule(name, schema, self.args_key)


class Llama3JsonToolParser(_JsonListParser):
    """Llama 3.1-3.3: the answer is ``{"name": ..., "parameters": {...}}`` (``;`` between
    calls), optionally after ``<|python_tag|>``; any other answer is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    template_markers = prefixes = (TAG,)
    args_key, sep, separator = "parameters", ";", "; "

    def _start(self, text, final):
        pos = skip_space(text, 0)
        tagged = text.startswith(self.TAG, pos)
        if tagged:
            pos = skip_space(text, pos + len(self.TAG))
        if tagged and pos == len(text) and not final:
            return "", pos  # the tag says calls follow
        if text[pos:pos + 1] != "{":
            return None
        end = json_end(text, pos)
        if not final or json_call(text[pos:end or len(text)], complete=end is not None):
            return "", pos
        return None


class MistralToolParser(_JsonListParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after optional content."""

    name = "mistral"
    MARK = "[TOOL_CALLS]"
    template_markers = prefixes = (MARK,)
    sep, separator, calls_end = ",", ", ", "]"
    calls_begin = MARK + "["

    def _start(self, text, final):
        at = text.find(self.MARK)
        if at < 0:
            return None
        pos = skip_space(text, at + len(self.MARK))
        return text[:at], pos + (text[pos:pos + 1] == "[")
