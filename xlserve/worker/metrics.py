"""Prometheus metrics of one worker: latency histograms, token and request counters, and
the engine's own state (running, waiting, KV usage, prefix-cache hits).

Conventions: counters end in ``_total`` (no ``_created`` series); names follow vLLM's
where one exists (``num_requests_running``, ``kv_cache_usage_perc``,
``prefix_cache_queries_total``, ``request_success_total{finished_reason}``...), under the
``xlserve_`` prefix. ``EngineCollector`` also serves the router, which re-exports every
worker's engine state with a ``worker`` label.
"""

from __future__ import annotations

import gc
from typing import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from xlserve import native_heap

prometheus_client.disable_created_metrics()  # one series per counter, not two

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1, 2)
GAUGE, COUNTER = "gauge", "counter"
ACCEPTANCE_BUCKETS = 17  # 0..16 accepted proposals: --num-speculative-tokens is at most 16

# (engine stats key, metric name, help, kind); "kv_usage" is derived from the block counts.
ENGINE_METRICS = (
    ("num_running", "xlserve_num_requests_running", "Requests in the running batch", GAUGE),
    ("num_waiting", "xlserve_num_requests_waiting", "Requests waiting to be scheduled", GAUGE),
    ("kv_usage", "xlserve_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)", GAUGE),
    ("kv_blocks_used", "xlserve_kv_blocks_used", "KV-cache blocks in use", GAUGE),
    ("kv_blocks_total", "xlserve_kv_blocks_capacity", "KV-cache blocks in the device pool", GAUGE),
    ("prefix_cache_hit_ratio", "xlserve_prefix_cache_hit_ratio", "Prefix-cache hit tokens / queried tokens",
     GAUGE),
    ("kv_pins", "xlserve_kv_pins", "Exported KV pins held for decode workers to pull", GAUGE),
    ("prefix_cache_queried_tokens", "xlserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
     COUNTER),
    ("prefix_cache_hit_tokens", "xlserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", COUNTER),
    ("num_preemptions", "xlserve_num_preemptions", "Requests preempted for lack of KV blocks", COUNTER),
    ("num_failed_requests", "xlserve_requests_failed_in_engine", "Requests ended by an error inside a step "
     "(the engine served on)", COUNTER),
    ("head_rows_skipped", "xlserve_head_rows_skipped", "Sampling rows the output layer skipped: the request's "
     "grammar admitted one token there, or the row lay past a proposal it forbids", COUNTER),
    ("num_loading", "xlserve_num_requests_loading_kv", "Requests waiting for their prefix from the KV tiers", GAUGE),
    ("kv_tier_timeouts", "xlserve_kv_tier_lookup_timeouts", "Tier lookups past --kv-tier-timeout (the request "
     "computed what had not arrived)", COUNTER),
)

# (tier stats key, metric name, help, kind), one series per tier ("tier" label)
TIER_METRICS = (
    ("hits", "xlserve_kv_tier_hit_blocks", "Blocks loaded from the tier into the device pool", COUNTER),
    ("misses", "xlserve_kv_tier_miss_blocks", "Blocks asked of the tier and not found (bad ones included)", COUNTER),
    ("bytes_read", "xlserve_kv_tier_read_bytes", "Bytes read from the tier", COUNTER),
    ("bytes_written", "xlserve_kv_tier_written_bytes", "Bytes written to the tier", COUNTER),
    ("load_seconds", "xlserve_kv_tier_load_seconds", "Seconds spent reading blocks from the tier", COUNTER),
    ("evictions", "xlserve_kv_tier_evicted_blocks", "Blocks the tier dropped to make room", COUNTER),
    ("dropped", "xlserve_kv_tier_dropped_blocks", "Blocks offered to the tier and not stored", COUNTER),
    ("failures", "xlserve_kv_tier_failures", "Faults met: corrupt blocks, I/O errors, an unreachable store", COUNTER),
    ("skipped", "xlserve_kv_tier_skipped_lookups", "Lookups that passed the tier over: reading its blocks was "
     "measured slower than computing them", COUNTER),
    ("blocks", "xlserve_kv_tier_blocks", "Blocks the tier holds", GAUGE),
    ("capacity_blocks", "xlserve_kv_tier_capacity_blocks", "Blocks the tier holds when full", GAUGE),
    ("enabled", "xlserve_kv_tier_enabled", "1 while the tier serves, 0 after a fault took it out", GAUGE),
)


def _value(stats: dict, key: str) -> float:
    if key == "kv_usage":
        total = stats.get("kv_blocks_total", 0)
        return stats.get("kv_blocks_used", 0) / total if total else 0.0
    return float(stats.get(key, 0))


class EngineCollector(Collector):
    """Engine state at scrape time. ``sources()``: {label value: engine stats}; with
    ``label`` None there is one source and no label (a worker's own engine)."""

    def __init__(self, sources: Callable[[], dict[str, dict]], label: str | None = None):
        self.sources, self.label = sources, label

    def collect(self):
        sources = self.sources()
        for key, name, doc, kind in ENGINE_METRICS:
            family_type = CounterMetricFamily if kind == COUNTER else GaugeMetricFamily
            family = family_type(name, doc, labels=[self.label] if self.label else [])
            for who, stats in sources.items():
                if stats:
                    family.add_metric([who] if self.label else [], _value(stats, key))
            yield family
        yield from self._speculation(sources)
        yield from self._tiers(sources)
        yield from self._data_parallel(sources)

    def _data_parallel(self, sources: dict[str, dict]):
        """Each data-parallel attention rank's share: the requests placed on it, and its own KV pool."""
        labels = ([self.label] if self.label else []) + ["dp_rank"]
        placed = CounterMetricFamily("xlserve_dp_rank_requests", "Requests placed on this data-parallel attention "
                                     "rank (its KV pool holds them)", labels=labels)
        used = GaugeMetricFamily("xlserve_dp_rank_kv_blocks_used", "KV-cache blocks in use in this rank's pool",
                                 labels=labels)
        for who, stats in sources.items():
            for rank, share in enumerate((stats or {}).get("dp_ranks", [])):
                values = ([who] if self.label else []) + [str(rank)]
                placed.add_metric(values, share["placed"])
                used.add_metric(values, share["kv_blocks_used"])
        yield from (placed, used)

    def _tiers(self, sources: dict[str, dict]):
        labels = ([self.label] if self.label else []) + ["tier"]
        for key, name, doc, kind in TIER_METRICS:
            family = (CounterMetricFamily if kind == COUNTER else GaugeMetricFamily)(name, doc, labels=labels)
            for who, stats in sources.items():
                for tier, counts in ((stats or {}).get("kv_tiers") or {}).get("tiers", {}).items():
                    family.add_metric(([who] if self.label else []) + [tier], float(counts[key]))
            yield family
        dropped = CounterMetricFamily("xlserve_kv_tier_dropped_writes", "Blocks not queued for the tiers: the "
                                      "write queue was full", labels=labels[:-1])
        pending = GaugeMetricFamily("xlserve_kv_tier_pending_write_bytes", "Bytes queued for the tiers, not yet "
                                    "stored", labels=labels[:-1])
        for who, stats in sources.items():
            if (tiers := (stats or {}).get("kv_tiers")):
                dropped.add_metric([who] if self.label else [], tiers["dropped_writes"])
                pending.add_metric([who] if self.label else [], tiers["pending_write_bytes"])
        yield from (dropped, pending)

    def _speculation(self, sources: dict[str, dict]):
        """Proposed and accepted tokens by proposer, and a histogram of how many of a step's
        proposals were accepted (0: the model's token replaced the first)."""
        labels = ([self.label] if self.label else []) + ["proposer"]
        proposed = CounterMetricFamily("xlserve_spec_decode_proposed_tokens", "Tokens proposed by speculative "
                                       "decoding and checked", labels=labels)
        accepted = CounterMetricFamily("xlserve_spec_decode_accepted_tokens", "Proposed tokens the model "
                                       "confirmed", labels=labels)
        lengths = HistogramMetricFamily("xlserve_spec_decode_acceptance_length", "Proposals accepted per "
                                        "request and step that checked some", labels=labels)
        for who, stats in sources.items():
            method = (stats or {}).get("spec_method", "none")
            if method == "none":
                continue
            values = ([who] if self.label else []) + [method]
            proposed.add_metric(values, stats["spec_proposed_tokens"])
            accepted.add_metric(values, stats["spec_accepted_tokens"])
            steps = {int(k): v for k, v in stats["spec_acceptance_lengths"].items()}  # JSON keys are strings
            buckets, total = [], 0
            for length in range(ACCEPTANCE_BUCKETS):
                total += steps.get(length, 0)
                buckets.append((str(length), total))
            lengths.add_metric(values, buckets + [("+Inf", sum(steps.values()))],
                               sum_value=stats["spec_accepted_tokens"])
        yield from (proposed, accepted, lengths)


class NativeHeapCollector(Collector):
    """glibc malloc's bytes in use and free, from one walk of its arenas per scrape; nothing
    off glibc (xlserve/native_heap.py)."""

    def collect(self):
        heap = native_heap.usage()
        if heap is None:
            return
        yield GaugeMetricFamily("xlserve_native_heap_in_use_bytes", "Bytes malloc handed out and not yet freed",
                                value=heap.in_use)
        yield GaugeMetricFamily("xlserve_native_heap_free_bytes", "Bytes free inside malloc's arenas, kept for "
                                "reuse; a trim (--heap-trim-interval) hands their whole pages back to the system, "
                                "and malloc still counts them here", value=heap.free)


class WorkerMetrics:
    def __init__(self, engine_stats: Callable[[], dict] | None, model_name: str):
        """``engine_stats``: the engine's counters; None where there is no local engine
        (the router, which adds its workers' instead)."""
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
        self.requests = Counter("xlserve_request_success", "Finished requests by why they ended (abort: the "
                                "client left or cancelled)", ["finished_reason"], registry=r)
        self.errors = Counter("xlserve_request_errors", "Requests refused", ["status"], registry=r)
        self.kv_pulls = Counter("xlserve_kv_pulls", "KV hand-offs this decode worker pulled from a prefill worker, "
                                "by outcome (recomputed: the pull failed and the prompt was computed here)",
                                ["outcome"], registry=r)
        info = Gauge("xlserve_model_info", "Served model", ["model"], registry=r)
        info.labels(model=model_name).set(1)
        GCCollector(registry=r)  # python_gc_*: collections and objects freed, by generation
        Gauge("xlserve_gc_frozen_objects", "Objects the startup froze out of garbage collection (openai/app.py)",
              registry=r).set_function(gc.get_freeze_count)
        r.register(NativeHeapCollector())
        if engine_stats is not None:
            r.register(EngineCollector(lambda: {"": engine_stats()}))

    def finished(self, reason: str, count: int = 1) -> None:
        self.requests.labels(finished_reason=reason).inc(count)

    def observe_finished(self, prompt_tokens: int, cached: int, generated: int, ttft: float | None,
                         e2e: float, finish_reason: str | None) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached)
        self.generation_tokens.inc(generated)
        if ttft is not None:
            self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        self.finished(finish_reason or "unknown")

    def render(self) -> bytes:
        return generate_latest(self.registry)
