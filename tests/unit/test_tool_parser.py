"""Hermes tool-call parsing, whole and streamed in arbitrary pieces; malformed calls stay text."""

import json

import pytest

from xlserve.openai.tool_parser import HermesToolParser, get_tool_parser

TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')


def _stream(text, size):
    parser = HermesToolParser()
    content, calls = "", []
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        delta = parser.feed(piece, final=(i == len(pieces) - 1))
        content += delta.content
        calls += delta.tool_calls
    return content, calls


def test_parse_whole():
    content, calls = HermesToolParser().parse(TWO_CALLS)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_pieces_give_the_same_calls(size):
    content, calls = _stream(TWO_CALLS, size)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


@pytest.mark.parametrize("text", [
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": "{broken"}\n</tool_call>',
    "plain answer with a < sign and <tool_c but no call",
])
def test_malformed_falls_back_to_text(text):
    content, calls = HermesToolParser().parse(text)
    assert calls == [] and content == text
    streamed, scalls = _stream(text, 3)
    assert scalls == [] and streamed == text


def test_forced_grammar_names_only_the_chosen_tool():
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "b"}}]
    spec = get_tool_parser("hermes").forced_call_grammar(tools, "b", parallel=False)
    assert spec.kind == "lark" and '"const": "b"' in spec.spec and '"const": "a"' not in spec.spec
    with pytest.raises(ValueError, match="not among the tools"):
        get_tool_parser("hermes").forced_call_grammar(tools, "zzz", parallel=False)
    with pytest.raises(ValueError, match="unknown"):
        get_tool_parser("nope")
