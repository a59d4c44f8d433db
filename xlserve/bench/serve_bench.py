"""``xlserve bench serve``: the agentic workload against one server, or side by side
against configurations this command starts itself: one colocated worker vs prefill +
decode workers, and two workers under round_robin vs cache_aware vs session affinity.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass

from tqdm.auto import tqdm

from xlserve.bench.agentic import run_agentic, summarize
from xlserve.config import EngineConfig
from xlserve.launcher import free_port, start_worker, stop_all, wait_healthy


@dataclass(frozen=True)
class Setup:
    name: str
    workers: tuple[tuple[str, tuple[int, ...]], ...]  # (role, cores)
    router_flags: tuple[str, ...]


def setups(cores: int) -> list[Setup]:
    one, two = (0,), (min(1, cores - 1),)
    both_cores = tuple(range(min(cores, 2)))
    return [
        Setup("colocated, 1 worker", (("both", both_cores),), ("--policy", "least_tokens")),
        Setup("PD, 1 prefill + 1 decode", (("prefill", one), ("decode", two)), ("--policy", "least_tokens")),
        Setup("2 workers, round_robin", (("both", one), ("both", two)), ("--policy", "round_robin", "--no-affinity")),
        Setup("2 workers, cache_aware", (("both", one), ("both", two)), ("--policy", "cache_aware", "--no-affinity")),
        Setup("2 workers, affinity", (("both", one), ("both", two)), ("--policy", "cache_aware")),
    ]


def _router(urls_by_role: dict, flags, key: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [sys.executable, "-m", "xlserve.cli", "router", "--port", str(port), "--log-level", "warning",
            "--worker-api-key", key, *flags]
    for role in ("prefill", "decode", "both"):
        if urls_by_role.get(role):
            args += [f"--{role}", *urls_by_role[role]]
    return subprocess.Popen(args), f"http://127.0.0.1:{port}"


def run_setup(setup: Setup, engine: EngineConfig, workload: dict, progress) -> dict:
    key = secrets.token_hex(16)
    procs = []
    try:
        urls: dict[str, list[str]] = {}
        for role, cores in setup.workers:
            proc, url = start_worker(role if role != "both" else "both", engine, key, "warning", list(cores))
            procs.append((proc, url))
            urls.setdefault(role, []).append(url)
        wait_healthy(procs)
        router = _router(urls, setup.router_flags, key)
        procs.append(router)
        wait_healthy([router])
        result = asyncio.run(run_agentic(router[1], progress=progress, **workload))
        return {"setup": setup.name, **summarize(result)}
    finally:
        stop_all(procs)


def run_compare(engine: EngineConfig, workload: dict) -> list[dict]:
    cores = len(os.sched_getaffinity(0))
    plan = setups(cores)
    total = len(plan) * workload["sessions"] * workload["turns"]
    with tqdm(total=total, desc="bench serve", unit="turn") as bar:
        return [run_setup(s, engine, workload, bar) for s in plan]


COLUMNS = [("ttft_p50_s", "TTFT p50 s"), ("ttft_p90_s", "TTFT p90 s"), ("itl_p50_s", "ITL p50 s"),
           ("itl_p90_s", "ITL p90 s"), ("itl_p99_s", "ITL p99 s"), ("output_tok_s", "output tok/s"),
           ("cache_hit_ratio", "cache hit ratio"), ("cost_usd", "cost USD"), ("errors", "errors")]


def serve_table(rows: list[dict]) -> str:
    def fmt(v):
        return "n/a" if v is None else (f"{v:.4f}" if isinstance(v, float) and v < 1 else
                                        f"{v:.2f}" if isinstance(v, float) else str(v))
    lines = ["| setup | " + " | ".join(label for _, label in COLUMNS) + " |", "|" + " --- |" * (len(COLUMNS) + 1)]
    lines += ["| " + r["setup"] + " | " + " | ".join(fmt(r.get(k)) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def serve_ratios(rows: list[dict]) -> list[str]:
    by = {r["setup"]: r for r in rows}
    out = []
    colo, pd = by.get("colocated, 1 worker"), by.get("PD, 1 prefill + 1 decode")
    if colo and pd and colo.get("itl_p90_s") and pd.get("itl_p90_s"):
        out.append(f"p90 inter-token latency, colocated ÷ PD: {colo['itl_p90_s'] / pd['itl_p90_s']:.2f}×")
    rr, ca = by.get("2 workers, round_robin"), by.get("2 workers, cache_aware")
    if rr and ca and rr.get("cache_hit_ratio"):
        out.append(f"cache hit ratio, cache_aware ÷ round_robin: {ca['cache_hit_ratio'] / rr['cache_hit_ratio']:.2f}×")
    aff = by.get("2 workers, affinity")
    if rr and aff and rr.get("cache_hit_ratio"):
        out.append(f"cache hit ratio, affinity ÷ round_robin: {aff['cache_hit_ratio'] / rr['cache_hit_ratio']:.2f}×")
    return out


def serve_png(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["setup"] for r in rows]
    a.barh(names, [r.get("itl_p90_s") or 0 for r in rows])
    a.set_xlabel("p90 inter-token latency, s")
    b.barh(names, [r.get("cache_hit_ratio") or 0 for r in rows])
    b.set_xlabel("cache hit ratio")
    b.set_yticklabels([])
    fig.suptitle("Agentic workload, same sessions against each setup")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
