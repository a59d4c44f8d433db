"""Start a worker: load the engine, wrap it, serve HTTP until Ctrl-C."""

from __future__ import annotations

import logging

import uvicorn

from xlserve.config import EngineConfig, ServerConfig
from xlserve.engine.llm_engine import LLMEngine
from xlserve.worker.app import build_app
from xlserve.worker.async_engine import AsyncEngine
from xlserve.worker.metrics import WorkerMetrics
from xlserve.worker.serving_common import WorkerState

log = logging.getLogger("xlserve.worker")


def build_state(engine_config: EngineConfig) -> WorkerState:
    engine = LLMEngine(engine_config)
    async_engine = AsyncEngine(engine, engine_config.scheduler.max_waiting)
    metrics = WorkerMetrics(lambda: async_engine.stats, engine.model_name)
    return WorkerState(engine, async_engine, metrics, engine.model_name)


def run_worker(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    state = build_state(engine_config)
    app = build_app(state, server_config)
    log.info("serving %s on http://%s:%d as %s (max context %d tokens, %d KV blocks of %d, KV transfer %s)",
             state.model_name, server_config.host, server_config.port, server_config.role, state.max_model_len,
             state.engine.num_blocks, state.engine.block_size, app.state.disaggregation.address)
    try:
        uvicorn.run(app, host=server_config.host, port=server_config.port,
                    log_level=server_config.log_level, access_log=False, timeout_graceful_shutdown=5)
    finally:
        app.state.disaggregation.stop()
        state.async_engine.shutdown()
