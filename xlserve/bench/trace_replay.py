"""Replay of the public Mooncake conversation trace against an OpenAI-compatible server.

The trace has lengths and 512-token block ids, no text. A replay samples whole
conversations (requests that share their first block after the system prompt, in trace
order), so that the trace's prefix reuse survives the cut; maps every block id to a fixed
random block of token ids (same id, same tokens); scales lengths and arrival times down to
fit a small machine; and sends each request at its scaled arrival time (open loop), as a
streamed text completion on token ids, with the conversation as ``x-session-affinity``.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import time
from collections import defaultdict
from dataclasses import dataclass

import httpx

from xlserve.bench.agentic import WorkloadResult, stream_request
from xlserve.router.pool import FOREIGN_LIMITS

TRACE_BLOCK_TOKENS = 512
DEFAULT_TRACE = os.path.join(os.path.dirname(__file__), "traces", "mooncake_conversation_trace.jsonl.gz")
TOKEN_RANGE = (256, 40000)  # ordinary tokens of the default vocabulary; no special tokens


@dataclass(frozen=True)
class TraceReplay:
    path: str = DEFAULT_TRACE
    requests: int = 40  # how many trace requests to send (whole conversations until reached)
    length_scale: float = 1 / 32  # trace tokens -> replayed tokens (512-token blocks -> 16)
    duration_s: float = 40.0  # the sampled arrivals are squeezed into this many seconds
    max_prompt_tokens: int = 4000
    seed: int = 0
    min_turns: int = 1  # only conversations of at least this many requests (sessions that come back)

    def __post_init__(self):
        if self.requests < 1:
            raise ValueError(f"requests must be at least 1; got {self.requests}")
        if not 0 < self.length_scale <= 1:
            raise ValueError(f"length_scale must be in (0, 1]; got {self.length_scale}")
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be positive; got {self.duration_s}")
        if self.min_turns < 1:
            raise ValueError(f"min_turns must be at least 1; got {self.min_turns}")
        if TRACE_BLOCK_TOKENS * self.length_scale < 1:
            raise ValueError(f"length_scale {self.length_scale} leaves less than one token per trace block")


@dataclass(frozen=True)
class ReplayRequest:
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int
    conversation: int


def load_trace(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def sample_conversations(rows: list[dict], requests: int, seed: int, min_turns: int = 1) -> list[int]:
    """Indices of whole conversations (of ``min_turns`` requests or more) picked at random until
    ``requests`` rows, in trace order."""
    conversations: dict[int, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        ids = row["hash_ids"]
        conversations[ids[1] if len(ids) > 1 else -1 - i].append(i)
    keys = [key for key, turns in conversations.items() if len(turns) >= min_turns]
    random.Random(seed).shuffle(keys)
    picked: list[int] = []
    for key in keys:
        if len(picked) >= requests:
            break
        picked += conversations[key][:requests - len(picked)]
    return sorted(picked)


def build_requests(rows: list[dict], replay: TraceReplay) -> tuple[list[ReplayRequest], dict]:
    picked = sample_conversations(rows, replay.requests, replay.seed, replay.min_turns)
    block = max(1, round(TRACE_BLOCK_TOKENS * replay.length_scale))
    blocks: dict[int, list[int]] = {}

    def tokens_of(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            rng = random.Random(hash_id * 1_000_003 + replay.seed)
            blocks[hash_id] = [rng.randrange(*TOKEN_RANGE) for _ in range(block)]
        return blocks[hash_id]

    t0 = rows[picked[0]]["timestamp"] / 1000
    span = max(rows[picked[-1]]["timestamp"] / 1000 - t0, 1e-9)
    time_scale = min(1.0, replay.duration_s / span)
    out = []
    for i in picked:
        row = rows[i]
        length = min(replay.max_prompt_tokens, max(1, round(row["input_length"] * replay.length_scale)))
        ids = [t for h in row["hash_ids"] for t in tokens_of(h)][:length]
        out.append(ReplayRequest((row["timestamp"] / 1000 - t0) * time_scale, ids,
                                 max(1, round(row["output_length"] * replay.length_scale)),
                                 row["hash_ids"][1] if len(row["hash_ids"]) > 1 else -1 - i))
    scale = {"requests": len(out), "of": len(rows), "length_scale": replay.length_scale,
             "time_scale": time_scale, "trace_span_s": span, "replay_span_s": span * time_scale,
             "mean_prompt_tokens": sum(len(r.prompt_token_ids) for r in out) / len(out)}
    return out, scale


def describe(scale: dict) -> str:
    return (f"trace replay: {scale['requests']} of {scale['of']:,} requests (whole conversations), "
            f"lengths x{scale['length_scale']:.4g} (mean prompt {scale['mean_prompt_tokens']:.0f} tokens), "
            f"time x{scale['time_scale']:.4g} ({scale['trace_span_s']:.0f} s of trace in "
            f"{scale['replay_span_s']:.0f} s)")


async def run_trace(url: str, requests: list[ReplayRequest], progress=None) -> WorkloadResult:
    result = WorkloadResult()
    async with httpx.AsyncClient(timeout=600, limits=FOREIGN_LIMITS) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        start = time.monotonic()

        async def send(req: ReplayRequest):
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.monotonic()))
            body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
                    "temperature": 0, "ignore_eos": True}
            turn, _ = await stream_request(client, url, "/v1/completions", body,
                                           {"x-session-affinity": f"conversation-{req.conversation}"})
            result.turns.append(turn)
            if progress is not None:
                progress.update(1)
        await asyncio.gather(*(send(r) for r in requests))
        result.seconds = time.monotonic() - start
    return result
