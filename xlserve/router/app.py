"""The router: the worker's OpenAI API in front of a pool of workers.

It tokenizes once (its own copy of the model's tokenizer and chat template), then hands
token ids to workers through ``RemoteEngine`` (prefill -> KV hand-off -> decode).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import uvicorn
from fastapi import Request
from fastapi.responses import JSONResponse

from xlserve.loader.tokenizer import load_model_tokenizer, prompt_token_ids
from xlserve.openai.app import build_app
from xlserve.openai.engine_client import EngineBusy
from xlserve.openai.errors import error_body
from xlserve.openai.http_protocol import uvicorn_config
from xlserve.openai.serving_common import WorkerState
from xlserve.router.admission_gate import UNBOUNDED, AdmissionGate
from xlserve.router.backend import parse_worker_address
from xlserve.router.dispatch import Dispatcher
from xlserve.router.faults import NoWorker, WorkerFailed
from xlserve.router.index import PrefixIndex
from xlserve.router.metrics import RouterMetrics
from xlserve.router.policies import make_policy
from xlserve.router.pool import WorkerPool
from xlserve.router.remote_engine import SERVED_BY, SESSION, RemoteEngine
from xlserve.router.server_template import render_on_server
from xlserve.server_config import ServerConfig

log = logging.getLogger("xlserve.router")
SESSION_HEADER = "x-session-affinity"
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


@dataclass(frozen=True)
class RouterOptions:
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    both: tuple[str, ...] = ()
    policy: str = "cache_aware"
    affinity: bool = True
    model: str = "default"
    chat_template: str = ""  # a Jinja file instead of the model's template
    worker_api_key: str = ""
    backend_api_key: str = ""  # what foreign servers (openai+, vllm-pd+, sglang-pd+ URLs) want; never the internal key
    tokenize_with: str = ""  # a foreign server that renders chats (its template differs from the model's)
    health_interval: float = 2.0


class RouterFront:
    """What the OpenAI handlers need of an engine, for a router: tokenizer and limits."""

    def __init__(self, tokenizer, info: dict, remote: RemoteEngine):
        self.tokenizer = tokenizer
        self.max_model_len = int(info["max_model_len"])
        self.block_size = int(info["block_size"])
        self.remote = remote

    def tokenize(self, prompt) -> list[int]:
        return prompt_token_ids(self.tokenizer, prompt)


def build_router_app(opts: RouterOptions, config: ServerConfig):
    pool = WorkerPool(list(opts.prefill), list(opts.decode), list(opts.both), opts.worker_api_key,
                      config.worker_timeout, opts.backend_api_key)
    info = pool.info()
    tokenizer = load_model_tokenizer(opts.model, opts.chat_template)
    if opts.tokenize_with:
        render_on_server(tokenizer, parse_worker_address(opts.tokenize_with).url, pool.backend_headers)
    gates = (AdmissionGate(pool.split_capacity, config.router_queue, config.router_queue_timeout),
             AdmissionGate(pool.decode_capacity, queue=UNBOUNDED))
    metrics = RouterMetrics(pool, info["model"], opts.policy, gates)
    index = PrefixIndex(block_size=int(info["block_size"]))
    remote = RemoteEngine(pool, make_policy(opts.policy, opts.affinity, int(info["block_size"])), index,
                          info, gates, metrics)
    gate = gates[0]
    state = WorkerState(RouterFront(tokenizer, info, remote), remote, metrics, info["model"])

    def hook(request: Request) -> None:
        SESSION.set(request.headers.get(SESSION_HEADER))
        SERVED_BY.set([])
        # Refused here it costs nothing; past this point a refusal costs a parse, a chat
        # template, a tokenization and a call to a worker (docs/reliability.md, 10x load).
        if request.url.path in GENERATION_PATHS and (stage := pool.full_stage() or ("decode" if gate.full else None)):
            metrics.refused_early.labels(stage=stage).inc()
            raise EngineBusy(f"every {stage} worker is full")

    def served_headers() -> dict:
        served = SERVED_BY.get() or []
        return {"x-xlserve-served-by": ", ".join(dict.fromkeys(served))} if served else {}

    app = build_app(state, config, internal=False, request_hook=hook, response_headers=served_headers,
                    title="xlserve router", dispatch=Dispatcher(remote, state.prices, info["model"], served_headers))

    @app.exception_handler(WorkerFailed)
    async def _worker_failed(_, e: WorkerFailed):
        if isinstance(e, NoWorker):  # a gap until a worker is back: clients should retry
            return JSONResponse(error_body(503, str(e)), status_code=503, headers={"Retry-After": "2"})
        return JSONResponse(error_body(502, f"worker failed: {e}"), status_code=502)

    async def _health():
        await asyncio.gather(*(pool.check(w) for w in pool.workers))
        await pool.sync_kv_peers()  # before the first request: decode workers know whom to pull from
        app.state.health_task = asyncio.create_task(pool.health_loop(opts.health_interval, index, remote.wake))
    app.state.startup_hooks.insert(0, _health)  # the heap is frozen after it, with the pool's state

    @app.get("/router/workers", dependencies=app.state.api_dependencies if config.metrics_need_key else [])
    async def workers():
        return [{"url": w.url, "role": w.role, "backend": w.kind.value, "healthy": w.healthy,
                 "model": w.info.model if w.info else None,
                 "cache_tokens": w.info.cache_tokens if w.info else None, "prefill_tokens": w.prefill_tokens,
                 "decode_tokens": w.decode_tokens, "indexed_blocks": index.blocks_on(w.url),
                 "indexed_by_tier": index.tiers_on(w.url),
                 "kv_tiers": w.engine_stats.get("kv_tiers", {})} for w in pool.workers]

    return app


def run_router(opts: RouterOptions, config: ServerConfig) -> None:
    app = build_router_app(opts, config)
    log.info("router on http://%s:%d: policy %s%s, prefill %s, decode %s, both %s", config.host, config.port,
             opts.policy, " + session affinity" if opts.affinity else "", list(opts.prefill), list(opts.decode),
             list(opts.both))
    uvicorn.Server(uvicorn_config(app, config)).run()
