"""A rank other than 0 (started by ``WorkerRanks``): joins the group, loads its part of the
model (its stage's layers, its tensor-parallel slice of them), sizes its KV pool as rank 0
does, then runs each step's plan until the stop plan (or until the worker dies, which takes
it down too)."""

from __future__ import annotations

import logging
import sys

import torch

from xlserve.parallel.rank_plan import PlanKind, RankPlan, receive_plan
from xlserve.parallel.ranks import RankSpec, agree, join, leave
from xlserve.parallel.tensor_parallel import as_bytes

log = logging.getLogger("xlserve.parallel.follower")


def main() -> None:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s rank %(process)d: %(message)s",
                        datefmt="%H:%M:%S")
    spec = RankSpec.model_validate_json(sys.stdin.buffer.read())
    from xlserve.config import EngineConfig
    config = EngineConfig.from_kwargs(**spec.engine)
    plan_group = join(spec.init_method, spec.rank, config)
    try:
        runner = _runner(config)
        log.info("rank %d of %d ready", spec.rank, spec.size)
        while (plan := receive_plan(plan_group)).kind is not PlanKind.STOP:
            if plan.kind is PlanKind.STEP:
                runner.follow(plan.scheduled(), plan.path, plan.cpu_kernels)
            else:
                _move_kv(plan, runner, config.cache.block_size, spec.rank)
    finally:
        leave()


def _move_kv(plan: RankPlan, runner, block_size: int, rank: int) -> None:
    """This rank's part of the plan's blocks (its slots, its heads): to rank 0 (an export) or from it
    (an import); with ``only_rank`` (data-parallel attention) only that rank's pool, whole."""
    import torch.distributed as dist

    from xlserve.engine.kv_blocks import held, own_share, read_blocks, write_blocks
    from xlserve.parallel import tensor_parallel
    if plan.only_rank not in (-1, rank):
        return
    if plan.kind is PlanKind.KV_EXPORT:
        dist.send(as_bytes(read_blocks(runner.kv_caches, plan.block_ids, block_size)), 0)
        return
    part = held(runner.kv_caches)[0]  # the parts of one slot, each [slots, this rank's heads, dim]
    full = torch.empty(len(plan.block_ids), len(runner.kv_caches), len(part), block_size, plan.kv_heads,
                       part[0].shape[2], dtype=part[0].dtype, device=part[0].device)
    if plan.only_rank == rank:
        dist.recv(as_bytes(full), 0)  # a view: fills ``full``
    else:
        dist.broadcast(as_bytes(full), 0)
    write_blocks(runner.kv_caches, plan.block_ids, own_share(full, runner.kv_caches, tensor_parallel.current().rank),
                 block_size)


def _runner(config):
    from xlserve.engine.llm_engine import pool_blocks
    from xlserve.engine.model_runner import ModelRunner
    from xlserve.loader.model_loader import load_model
    loaded = load_model(config.model)
    num_blocks = pool_blocks(config, loaded)
    agree(loaded, num_blocks, config.cache.block_size)
    return ModelRunner(loaded, num_blocks, config.cache.block_size, None, cuda_graphs=False)


if __name__ == "__main__":
    main()
