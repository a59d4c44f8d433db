"""Prometheus metrics of one worker: latency histograms, token counters, engine gauges."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1, 2)

ENGINE_GAUGES = {
    "num_running": ("xlserve_requests_running", "Requests in the running batch"),
    "num_waiting": ("xlserve_requests_waiting", "Requests waiting to be scheduled"),
    "kv_blocks_used": ("xlserve_kv_blocks_used", "KV-cache blocks in use"),
    "kv_blocks_total": ("xlserve_kv_blocks_total", "KV-cache blocks in the device pool"),
    "prefix_cache_hit_ratio": ("xlserve_prefix_cache_hit_ratio", "Prefix-cache hit tokens / queried tokens"),
    "prefix_cache_queried_tokens": ("xlserve_prefix_cache_queried_tokens", "Prompt tokens looked up"),
    "prefix_cache_hit_tokens": ("xlserve_prefix_cache_hit_tokens", "Prompt tokens found in the cache"),
    "num_preemptions": ("xlserve_preemptions", "Requests preempted for lack of KV blocks"),
    "kv_pins": ("xlserve_kv_pins", "Exported KV pins held for decode workers to pull"),
    "num_failed_requests": ("xlserve_requests_failed_in_engine", "Requests ended by an error inside a step "
                            "(the engine served on)"),
}


class WorkerMetrics:
    def __init__(self, engine_stats: Callable[[], dict] | None, model_name: str):
        """``engine_stats``: the engine's counters for the gauges; None where there is no
        local engine (the router)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("xlserve_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("xlserve_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("xlserve_e2e_request_latency_seconds", "Request latency, arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("xlserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_tokens = Counter("xlserve_cached_prompt_tokens", "Prompt tokens served from cache",
                                     registry=r)
        self.generation_tokens = Counter("xlserve_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("xlserve_requests", "Finished requests", ["finish_reason"], registry=r)
        self.errors = Counter("xlserve_request_errors", "Requests refused", ["status"], registry=r)
        info = Gauge("xlserve_model_info", "Served model", ["model"], registry=r)
        info.labels(model=model_name).set(1)
        for key, (name, doc) in ENGINE_GAUGES.items() if engine_stats is not None else ():
            Gauge(name, doc, registry=r).set_function(lambda k=key: float(engine_stats().get(k, 0)))

    def observe_finished(self, prompt_tokens: int, cached: int, generated: int, ttft: float | None,
                         e2e: float, finish_reason: str | None) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached)
        self.generation_tokens.inc(generated)
        if ttft is not None:
            self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        self.requests.labels(finish_reason=finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
