"""Formats that wrap each call in special tokens, the arguments raw JSON between two of
them: Kimi K2 and DeepSeek-V3 / V3.1 — the models this stack is for. Arguments stream as
written; only a tail that may be the start of the closing marker is held back.
"""

from __future__ import annotations

import re

from xlserve.openai.tool_parsers.base import CallState, Snapshot, ToolParser, held_back


class DelimitedToolParser(ToolParser):
    """``section`` ... ``call``HEADER``args``ARGUMENTS``end`` (repeated) ... ``section_end``;
    ``_name(header)`` reads the name (and id) from the header."""

    section = section_end = call = args = end = ""

    @property
    def calls_begin(self) -> str:  # forced calls open and close the section as the model does
        return self.section

    @property
    def calls_end(self) -> str:
        return self.section_end

    def _name(self, header: str) -> tuple[str, str | None] | None:
        raise NotImplementedError

    def scan(self, text, final):
        opens = [i for i in (text.find(self.section), text.find(self.call)) if i >= 0]
        if not opens:
            return Snapshot(held_back(text, (self.section, self.call), final))
        first = min(opens)
        snap, pos = Snapshot(text[:first]), first
        if text.startswith(self.section, pos):
            pos += len(self.section)
        while (start := text.find(self.call, pos)) >= 0:
            head_end = text.find(self.args, start + len(self.call))
            named = self._name(text[start + len(self.call):head_end].strip()) if head_end >= 0 else None
            if named is None:  # the header is still coming (or was cut short: dropped), or names no call
                if head_end >= 0:
                    snap.content += text[start if snap.calls else first:]
                return snap
            body = head_end + len(self.args)
            close = text.find(self.end, body)
            arguments = text[body:close] if close >= 0 else held_back(text[body:], (self.end,), final)
            snap.calls.append(CallState(named[0], arguments.lstrip(), done=close >= 0, id=named[1]))
            if close < 0:
                return snap
            pos = close + len(self.end)
        rest = held_back(text[pos:].replace(self.section_end, ""), (self.call, self.section_end), final).strip()
        snap.content += rest  # text after the calls
        return snap

    def call_rule(self, name, schema):
        return f"{self.lit(self.call + self._header(name) + self.args)} %json {schema} {self.lit(self.end)}"

    def _header(self, name: str) -> str:
        return name


class KimiK2ToolParser(DelimitedToolParser):
    """``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>
    {...}<|tool_call_end|><|tool_calls_section_end|>``; the id is ``functions.NAME:0``."""

    name = "kimi_k2"
    template_markers = ("<|tool_call_begin|>",)
    section, section_end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    call, args, end = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    separator = ""
    _ID = re.compile(r"(?:functions\.)?([\w.\-]+):\d+")

    def _name(self, header):
        m = self._ID.fullmatch(header)
        return (m.group(1), header) if m else None

    def _header(self, name):
        return f"functions.{name}:0"


class DeepSeekV3ToolParser(DelimitedToolParser):
    """``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>``."""

    name = "deepseek_v3"
    template_markers = ("<｜tool▁call▁begin｜>", "```json")
    section, section_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call, args, end = "<｜tool▁call▁begin｜>", "\n```json\n", "\n```<｜tool▁call▁end｜>"
    SEP = "<｜tool▁sep｜>"

    def _name(self, header):
        kind, sep, name = header.partition(self.SEP)
        return (name.strip(), None) if sep and kind.strip() == "function" and name.strip() else None

    def _header(self, name):
        return f"function{self.SEP}{name}"


class DeepSeekV31ToolParser(DelimitedToolParser):
    """DeepSeek-V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``."""

    name = "deepseek_v31"
    template_markers = ("<｜tool▁call▁begin｜>",)
    section, section_end = DeepSeekV3ToolParser.section, DeepSeekV3ToolParser.section_end
    call, args, end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    separator = ""

    def _name(self, header):
        return (header, None) if header and self.args not in header else None
