"""Start a worker: load the engine, wrap it, serve HTTP until Ctrl-C.

An engine that cannot continue ends the process with ``EXIT_ENGINE_DEAD`` once the
requests it failed have had their error answers, never leaving a live process that
answers 5xx forever; ``xlserve serve`` restarts it.
"""

from __future__ import annotations

import logging
import sys

import uvicorn

from xlserve.config import EngineConfig
from xlserve.engine.llm_engine import LLMEngine
from xlserve.openai.app import build_app
from xlserve.openai.http_protocol import uvicorn_config
from xlserve.openai.serving_common import WorkerState
from xlserve.server_config import ServerConfig
from xlserve.worker.async_engine import AsyncEngine
from xlserve.worker.metrics import WorkerMetrics

log = logging.getLogger("xlserve.worker")
EXIT_ENGINE_DEAD = 3


def build_state(engine_config: EngineConfig, on_fatal=None) -> WorkerState:
    engine = LLMEngine(engine_config)
    async_engine = AsyncEngine(engine, engine_config.scheduler.max_waiting, on_fatal)
    metrics = WorkerMetrics(lambda: async_engine.stats, engine.model_name)
    return WorkerState(engine, async_engine, metrics, engine.model_name)


def run_worker(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    server: uvicorn.Server | None = None

    def on_fatal(error: BaseException) -> None:  # on the engine thread
        log.critical("the engine cannot continue (%s: %s); the worker exits", type(error).__name__, error)
        if server is not None:
            server.should_exit = True  # graceful: the failed requests' error answers go out first

    state = build_state(engine_config, on_fatal)
    app = build_app(state, server_config)
    log.info("serving %s on http://%s:%d as %s (max context %d tokens, %d KV blocks of %d, KV transfer %s)",
             state.model_name, server_config.host, server_config.port, server_config.role, state.max_model_len,
             state.engine.num_blocks, state.engine.block_size, app.state.disaggregation.address)
    server = uvicorn.Server(uvicorn_config(app, server_config))
    server.should_exit = state.async_engine.dead is not None  # died before the server existed
    try:
        server.run()
    finally:
        app.state.disaggregation.stop()
        state.async_engine.shutdown()
        if not state.async_engine.running:  # its thread is done with the engine: stop the other ranks
            state.engine.close()
    if state.async_engine.dead is not None:
        sys.exit(EXIT_ENGINE_DEAD)
