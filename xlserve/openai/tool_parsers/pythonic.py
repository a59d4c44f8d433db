"""The pythonic format (Llama 3.2 / Llama 4, some small models): the answer is a Python
list of calls, ``[get_weather(city="Paris", unit='c'), get_time()]``, optionally inside
``<|python_start|>`` ... ``<|python_end|>``. Keyword values are Python literals; each
becomes JSON as soon as it is complete, so arguments stream one keyword at a time.
"""

from __future__ import annotations

import ast
import json
import re

from xlserve.openai.tool_parsers.base import CallState, Snapshot, ToolParser

_CALL = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_PARTIAL_START = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?")  # may still become ``[name(``
_OPEN = {"(": ")", "[": "]", "{": "}"}


def _top_level_parts(text: str, start: int) -> tuple[list[str], int | None]:
    """The comma-separated parts of the argument list opening at ``text[start]`` and the
    index past its ``)`` (None while it is open; then the last part is incomplete)."""
    parts, depth, quote, i, part_start = [], [], "", start, start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
        elif ch in "'\"":
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            i += len(quote) - 1
        elif ch in _OPEN:
            depth.append(_OPEN[ch])
        elif depth and ch == depth[-1]:
            depth.pop()
        elif not depth and ch in ",)":
            parts.append(text[part_start:i])
            part_start = i + 1
            if ch == ")":
                return [p for p in parts if p.strip()], i + 1
        i += 1
    parts.append(text[part_start:])
    return parts, None


def _keyword_json(part: str) -> str | None:
    """``name=literal`` as ``"name": json``; None if it is not one."""
    try:
        call = ast.parse(f"f({part.strip()})", mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(call, ast.Call) or call.args or len(call.keywords) != 1 or call.keywords[0].arg is None:
        return None
    keyword = call.keywords[0]
    try:
        value = ast.literal_eval(keyword.value)
    except ValueError:
        value = ast.unparse(keyword.value)  # a name or expression: passed on as its source text
    return f"{json.dumps(keyword.arg)}: {json.dumps(value, ensure_ascii=False)}"


class PythonicToolParser(ToolParser):
    name = "pythonic"
    template_markers = ("[func_name1(",)
    START, END = "<|python_start|>", "<|python_end|>"

    def scan(self, text, final):
        body = text.lstrip().removeprefix(self.START).lstrip()
        if not (body.startswith("[") and _CALL.match(body, 1)):
            undecided = not final and (self.START.startswith(body) or _PARTIAL_START.fullmatch(body))
            return Snapshot("" if undecided else text)
        snap, pos = Snapshot(), 1
        while (m := _CALL.match(body, pos)) is not None:
            parts, end = _top_level_parts(body, m.end())
            pieces = [_keyword_json(p) for p in (parts if end is not None else parts[:-1])]
            if None in pieces:
                break  # not a keyword argument: the list ends here
            snap.calls.append(CallState(m.group(1), "{" + ", ".join(pieces) + ("}" if end is not None else ""),
                                        done=end is not None))
            if end is None:
                break
            pos = end
            while body[pos:pos + 1] in (" ", ",", "\n"):
                pos += 1
        return snap if snap.calls or not final else Snapshot(text)
