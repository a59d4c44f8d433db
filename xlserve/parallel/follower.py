"""A tensor-parallel rank other than 0 (started by ``TensorParallelRanks``): joins the group,
loads its slice of the model, sizes its KV pool as rank 0 does, then runs each step's plan
until the stop plan (or until the worker dies, which takes it down too)."""

from __future__ import annotations

import logging
import sys

import torch

from xlserve.parallel.rank_plan import PlanKind, RankPlan, receive_plan
from xlserve.parallel.ranks import RankSpec, agree, as_bytes, join, leave

log = logging.getLogger("xlserve.parallel.follower")


def main() -> None:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s rank %(process)d: %(message)s",
                        datefmt="%H:%M:%S")
    spec = RankSpec.model_validate_json(sys.stdin.buffer.read())
    from xlserve.config import EngineConfig
    config = EngineConfig.from_kwargs(**spec.engine)
    plan_group = join(spec.init_method, spec.rank, spec.size, config)
    try:
        runner = _runner(config)
        log.info("tensor-parallel rank %d of %d ready", spec.rank, spec.size)
        while (plan := receive_plan(plan_group)).kind is not PlanKind.STOP:
            if plan.kind is PlanKind.STEP:
                runner.follow(plan.scheduled(), plan.path, plan.cpu_kernels)
            else:
                _move_kv(plan, runner, config.cache.block_size, spec.rank)
    finally:
        leave()


def _move_kv(plan: RankPlan, runner, block_size: int, rank: int) -> None:
    """This rank's heads of the plan's blocks: to rank 0 (an export) or from it (an import)."""
    import torch.distributed as dist

    from xlserve.engine.kv_blocks import own_heads, read_blocks, write_blocks
    from xlserve.parallel import tensor_parallel
    group = tensor_parallel.current().group
    if plan.kind is PlanKind.KV_EXPORT:
        dist.gather(as_bytes(read_blocks(runner.kv_caches, plan.block_ids, block_size)), None, dst=0, group=group)
        return
    part = runner.kv_caches[0][0]  # [slots, this rank's heads, dim]
    full = torch.empty(len(plan.block_ids), len(runner.kv_caches), len(runner.kv_caches[0]), block_size,
                       plan.kv_heads, part.shape[2], dtype=part.dtype, device=part.device)
    dist.broadcast(as_bytes(full), 0, group=group)  # a view: fills ``full``
    write_blocks(runner.kv_caches, plan.block_ids, own_heads(full, part.shape[1], rank), block_size)


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
