"""Clients that keep a server busy for as long as a test runs, and record every outcome.

``Load`` is the plain kind (one short chat per loop, a deadline each); ``AgenticLoad`` the
soak's kind: sessions that share system prompts and grow turn by turn, mixed lengths,
streamed and not, and a share of clients that disconnect mid-stream or abort.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass

import httpx

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6}


@dataclass(frozen=True)
class Outcome:
    client: int
    start: float
    end: float
    result: str  # "ok", "aborted" (the client left on purpose), an HTTP status or an httpx error name


class Load:
    """``clients`` threads sending chat requests in a loop, each with a deadline of
    ``DEADLINE_S``; every outcome is kept."""
    DEADLINE_S = 30

    def __init__(self, url: str, clients: int = 3, headers: dict | None = None):
        self.url, self.headers, self.stop, self.outcomes = url, headers or {}, threading.Event(), []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _loop(self, client: int) -> None:
        rng = random.Random(client)
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                result = self.request(client, rng)
            except httpx.HTTPError as e:
                result = type(e).__name__
            self.outcomes.append(Outcome(client, start, time.monotonic(), result))
            time.sleep(self.pause_after(client, result))

    def pause_after(self, client: int, result: str) -> float:
        """Seconds a client waits before its next request."""
        return 0.0 if result in ("ok", "aborted") else 0.2

    def request(self, client: int, rng: random.Random) -> str:
        r = httpx.post(f"{self.url}/v1/chat/completions", timeout=self.DEADLINE_S, headers=self.headers,
                       json={**CHAT, "max_tokens": 12, "stream": bool(client % 2)})
        return result_of(r)

    def finish(self) -> list[Outcome]:
        self.stop.set()
        for t in self.threads:
            t.join(self.DEADLINE_S + 10)
        return self.outcomes


SYSTEM_PROMPTS = [
    "You are a coding agent. Use the tools you are given; answer briefly. " * 6,
    "You are a support agent for a train company. Be polite and exact. " * 4,
    "You summarise documents for busy readers in one or two sentences. " * 5,
]
QUESTIONS = ["Name a color.", "What is 7 times 8?", "Say hello in French.", "Give me a prime number.",
             "Name a river in Europe and its country.", "Write one line about the sea."]


class AgenticLoad(Load):
    """Sessions of growing conversations on shared system prompts (``x-session-affinity``
    per session), answer lengths from 1 to 48 tokens, half streamed; every 10th request is
    a stream the client drops after two chunks, every 10th (another) a request cut off by a
    client timeout of 0.3 s. A session starts again after 6 turns."""

    def __init__(self, url: str, clients: int = 3, headers: dict | None = None):
        self.sessions = {i: {"turns": [], "n": 0} for i in range(clients)}
        super().__init__(url, clients, headers)

    def request(self, client: int, rng: random.Random) -> str:
        state = self.sessions[client]
        if len(state["turns"]) >= 12:
            state["turns"], state["n"] = [], state["n"] + 1
        system = SYSTEM_PROMPTS[(client + state["n"]) % len(SYSTEM_PROMPTS)]
        messages = [{"role": "system", "content": system}, *state["turns"],
                    {"role": "user", "content": rng.choice(QUESTIONS)}]
        body = {"model": MODEL, "messages": messages, "max_tokens": rng.choice((1, 4, 16, 48)),
                "stream": rng.random() < 0.5}
        headers = {**self.headers, "x-session-affinity": f"client{client}-session{state['n']}"}
        kind = rng.random()
        if kind < 0.1:
            return self._disconnect_mid_stream({**body, "stream": True, "max_tokens": 48}, headers)
        timeout = 0.3 if kind < 0.2 else self.DEADLINE_S
        try:
            r = httpx.post(f"{self.url}/v1/chat/completions", json=body, headers=headers, timeout=timeout)
        except httpx.TimeoutException:
            if timeout < self.DEADLINE_S:
                return "aborted"
            raise
        if result_of(r) != "ok":
            return result_of(r)
        answer = _answer_text(r.text, body["stream"])
        state["turns"] += [messages[-1], {"role": "assistant", "content": answer}]
        return "ok"

    def _disconnect_mid_stream(self, body: dict, headers: dict) -> str:
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, headers=headers,
                          timeout=self.DEADLINE_S) as r:
            if r.status_code != 200:
                return f"{r.status_code}"
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3:
                    break
        return "aborted"


def result_of(r: httpx.Response) -> str:
    """"ok", the status of an error answer, or "200 error: ..." for a stream that ended in an
    error event (what the model wrote is not looked at)."""
    if r.status_code != 200:
        return f"{r.status_code}"
    for line in r.text.splitlines() if r.text.startswith("data:") else []:
        if line.startswith("data: {") and "error" in (event := json.loads(line[6:])):
            return f"200 error: {str(event['error'].get('message'))[:120]}"
    return "ok"


def _answer_text(text: str, streamed: bool) -> str:
    if not streamed:
        return json.loads(text)["choices"][0]["message"]["content"] or ""
    parts = []
    for line in text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)
