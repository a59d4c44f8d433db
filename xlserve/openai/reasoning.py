"""Reasoning output: the ``<think>`` ... ``</think>`` part of an answer goes to
``reasoning_content``, the rest to ``content``, streamed as it is generated (Qwen3,
DeepSeek-R1, Kimi K2 thinking and others).

Where the prompt already opened the block (a chat template that ends the generation
prompt with ``<think>``, as DeepSeek-R1's does), the answer starts inside it.
"""

from __future__ import annotations

from xlserve.openai.tool_parsers.base import held_back

OPEN, CLOSE = "<think>", "</think>"
MODES = ("auto", "think", "none")  # auto: think where the chat template mentions <think>


def reasoning_enabled(mode: str, chat_template: str) -> bool:
    if mode not in MODES:
        raise ValueError(f"reasoning parser {mode!r} unknown; available: {', '.join(MODES)}")
    return mode == "think" or (mode == "auto" and OPEN in chat_template)


def starts_inside(prompt_text: str) -> bool:
    """The generation prompt left a ``<think>`` block open."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN) or tail.rfind(OPEN) > tail.rfind(CLOSE)


class ReasoningStream:
    """Splits one choice's output; ``feed`` returns the new (reasoning, content) pieces."""

    def __init__(self, inside: bool):
        self.inside = inside
        self.text = ""
        self.sent = ("", "")

    def scan(self, final: bool) -> tuple[str, str]:
        text = self.text
        if not self.inside:
            body = text.lstrip()
            if not body.startswith(OPEN):
                undecided = not final and OPEN.startswith(body)
                return "", "" if undecided else text
            text = body[len(OPEN):]
        end = text.find(CLOSE)
        if end < 0:
            return held_back(text, (CLOSE,), final).lstrip(), ""
        return text[:end].strip(), text[end + len(CLOSE):].lstrip()

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        now = self.scan(final)
        pieces = tuple(new[len(old):] if new.startswith(old) else "" for new, old in zip(now, self.sent))
        self.sent = tuple(old + piece for old, piece in zip(self.sent, pieces))
        return pieces
