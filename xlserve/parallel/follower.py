"""A tensor-parallel rank other than 0 (started by ``TensorParallelRanks``): joins the group,
loads its slice of the model, sizes its KV pool as rank 0 does, then runs each step's plan
until the stop plan (or until the worker dies, which takes it down too)."""

from __future__ import annotations

import logging
import sys

from xlserve.parallel.ranks import RankSpec, join, leave
from xlserve.parallel.step_plan import receive_plan

log = logging.getLogger("xlserve.parallel.follower")


def main() -> None:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s rank %(process)d: %(message)s",
                        datefmt="%H:%M:%S")
    spec = RankSpec.model_validate_json(sys.stdin.buffer.read())
    from xlserve.config import EngineConfig
    config = EngineConfig.from_kwargs(**spec.engine)
    plan_group = join(spec.init_method, spec.rank, spec.size, config.parallel.distributed_timeout,
                      config.model.device)
    try:
        runner = _runner(config)
        log.info("tensor-parallel rank %d of %d ready", spec.rank, spec.size)
        while not (plan := receive_plan(plan_group)).stop:
            runner.follow(plan.scheduled(), plan.path, plan.cpu_kernels)
    finally:
        leave()


def _runner(config):
    from xlserve.engine.llm_engine import pool_blocks
    from xlserve.engine.model_runner import ModelRunner
    from xlserve.loader.model_loader import load_model
    loaded = load_model(config.model)
    return ModelRunner(loaded, pool_blocks(config, loaded), config.cache.block_size, None, cuda_graphs=False)


if __name__ == "__main__":
    main()
