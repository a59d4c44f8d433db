"""This process's pipeline stage: which consecutive layers it holds, and how the hidden
states and the logits move between stages (``torch.distributed`` point to point: gloo on
CPU, NCCL on CUDA).

Set once per process before the model is built (``set_current``); the model builds and
loads only its stage's layers (the first stage also the embedding, the last the final norm
and the head). Stage ``s``'s tensor-parallel rank ``t`` is global rank ``s * tp + t``; it
receives its input from the same tensor-parallel rank of stage ``s - 1`` and sends its
output to that of stage ``s + 1``. The last stage's tensor-parallel rank 0 sends the
sampled rows' logits to rank 0, which owns every request's sampling state (seeded
generators, grammars, penalties' history) and samples, as it does with one stage.

With one stage, every layer is held and nothing is sent.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from xlserve.engine.scheduler import ScheduledRequest
from xlserve.models.arch import ModelArch
from xlserve.parallel.tensor_parallel import COLLECTIVES, as_bytes


@dataclass(frozen=True)
class PipelineStage:
    index: int = 0
    count: int = 1
    first_layer: int = 0
    end_layer: int | None = None  # None: through the model's last layer
    rank: int = 0  # this process's global rank
    tp_size: int = 1  # ranks per stage

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def holds(self, layer: int) -> bool:
        return self.first_layer <= layer and (self.end_layer is None or layer < self.end_layer)

    def layers(self, num_layers: int) -> range:
        return range(self.first_layer, num_layers if self.end_layer is None else self.end_layer)

    def holds_embedding(self, tied: bool) -> bool:
        """The first stage embeds; the last holds the embedding too when it is the head's weight."""
        return self.first or (self.last and tied)

    def send_hidden(self, x: torch.Tensor, tag: int):
        """To the next stage without waiting (the next micro-batch computes meanwhile): wait on the result."""
        import torch.distributed as dist
        return dist.isend(as_bytes(x), self.rank + self.tp_size, tag=tag)

    def receive_hidden(self, tokens: int, hidden: int, dtype: torch.dtype, device, tag: int) -> torch.Tensor:
        x = torch.empty(tokens, hidden, dtype=dtype, device=device)
        _receive(x, self.rank - self.tp_size, tag)
        return x

    @property
    def sends_logits(self) -> bool:
        """The last stage's first tensor-parallel rank (every rank of it holds the gathered logits)."""
        return self.count > 1 and self.last and self.rank % self.tp_size == 0

    def send_logits(self, logits: torch.Tensor, tag: int):
        import torch.distributed as dist
        return dist.isend(as_bytes(logits), 0, tag=tag)

    def receive_logits(self, rows: int, vocab: int, device, tag: int) -> torch.Tensor:
        logits = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        _receive(logits, (self.count - 1) * self.tp_size, tag)
        return logits


def _receive(into: torch.Tensor, source: int, tag: int) -> None:
    import torch.distributed as dist
    started = time.perf_counter()
    dist.recv(as_bytes(into), source, tag=tag)  # a view: fills ``into``
    COLLECTIVES.add(time.perf_counter() - started)


def layer_costs(arch: ModelArch) -> list[float]:
    """Each layer's planned compute per token: the weights a token multiplies (the routed
    experts it picks, not all of them). Layers of one kind cost alike; dense and sparse
    layers need not (Qwen3-30B-A3B's active experts are a third of a dense MLP's width)."""
    from xlserve.planner.weights import attention_params
    h = arch.hidden_size
    attention = sum(attention_params(arch))
    dense = 3 * h * arch.intermediate_size
    sparse = 3 * h * (arch.moe_intermediate_size * arch.num_experts_per_tok + arch.shared_expert_intermediate_size) \
        + h * arch.num_experts
    return [attention + (sparse if arch.sparse_layer(i) else dense) for i in range(arch.num_layers)]


def balanced_stages(arch: ModelArch, count: int) -> list[range]:
    """Consecutive layers for each of ``count`` stages, the costliest stage as cheap as can
    be (the head's cost counted on the last stage: every decoded token goes through it; for
    DeepSeek-V3 the head is 0.93 G weights per token against 0.58 G per layer, so the last of
    eight stages takes six of the 61 layers, the others seven or eight)."""
    costs = layer_costs(arch)
    if count > len(costs):
        raise ValueError(f"{count} pipeline stages for {len(costs)} layers: choose a --pipeline-parallel-size of at "
                         f"most {len(costs)}")
    costs[-1] += arch.hidden_size * arch.vocab_size
    return split_evenly(costs, count)


def split_evenly(costs: list[float], count: int) -> list[range]:
    """The split of ``costs`` into ``count`` non-empty runs whose largest sum is smallest
    (dynamic programming over where each run ends; ties go to the earlier end)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the smallest largest sum splitting the first i costs into k runs; start[k][i]: the k-th run's start
    best = [[float("inf")] * (n + 1) for _ in range(count + 1)]
    start = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    for k in range(1, count + 1):
        for i in range(k, n - (count - k) + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], start[k][i] = worst, j
    runs, i = [], n
    for k in range(count, 0, -1):
        runs.append(range(start[k][i], i))
        i = start[k][i]
    return runs[::-1]


def micro_batches(scheduled: list[ScheduledRequest], count: int) -> list[list[ScheduledRequest]]:
    """The step's token rows cut into at most ``count`` runs of about equal size, in order,
    so stage ``s`` works on one while stage ``s + 1`` works on the one before. A chunk of
    several tokens may be cut: its later piece reads the earlier piece's KV as the next chunk
    of a chunked prefill does (each stage runs the pieces in order); only the last piece samples.
    A chunk that checks proposals is not cut: each of its proposals' rows needs logits.

    A decode-only step stays whole: its cost is reading the weights, which every piece would
    do again (measured with ``xlserve bench parallel``, 2 stages of the 0.2B model on 2 cores:
    a batch-8 decode step took 226 ms cut in two, 174 ms whole)."""
    if all(len(s.token_ids) == 1 for s in scheduled):
        return [scheduled]
    target = -(-sum(len(s.token_ids) for s in scheduled) // count)
    batches, batch, filled = [], [], 0
    for s in scheduled:
        ids, start = list(s.token_ids), s.start_position
        while ids:
            take = len(ids) if s.num_proposed else min(len(ids), target - filled)
            piece, ids = ids[:take], ids[take:]
            batch.append(dataclasses.replace(s, token_ids=piece, start_position=start, sample=s.sample and not ids))
            start, filled = start + take, filled + take
            if filled >= target:
                batches.append(batch)
                batch, filled = [], 0
    if batch:
        batches.append(batch)
    return batches


_current = PipelineStage()


def current() -> PipelineStage:
    return _current


def set_current(stage: PipelineStage) -> None:
    global _current
    _current = stage


def place(arch: ModelArch) -> PipelineStage:
    """This rank's stage with its layers, once the model's are known (every rank computes the
    same split from the same config)."""
    stage = current()
    if stage.count > 1 and stage.end_layer is None:
        layers = balanced_stages(arch, stage.count)[stage.index]
        set_current(dataclasses.replace(stage, first_layer=layers.start, end_layer=layers.stop))
    return current()


class Elsewhere(torch.nn.Module):
    """A layer another pipeline stage holds: no weights here, never called."""
