"""Data-parallel attention with expert parallelism: this process's place among ranks that
each run their own requests (whole attention, their own KV pool) and hold an equal share
of every MoE layer's routed experts, and the all-to-all exchanges a MoE layer makes.

A MoE layer sends each token row to the ranks that hold its chosen experts, each rank runs
its experts over the rows it received (its own and its peers'), and the results go back to
the rows' owners, who weigh and add them (``SparseMoE``). Every rank calls the same
exchanges in the same order in every step, a rank with no rows of its own too (with none
to send): rank 0's plan tells each rank its rows, and a rank without any still serves its
experts to the others (``ModelRunner``).

Invariants: every ``counts`` and ``move`` is one all-to-all (gloo on CPU, NCCL on CUDA) that
every rank calls at the same point; rows travel grouped by destination rank in rank order
and arrive grouped by sender in rank order, so moving results back with the counts swapped
returns them in the order they were sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from xlserve.parallel.tensor_parallel import COLLECTIVES


@dataclass(frozen=True)
class ExpertExchange:
    rank: int = 0
    size: int = 1  # 1: no exchange (one rank, or attention split by heads)
    group: object = None

    @property
    def active(self) -> bool:
        return self.size > 1

    def experts(self, total: int) -> slice:
        """This rank's routed experts: an even, contiguous share."""
        if total % self.size:
            raise ValueError(f"experts ({total}) do not divide over {self.size} expert-parallel ranks; choose a "
                             f"--tensor-parallel-size that divides them")
        n = total // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def counts(self, sending: list[int], device: torch.device) -> list[int]:
        """How many rows each rank sends this one, given how many this one sends each (``sending``);
        ``device``: where the collective's tensors live (NCCL moves device tensors only)."""
        ones = [1] * self.size
        return self.move(torch.tensor(sending, dtype=torch.int64, device=device), ones, ones).tolist()

    def move(self, rows: torch.Tensor, sending: list[int], receiving: list[int]) -> torch.Tensor:
        """``sending[r]`` rows of ``rows`` (in rank order) to rank r; returns ``receiving[r]`` rows
        from each rank r, in rank order."""
        import torch.distributed as dist
        out = rows.new_empty(sum(receiving), *rows.shape[1:])
        started = time.perf_counter()
        dist.all_to_all_single(out, rows.contiguous(), receiving, sending, group=self.group)
        COLLECTIVES.add(time.perf_counter() - started)
        return out

    def gather_logits(self, logits: torch.Tensor | None, counts: list[int], vocab: int,
                      device: torch.device) -> torch.Tensor | None:
        """Rank 0: every rank's sampling rows' logits (``counts[r]`` rows from rank r), in rank
        order, in float32 (None: no rank samples); the others send theirs and get None."""
        import torch.distributed as dist
        if self.rank:
            if counts[self.rank]:
                dist.send(logits.float().contiguous(), 0, group=self.group)
            return None
        parts = [logits.float()] if counts[0] else []
        for rank in range(1, self.size):
            if counts[rank]:
                part = torch.empty(counts[rank], vocab, dtype=torch.float32, device=device)
                dist.recv(part, rank, group=self.group)
                parts.append(part)
        return torch.cat(parts) if parts else None


_current = ExpertExchange()


def current() -> ExpertExchange:
    return _current


def set_current(exchange: ExpertExchange) -> None:
    global _current
    _current = exchange
