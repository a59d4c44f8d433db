"""Build the xlserve Grafana dashboard (``xlserve-dashboard.json`` beside this file) with
Grafana's own typed SDK, so the JSON follows Grafana's dashboard schema by construction.
It reads a router's /metrics (which carries every worker's engine state, labelled
``worker``); point Prometheus at the router.

    python deploy/grafana/dashboard.py   # rewrites xlserve-dashboard.json
"""

from __future__ import annotations

import json
import pathlib

from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

OUT = pathlib.Path(__file__).with_name("xlserve-dashboard.json")
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "[$__rate_interval]"


def quantiles(metric: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{RATE})))", f"p{int(q * 100)}")
            for q in (0.5, 0.95, 0.99)]


# (row, [(panel title, unit, [(PromQL, legend)])])
PANELS = [
    ("Latency", [
        ("Time to first token", "s", quantiles("xlserve_time_to_first_token_seconds")),
        ("Inter-token latency", "s", quantiles("xlserve_inter_token_latency_seconds")),
        ("End-to-end request latency", "s", quantiles("xlserve_e2e_request_latency_seconds")),
    ]),
    ("Throughput and cache", [
        ("Tokens per second", "short", [(f"rate(xlserve_generation_tokens_total{RATE})", "generated"),
                                        (f"rate(xlserve_prompt_tokens_total{RATE})", "prompt"),
                                        (f"rate(xlserve_cached_prompt_tokens_total{RATE})", "prompt, cached")]),
        ("Prefix-cache hit ratio", "percentunit", [
            (f"rate(xlserve_cached_prompt_tokens_total{RATE}) / rate(xlserve_prompt_tokens_total{RATE})", "served"),
            (f"sum by (worker) (rate(xlserve_prefix_cache_hits_total{RATE})) / "
             f"sum by (worker) (rate(xlserve_prefix_cache_queries_total{RATE}))", "{{worker}}")]),
        ("Requests by how they ended", "reqps", [
            (f"sum by (finished_reason) (rate(xlserve_request_success_total{RATE}))", "{{finished_reason}}"),
            (f"sum by (status) (rate(xlserve_request_errors_total{RATE}))", "refused {{status}}")]),
    ]),
    ("Workers", [
        ("In-flight tokens", "short", [("xlserve_router_inflight_tokens", "{{worker}} {{kind}}")]),
        ("KV-cache usage", "percentunit", [("xlserve_kv_cache_usage_perc", "{{worker}}")]),
        ("Running and waiting requests", "short", [("xlserve_num_requests_running", "running {{worker}}"),
                                                   ("xlserve_num_requests_waiting", "waiting {{worker}}")]),
        ("Preemptions and failed requests", "short", [
            (f"rate(xlserve_num_preemptions_total{RATE})", "preempted {{worker}}"),
            (f"rate(xlserve_requests_failed_in_engine_total{RATE})", "failed {{worker}}")]),
    ]),
    ("KV transfers (prefill -> decode)", [
        ("Transfer bandwidth", "Bps", [(f"rate(xlserve_kv_transfer_bytes_total{RATE})", "bytes")]),
        ("Transfer latency", "s", quantiles("xlserve_kv_transfer_seconds")),
        ("Transfer failures and aborts", "short", [
            (f"rate(xlserve_kv_transfer_failures_total{RATE})", "failed pulls"),
            (f"sum(rate(xlserve_request_success_total{{finished_reason=\"abort\"}}{RATE}))", "aborted requests")]),
    ]),
]


def build() -> dict:
    dashboard = (Dashboard("xlserve").uid("xlserve").tags(["xlserve", "llm"]).refresh("10s")
                 .time("now-1h", "now").with_variable(DatasourceVariable("datasource").label("Prometheus")
                                                      .type("prometheus")))
    for row, panels in PANELS:
        dashboard = dashboard.with_row(Row(row))
        for title, unit, queries in panels:
            panel = Panel().title(title).unit(unit).datasource(DS).height(8).span(8)
            for i, (expr, legend) in enumerate(queries):
                panel = panel.with_target(Dataquery().expr(expr).legend_format(legend).ref_id("ABCD"[i]))
            dashboard = dashboard.with_panel(panel)
    return json.loads(json.dumps(dashboard.build(), cls=JSONEncoder))


if __name__ == "__main__":
    OUT.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {OUT}")
