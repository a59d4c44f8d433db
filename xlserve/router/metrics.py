"""Router metrics: the worker's request histograms, routing and transfer facts, and every
worker's engine state (as of the last health check) labelled ``worker``."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from xlserve.router.admission_gate import AdmissionGate
from xlserve.router.pool import WorkerPool
from xlserve.worker.metrics import EngineCollector, WorkerMetrics

PREDICTION_ERROR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096)


class RouterMetrics(WorkerMetrics):
    def __init__(self, pool: WorkerPool, model_name: str, policy: str, gates: tuple[AdmissionGate, AdmissionGate]):
        super().__init__(None, model_name)
        r = self.registry
        self.decisions = Counter("xlserve_router_decisions", "Routing decisions", ["policy", "stage", "worker"],
                                 registry=r)
        self.predicted_cached = Counter("xlserve_router_predicted_cached_tokens",
                                        "Prompt tokens the index predicted cached on the worker that computed "
                                        "the prompt", registry=r)
        self.actual_cached = Counter("xlserve_router_actual_cached_tokens",
                                     "Prompt tokens that worker reported served from its cache", registry=r)
        self.prediction_error = Histogram("xlserve_router_cache_prediction_error_tokens",
                                          "Per request: actual - predicted cached prompt tokens",
                                          buckets=PREDICTION_ERROR_BUCKETS, registry=r)
        self.transfer_bytes = Counter("xlserve_kv_transfer_bytes", "KV bytes pulled by decode workers", registry=r)
        self.transfer_seconds = Histogram("xlserve_kv_transfer_seconds", "KV pull latency", registry=r)
        self.transfer_failures = Counter("xlserve_kv_transfer_failures", "KV pulls that failed", registry=r)
        self.refused_early = Counter("xlserve_router_refused_before_parsing",
                                     "Requests answered 429 before parsing: every worker of a stage was full "
                                     "(decode: the workers' slots taken and the router's queue for them full)",
                                     ["stage"], registry=r)
        self.prefills_wasted = Counter("xlserve_router_prefills_wasted", "Prompts computed and then thrown away: "
                                       "the decode worker refused the request as busy (429)", registry=r)
        queued = Gauge("xlserve_router_queued", "Disaggregated requests waiting at the router: before their "
                       "prefill for room in the stack, after it for room on a decode worker", ["where"], registry=r)
        queued.labels(where="before_prefill").set_function(lambda: gates[0].waiting)
        queued.labels(where="after_prefill").set_function(lambda: gates[1].waiting)
        inflight = Gauge("xlserve_router_inflight_tokens", "In-flight tokens per worker", ["worker", "kind"],
                         registry=r)
        for w in pool.workers:
            inflight.labels(worker=w.url, kind="prefill").set_function(lambda w=w: w.prefill_tokens)
            inflight.labels(worker=w.url, kind="decode").set_function(lambda w=w: w.decode_tokens)
        self.policy = policy
        r.register(EngineCollector(lambda: {w.url: w.engine_stats for w in pool.workers}, label="worker"))

    def observe_route(self, stage: str, worker: str) -> None:
        self.decisions.labels(policy=self.policy, stage=stage, worker=worker).inc()

    def observe_cache(self, predicted: int, actual: int) -> None:
        self.predicted_cached.inc(predicted)
        self.actual_cached.inc(actual)
        self.prediction_error.observe(actual - predicted)

    def observe_transfer(self, info: dict) -> None:
        if info.get("error"):
            self.transfer_failures.inc()
            return
        self.transfer_bytes.inc(info.get("bytes", 0))
        self.transfer_seconds.observe(info.get("seconds", 0.0))
