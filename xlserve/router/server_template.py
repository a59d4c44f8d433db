"""A foreign server's chat template, rendered by that server (``--tokenize-with URL``).

The router counts a chat's tokens with its own copy of the model's tokenizer and template;
where a server renders chats with another template (its own ``--chat-template``, a builtin
one), those counts drift from what the server computes and caches. The server then renders
the chat (llama-server: ``/apply-template``; vLLM: ``/tokenize`` with messages, whose ids are
spelled back as text) and the router tokenizes that text with the model's vocabulary.
Rendering runs on the preprocessor's threads, so the blocking call never stalls the loop.
"""

from __future__ import annotations

import json

import httpx

from xlserve.loader.chat_template import ChatTemplate
from xlserve.loader.tokenizer import Tokenizer
from xlserve.openai.errors import ApiError
from xlserve.router.connections import fetch

RENDER_TIMEOUT_S = 10.0


class ServerChatTemplate(ChatTemplate):
    def __init__(self, url: str, headers: dict, tokenizer: Tokenizer):
        local = tokenizer.chat_template
        super().__init__(local.source, local.bos_token, local.eos_token)
        self.url, self.headers, self.tokenizer = url, headers, tokenizer
        self.flavor: str | None = None  # "apply-template" or "tokenize", found on first use

    @property
    def mentions_tools(self) -> bool:
        return True  # tools go to the server as the request carries them: its template places them

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **extra) -> str:
        body = {"messages": messages, **({"tools": tools} if tools else {})}
        for flavor in ([self.flavor] if self.flavor else ["apply-template", "tokenize"]):
            text = self._ask(flavor, body, add_generation_prompt)
            if text is not None:
                self.flavor = flavor
                return text
        raise ApiError(503, f"{self.url} renders no chats (neither /apply-template nor /tokenize with messages)")

    def _ask(self, flavor: str, body: dict, add_generation_prompt: bool) -> str | None:
        path = "/apply-template" if flavor == "apply-template" else "/tokenize"
        payload = body if flavor == "apply-template" else {**body, "add_generation_prompt": add_generation_prompt}
        try:
            status, body = fetch("POST", f"{self.url}{path}", json=payload, headers=self.headers,
                                 timeout=RENDER_TIMEOUT_S)
        except httpx.HTTPError as e:
            raise ApiError(503, f"{self.url} could not render the chat: {type(e).__name__}") from e
        if status == 400:
            raise ValueError(f"{self.url} rejected the conversation: {body[:200].decode('utf-8', 'replace')}")
        answer = json.loads(body) if status == 200 else {}
        if isinstance(answer.get("prompt"), str):
            return answer["prompt"]
        tokens = answer.get("tokens")
        if isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens):
            return self.tokenizer.decode(tokens, skip_special_tokens=False)
        return None


def render_on_server(tokenizer: Tokenizer, url: str, headers: dict) -> None:
    """From now on ``tokenizer`` renders chats on ``url``."""
    tokenizer.chat_template = ServerChatTemplate(url, headers, tokenizer)
