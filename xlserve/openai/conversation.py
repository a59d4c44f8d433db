"""Chat messages -> prompt token ids, with tools rendered for templates that lack them."""

from __future__ import annotations

import json

from xlserve.loader.tokenizer import Tokenizer
from xlserve.openai.protocol import ChatMessage, Tool

# For chat templates that render no tools: the Hermes convention, which --tool-parser auto
# then reads back (templates without tool markers get the hermes parser).
HERMES_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}}\n</tool_call>"
)


def _arguments(raw: str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _message_dicts(messages: list[ChatMessage], native_tools: bool) -> list[dict]:
    out = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        entry = {"role": role, "content": m.text()}
        if m.name:
            entry["name"] = m.name  # rendered by templates that use it, ignored by the rest
        if m.role == "assistant" and m.tool_calls:
            if native_tools:
                entry["tool_calls"] = [{"type": "function", "id": c.id, "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                    for c in m.tool_calls]
            else:
                calls = "\n".join("<tool_call>\n" + json.dumps(
                    {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                    ensure_ascii=False) + "\n</tool_call>" for c in m.tool_calls)
                entry["content"] = (entry["content"] + "\n" + calls).strip()
        if m.role == "tool":
            if native_tools:
                entry["tool_call_id"] = m.tool_call_id
            else:  # Hermes convention for templates that know no tool role
                entry = {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
        out.append(entry)
    return out


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[ChatMessage], tools: list[Tool] | None) -> list[int]:
    native = tokenizer.chat_template.mentions_tools
    dicts = _message_dicts(messages, native)
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    if tool_dicts and not native:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tool_dicts)
        prompt = HERMES_TOOL_PROMPT.format(tools=listing)
        if dicts[0]["role"] == "system":
            dicts[0] = {**dicts[0], "content": dicts[0]["content"] + "\n\n" + prompt}
        else:
            dicts.insert(0, {"role": "system", "content": prompt})
        tool_dicts = None
    return tokenizer.encode_chat(dicts, tools=tool_dicts)
