"""Chat templates: Jinja2 in a sandbox with the helpers Hugging Face templates expect."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no template: the ChatML layout most instruct models share.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _raise(message):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def read_chat_template(path: str) -> str:
    """The Jinja template in the file at ``path``, compiled once to check it."""
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the chat template {path}: {e.strerror}") from None
    try:
        _compile(source)
    except TemplateError as e:
        raise ValueError(f"the chat template {path} does not compile: {e}") from None
    return source


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        self.source = source or FALLBACK_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token

    @property
    def mentions_tools(self) -> bool:
        return "tools" in self.source

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **extra) -> str:
        try:
            return _compile(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except TemplateError as e:
            raise ValueError(f"chat template rejected the conversation: {e}") from e
