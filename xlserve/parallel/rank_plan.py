"""What rank 0 tells the other tensor-parallel ranks, one plan at a time: run a step (the
scheduled token chunks with their positions and block tables, and the forward path rank 0
chose), send their KV heads of some blocks (an export), write their KV heads of some blocks
(an import: the data follows the plan), or stop. Plain typed data, sent as JSON over the
plan group (never pickled), validated on receipt.

The other ranks need no sampling parameters: they run the same forward (their slice of
every layer, the same collectives in the same order) and leave sampling to rank 0.
"""

from __future__ import annotations

import datetime
import enum

import torch
from pydantic import BaseModel, ConfigDict, Field

from xlserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from xlserve.layers.attention import DecodePath
from xlserve.sampling_params import SamplingParams

MAX_PLAN_BYTES = 256 * 1024 * 1024  # a step of 64k tokens with 1M-token block tables is far below this


class PlannedChunk(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    token_ids: list[int]
    start_position: int = Field(ge=0)
    block_ids: list[int]
    window_block_ids: list[list[int]] = []
    sample: bool
    num_proposed: int = Field(default=0, ge=0)  # the rows that check proposals compute logits too
    dp_rank: int = Field(default=0, ge=0)  # data-parallel attention: the rank that runs the chunk


class PlanKind(str, enum.Enum):
    STEP = "step"
    KV_EXPORT = "kv_export"  # each rank gathers its heads of ``block_ids`` to rank 0
    KV_IMPORT = "kv_import"  # rank 0 broadcasts the blocks' every head; each rank writes its own
    STOP = "stop"  # the worker is shutting down: the ranks leave their loop


class RankPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: PlanKind = PlanKind.STEP
    chunks: list[PlannedChunk] = []
    path: DecodePath = DecodePath.EAGER
    cpu_kernels: bool = False
    block_ids: list[int] = []
    kv_heads: int = Field(default=0, ge=0)  # a KV import: the heads the broadcast blocks carry (every head)
    # a KV export or import of one rank's own pool (data-parallel attention): only that rank
    # sends, or receives the blocks point to point; -1: every rank its part
    only_rank: int = Field(default=-1, ge=-1)

    @classmethod
    def of(cls, output: SchedulerOutput, path: DecodePath, cpu_kernels: bool) -> "RankPlan":
        return cls(chunks=[PlannedChunk(token_ids=s.token_ids, start_position=s.start_position, block_ids=s.block_ids,
                                        window_block_ids=[list(t) for t in s.window_block_ids], sample=s.sample,
                                        num_proposed=s.num_proposed, dp_rank=s.dp_rank)
                           for s in output.scheduled], path=path, cpu_kernels=cpu_kernels)

    def scheduled(self) -> list[ScheduledRequest]:
        """The chunks as the runner takes them (no sampling parameters: these ranks do not sample)."""
        return [ScheduledRequest(request_id=str(i), token_ids=c.token_ids, start_position=c.start_position,
                                 block_ids=c.block_ids, sample=c.sample, params=SamplingParams(), seed=None,
                                 output_index=0, window_block_ids=tuple(c.window_block_ids),
                                 num_proposed=c.num_proposed, dp_rank=c.dp_rank)
                for i, c in enumerate(self.chunks)]


def send_plan(plan: RankPlan, group, timeout: datetime.timedelta) -> None:
    """From rank 0 to every rank of ``group``: the JSON's length, then its bytes, each send
    bounded by ``timeout``. The plan group itself never times out (idle ranks wait on it while
    the worker lives), so without this bound a send towards a rank that died could wait as
    long: seen in a full test run, rank 0 blocked in this broadcast minutes after its peer
    was killed, where alone the same test fails the send at once."""
    import torch.distributed as dist
    data = plan.model_dump_json().encode()
    for payload in (torch.tensor([len(data)], dtype=torch.int64), torch.frombuffer(bytearray(data), dtype=torch.uint8)):
        dist.broadcast(payload, 0, group=group, async_op=True).wait(timeout=timeout)


def receive_plan(group) -> RankPlan:
    import torch.distributed as dist
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, 0, group=group)
    if not 0 < int(size) <= MAX_PLAN_BYTES:
        raise ValueError(f"a step plan of {int(size)} bytes (at most {MAX_PLAN_BYTES})")
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, 0, group=group)
    return RankPlan.model_validate_json(data.numpy().tobytes())
