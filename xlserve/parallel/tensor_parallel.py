"""This process's tensor-parallel rank: which slice of each layer it holds, and the
collectives the layers call (``torch.distributed``: gloo on CPU, NCCL on CUDA).

Set once per process before the model is built (``set_current``); layers read it when they
size their weights and when they combine partial results. With one rank every collective
is the identity, so the single-process path is the same code.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # the torch.distributed group of the compute collectives
    expert_parallel: bool = False  # MoE layers: whole experts per rank instead of every expert's columns

    def part(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (heads, columns, experts' widths): an even split."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) does not divide over {self.size} tensor-parallel ranks; choose a "
                             f"--tensor-parallel-size that divides it")
        return total // self.size

    def span(self, total: int, what: str) -> slice:
        """This rank's rows (or columns) of a dimension of ``total``."""
        n = self.part(total, what)
        return slice(self.rank * n, (self.rank + 1) * n)

    def kv_cache_spec(self, spec):
        """A rank's share of a ``KVCacheSpec``: its key/value heads (all of a shared entry)."""
        if self.size == 1 or spec.shared:
            return spec
        return dataclasses.replace(spec, heads=self.part(spec.heads, "key/value heads"))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (partial products of a row-parallel matmul), in place."""
        if self.size > 1:
            import torch.distributed as dist
            started = time.perf_counter()
            dist.all_reduce(x, group=self.group)
            COLLECTIVES.add(time.perf_counter() - started)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension (vocabulary slices), in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        parts = [torch.empty_like(x) for _ in range(self.size)]
        started = time.perf_counter()
        dist.all_gather(parts, x.contiguous(), group=self.group)
        COLLECTIVES.add(time.perf_counter() - started)
        return torch.cat(parts, dim=-1)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (its last dimension times its item size), for collectives of any dtype."""
    return t.contiguous().view(torch.uint8)


@dataclass
class CollectiveTime:
    """Seconds this process spent in collectives (waiting for the slowest rank included): the
    communication share a benchmark reports. Costs one clock read per collective."""
    seconds: float = 0.0
    calls: int = 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.calls += 1


COLLECTIVES = CollectiveTime()
_current = TensorParallel()


def current() -> TensorParallel:
    return _current


def set_current(tp: TensorParallel) -> None:
    global _current
    _current = tp
