"""An agentic multi-turn workload against an OpenAI-compatible server.

N sessions x T turns. Every session shares a large system prompt with tool definitions,
then works on a long context of its own; each turn asks for a short answer of exactly
``max_tokens`` tokens (``ignore_eos``), sends ``x-session-affinity``, and appends a new
short user message and the session's scripted tool call for that turn (a growing history).

Every setup sees the same requests: each session draws from its own generator, seeded by
the run's seed and its index (not one generator shared in whatever order the sessions'
turns interleave), and the history records the scripted answer, not the server's text, so
what a server answered does not change its later prompts. Measured per turn over the
streamed answer: TTFT, inter-token latencies, prompt / cached / completion tokens and cost.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from xlserve.openai.pricing import PriceTable
from xlserve.router.connections import sse_lines
from xlserve.router.pool import FOREIGN_LIMITS

TOOLS = [{"type": "function", "function": {
    "name": name, "description": desc,
    "parameters": {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
    for name, desc, arg in (("search_docs", "Search the project documentation", "query"),
                            ("read_file", "Read a file of the repository", "path"),
                            ("run_tests", "Run the test suite of a package", "package"),
                            ("open_issue", "Open an issue in the tracker", "title"))]
SYSTEM = ("You are a coding agent working in a large repository. Follow the team's rules: " +
          " ".join(f"Rule {i}: keep changes small, test them, and explain why in one line." for i in range(40)) +
          "\nTools:\n" + json.dumps(TOOLS))
ASKS = ["Find where the scheduler frees blocks.", "Which test covers preemption?", "Read the config module.",
        "Run the engine tests.", "Summarise what you found in one line.", "Open an issue for the flaky test."]


@dataclass
class TurnResult:
    ttft: float
    itls: list[float]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: float
    error: str | None = None


@dataclass
class WorkloadResult:
    turns: list[TurnResult] = field(default_factory=list)
    seconds: float = 0.0


async def stream_request(client: httpx.AsyncClient, url: str, path: str, body: dict,
                         headers: dict | None = None) -> tuple[TurnResult, str]:
    """POST one streamed request (chat or text completion) and time its chunks."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    stamps, text, usage, timings = [], "", {}, {}
    async with client.stream("POST", f"{url}{path}", json=body, headers=headers or {}) as r:
        if r.status_code != 200:
            return TurnResult(0, [], 0, 0, 0, 0, error=f"HTTP {r.status_code}"), ""
        async for line in sse_lines(r):
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return TurnResult(0, [], 0, 0, 0, 0, error=chunk["error"]["message"]), ""
            for c in chunk.get("choices", []):
                piece = c["delta"].get("content") if "delta" in c else c.get("text")
                if piece:
                    stamps.append(time.monotonic())
                    text += piece
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings  # llama-server reports its prompt-cache hits here
    ttft = (stamps[0] if stamps else time.monotonic()) - start
    itls = [b - a for a, b in zip(stamps, stamps[1:])]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", timings.get("cache_n", 0))
    return TurnResult(ttft, itls, usage.get("prompt_tokens", 0), cached,
                      usage.get("completion_tokens", 0), _cost(usage, cached)), text


def _cost(usage: dict, cached: int) -> float:
    """The server's price if it reports one; else the default price table on its token counts,
    so that servers without prices (peers) are priced alike."""
    if usage.get("cost"):
        return usage["cost"]["total"]
    return PriceTable().cost(usage.get("prompt_tokens", 0), cached, usage.get("completion_tokens", 0))["total"]


async def _turn(client: httpx.AsyncClient, url: str, model: str, messages: list, session: str,
                max_tokens: int) -> tuple[TurnResult, str]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return await stream_request(client, url, "/v1/chat/completions", body, {"x-session-affinity": session})


def session_turns(seed: int, i: int, turns: int) -> list[list[dict]]:
    """Session ``i``'s request messages, turn by turn: a function of the run's seed and the
    index alone (its own generator, string-seeded: the same draws in every process), so every
    server gets the same requests whatever it answered and however sessions interleave."""
    rng = random.Random(f"{seed}/{i}")
    # Each session works on its own file: a long per-session context after the shared system
    # prompt, so where a session's turns land decides what the cache holds.
    words = [rng.choice(("alloc", "block", "free", "queue", "hash", "token", "step", "cache", "pin",
                         "batch", "chunk", "evict")) + str(rng.randrange(1000)) for _ in range(400)]
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Here is the file for session {i}:\n" + " ".join(words)},
                {"role": "assistant", "content": "I have read the file."}]
    requests = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"[task {i}.{t}] {rng.choice(ASKS)}"})
        requests.append(list(messages))
        tool = rng.choice(TOOLS)["function"]  # the history records a scripted tool call as the answer
        arg = next(iter(tool["parameters"]["properties"]))
        call = {"name": tool["name"], "arguments": {arg: f"item{rng.randrange(1000)}"}}
        messages.append({"role": "assistant", "content": json.dumps(call)})
    return requests


async def run_agentic(url: str, sessions: int, turns: int, concurrency: int, max_tokens: int = 24,
                      seed: int = 0, progress=None) -> WorkloadResult:
    result = WorkloadResult()
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300, limits=FOREIGN_LIMITS) as client:  # any server: no reuse
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]

        async def session(i: int):
            async with gate:
                for messages in session_turns(seed, i, turns):
                    turn, _ = await _turn(client, url, model, messages, f"session-{i}", max_tokens)
                    result.turns.append(turn)
                    if progress is not None:
                        progress.update(1)
        start = time.monotonic()
        await asyncio.gather(*(session(i) for i in range(sessions)))
        result.seconds = time.monotonic() - start
    return result


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(result: WorkloadResult) -> dict:
    ok = [t for t in result.turns if t.error is None]
    ttft = [t.ttft for t in ok]
    itl = [x for t in ok for x in t.itls]
    prompt = sum(t.prompt_tokens for t in ok)
    return {"turns": len(result.turns), "errors": len(result.turns) - len(ok),
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9), "ttft_p99_s": _pct(ttft, 0.99),
            "itl_p50_s": _pct(itl, 0.5), "itl_p90_s": _pct(itl, 0.9), "itl_p99_s": _pct(itl, 0.99),
            "output_tok_s": sum(t.completion_tokens for t in ok) / result.seconds if result.seconds else None,
            "cache_hit_ratio": sum(t.cached_tokens for t in ok) / prompt if prompt else None,
            "cost_usd": sum(t.cost for t in ok)}
