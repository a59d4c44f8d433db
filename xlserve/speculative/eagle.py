"""EAGLE-style proposals (``--speculative eagle``): a one-layer head on the target's own
hidden states (``speculative/eagle_head.py``) guesses k tokens, each from the state it
predicted for the token before.

The engine hands the proposer the target's hidden state of every position it confirms
(``observe``: a prompt chunk's every row, a checking step's accepted rows). The head keeps
its own keys and values per request for the positions whose state it got from the target;
a proposal first runs the head over the states that arrived since the last one (batched
over the step's requests), then guesses, writing the guesses' keys past the confirmed ones
(overwritten by the next catch-up, so a rejected guess leaves nothing behind). Where the
head got no state (a prefix-cache hit, a request handed over by a prefill worker), its
cache starts at the first position it did get: it attends over less, the output is the
target's either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from xlserve.speculative.eagle_head import EagleHead
from xlserve.speculative.proposer import Proposer

SHIPPED = Path(__file__).parent / "heads"
# A guess the head gives less than this probability is not proposed, nor any after it: a
# guess costs about 4% of a default-model decode step and its checking row as much again,
# so one right less than a third of the time does not pay for itself.
MIN_CONFIDENCE = 0.3
# the default model's head: ``xlserve train-eagle --out <this path>`` (its defaults), 365 s on
# 2 cores; held-out top-1 0.68 / 0.68 / 0.67 at guess depths 1-3 (docs/benchmarks.md)
DEFAULT_HEAD = SHIPPED / "smollm2-135m-instruct.eagle.safetensors"


@dataclass
class HeadCache:
    """The head's keys and values of one request: positions ``first .. first + length``
    confirmed; guesses are written after them and not counted."""
    first: int = 0
    length: int = 0
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, target states)
    last_state: torch.Tensor | None = None  # the head's prediction after the last confirmed position

    def begin(self, position: int) -> None:
        """Confirmed states arrive from ``position``: keep what precedes it, or start over
        there if the cache does not reach it."""
        if self.first <= position <= self.first + self.length and self.keys is not None:
            self.length = position - self.first
        else:
            self.first, self.length = position, 0

    def write(self, at: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys and values at cache rows ``at ..`` (grown by doubling)."""
        end = at + keys.shape[0]
        if self.keys is None or end > self.keys.shape[0]:
            size = max(end, 2 * (0 if self.keys is None else self.keys.shape[0]), 64)
            grown_k = keys.new_empty((size, *keys.shape[1:]))
            grown_v = values.new_empty((size, *values.shape[1:]))
            if self.keys is not None:
                grown_k[:self.length], grown_v[:self.length] = self.keys[:self.length], self.values[:self.length]
            self.keys, self.values = grown_k, grown_v
        self.keys[at:end], self.values[at:end] = keys, values


class EagleProposer(Proposer):
    name = "eagle"
    wants_hidden = True

    def __init__(self, config, loaded):
        if config.parallel.world_size > 1:
            raise ValueError("--speculative eagle runs on one process; use ngram or suffix with tensor or pipeline "
                             "parallelism")
        path = config.speculative.eagle_head or _default_head(config)
        self.head = EagleHead.load(path, loaded.dtype, loaded.device)
        self.head.config.check_target(loaded.arch)
        self.head.bind_target(loaded.model)
        self.embed = loaded.model.model.embed_tokens
        self.caches: dict[str, HeadCache] = {}

    @classmethod
    def create(cls, config, loaded) -> EagleProposer:
        return cls(config, loaded)

    def observe(self, request_id: str, position: int, states: torch.Tensor) -> None:
        """The target's states from ``position`` on replace any pending ones from there (a
        recomputed request); pending states that do not reach ``position`` are dropped."""
        cache = self.caches.setdefault(request_id, HeadCache())
        kept = [(p, rows[:position - p]) for p, rows in cache.pending if p < position]
        if kept and kept[-1][0] + kept[-1][1].shape[0] != position:
            kept = []
        cache.pending = kept + [(position, states.clone())]  # the step's buffer may be reused

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        return self.propose_all([(request_id, tokens, k)])[0]

    @torch.inference_mode()
    def propose_all(self, asks: list[tuple[str, list[int], int]]) -> list[list[int]]:
        live = [(rid, tokens, k) for rid, tokens, k in asks if k > 0 and self._caught_up_to(rid) == len(tokens) - 2]
        out: dict[str, list[int]] = {rid: [] for rid, _, _ in asks}
        if not live:
            return [out[rid] for rid, _, _ in asks]
        state = self._catch_up(live)  # the predicted state after each request's last token
        positions = torch.tensor([len(tokens) - 1 for _, tokens, _ in live])  # where each next guess sits
        active = list(range(len(live)))  # the rows of ``live`` still guessing, aligned with ``state``
        for step in range(max(k for _, _, k in live)):
            confidence, best = torch.softmax(self.head.logits(state), -1).max(-1)
            guesses = self.head.draft_to_target[best]
            go_on = []
            for i, (row, guess, sure) in enumerate(zip(active, guesses.tolist(),
                                                       (confidence >= MIN_CONFIDENCE).tolist())):
                if sure:
                    out[live[row][0]].append(guess)
                    if step + 1 < live[row][2]:
                        go_on.append(i)
            if not go_on:
                break
            active = [active[i] for i in go_on]
            state = self.guess_step([live[row][0] for row in active], state[go_on], guesses[go_on],
                                    positions[active] + step, step)
        return [out[rid] for rid, _, _ in asks]

    def guess_step(self, request_ids: list[str], state: torch.Tensor, guesses: torch.Tensor,
                   positions: torch.Tensor, step: int) -> torch.Tensor:
        """The head on (its predicted state, its guess) at ``positions``, the ``step``-th row
        past each request's confirmed ones (its key written there, attending over the
        confirmed rows and the earlier guesses'): the next predicted state."""
        x = self.head.inputs(state, self.embed(guesses).to(state.dtype))
        q, keys, values = self.head.qkv(x, positions)
        attended = []
        for i, rid in enumerate(request_ids):
            cache = self.caches[rid]
            at = cache.length + step
            cache.write(at, keys[i:i + 1], values[i:i + 1])
            attended.append(_attend(q[i:i + 1], cache.keys[:at + 1], cache.values[:at + 1], at))
        return self.head.finish(x, torch.cat(attended))

    def _caught_up_to(self, request_id: str) -> int:
        """The last position whose target state the head has or holds pending (-1: none)."""
        cache = self.caches.get(request_id)
        if cache is None:
            return -1
        if cache.pending:
            position, states = cache.pending[-1]
            return position + states.shape[0] - 1
        return cache.first + cache.length - 1

    def _catch_up(self, live: list[tuple[str, list[int], int]]) -> torch.Tensor:
        """Run the head over every pending state (one batch), filling the caches; the
        predicted state after each request's last confirmed position, [requests, hidden]."""
        features, tokens, positions, spans = [], [], [], []
        for rid, ids, _ in live:
            cache = self.caches[rid]
            if not cache.pending:  # asked again without a step between: the state is at hand
                continue
            start = cache.pending[0][0]
            for position, states in cache.pending:
                features.append(states.to(self.head.fc.weight.dtype))
                positions.extend(range(position, position + states.shape[0]))
            tokens.extend(ids[start + 1:positions[-1] + 2])
            spans.append((cache, start, positions[-1] + 1 - start))
            cache.pending = []
        if spans:
            x = self.head.inputs(torch.cat(features), self.embed(torch.tensor(tokens)).to(features[0].dtype))
            q, keys, values = self.head.qkv(x, torch.tensor(positions))
            attended, row = [], 0
            for cache, start, count in spans:
                cache.begin(start)
                cache.write(cache.length, keys[row:row + count], values[row:row + count])
                cache.length += count
                attended.append(_attend(q[row:row + count], cache.keys[:cache.length],
                                        cache.values[:cache.length], cache.length - count))
                row += count
            states = self.head.finish(x, torch.cat(attended))
            row = 0
            for cache, _, count in spans:
                row += count
                cache.last_state = states[row - 1]
        return torch.stack([self.caches[rid].last_state for rid, _, _ in live])

    def reset(self) -> None:
        """Nothing is learned across requests."""

    def forget(self, request_id: str, output: list[int]) -> None:
        self.caches.pop(request_id, None)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offset: int) -> torch.Tensor:
    """Queries [n, Hq, D] at cache rows ``offset ..``, each over the rows up to its own, in
    float32. Written out: SDPA with grouped heads takes its math path on the CPU, 170 us a
    call against 30 here for a guess's one row."""
    n, heads, dim = q.shape
    total, kv_heads = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    grouped = q.float().view(n, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, n * group, dim)
    scores = torch.bmm(grouped, keys.float().permute(1, 2, 0)).mul_(dim ** -0.5)  # [kv heads, n * group, total]
    if n > 1 or offset != total - 1:  # causal over the rows after ``offset``
        later = torch.arange(total).unsqueeze(0) > torch.arange(offset, offset + n).unsqueeze(1)
        scores = scores.view(kv_heads, n, group, total).masked_fill(later[None, :, None, :], float("-inf"))
        scores = scores.view(kv_heads, n * group, total)
    out = torch.bmm(torch.softmax(scores, -1), values.float().transpose(0, 1))
    return out.view(kv_heads, n, group, dim).transpose(0, 1).reshape(n, heads, dim).to(q.dtype)


def _default_head(config) -> str:
    if config.model.model != "default":
        raise ValueError("--speculative eagle needs --eagle-head for a model other than the default: train one "
                         "with 'xlserve train-eagle --model ...'")
    if not DEFAULT_HEAD.exists():
        raise ValueError(f"the default model's EAGLE head is missing ({DEFAULT_HEAD.name}); make it with "
                         "'xlserve train-eagle'")
    return str(DEFAULT_HEAD)
