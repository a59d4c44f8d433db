"""Tool-call parsers by format name, and the format a model's chat template uses.

``--tool-parser auto`` (the default) picks the format from the chat template: the first
entry of ``TOOL_PARSERS`` whose ``template_markers`` all appear in it, else Hermes.
"""

from __future__ import annotations

from xlserve.openai.tool_parsers.base import ParsedToolCall, StreamDelta, ToolCallStream, ToolParser
from xlserve.openai.tool_parsers.delimited import DeepSeekV3ToolParser, DeepSeekV31ToolParser, KimiK2ToolParser
from xlserve.openai.tool_parsers.json_objects import HermesToolParser, Llama3JsonToolParser, MistralToolParser
from xlserve.openai.tool_parsers.pythonic import PythonicToolParser

# Most specific first: detection takes the first whose markers all appear in the template.
TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    KimiK2ToolParser, DeepSeekV3ToolParser, DeepSeekV31ToolParser, MistralToolParser, PythonicToolParser,
    Llama3JsonToolParser, HermesToolParser)}
AUTO = "auto"

__all__ = ["AUTO", "TOOL_PARSERS", "ParsedToolCall", "StreamDelta", "ToolCallStream", "ToolParser",
           "detect_tool_parser", "get_tool_parser"]


def detect_tool_parser(chat_template: str) -> str:
    for name, parser in TOOL_PARSERS.items():
        if parser.template_markers and all(m in chat_template for m in parser.template_markers):
            return name
    return HermesToolParser.name


def get_tool_parser(name: str, special_tokens: dict[str, int] | None = None) -> ToolParser:
    """``special_tokens``: the tokenizer's, for forced-call grammars (see ``ToolParser``)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool parser {name!r} unknown; available: {AUTO}, {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name](special_tokens)
