"""``xlserve bench serve --tiers``: the conversation trace against a device pool smaller than
its working set, side by side in one run: device only; + host memory; + host + disk; two
workers under round_robin sharing the cluster tier (Mooncake); two workers under session
affinity; and an unbounded device pool (the ideal). Every setup runs the same requests,
``repeats`` times, interleaved (setup 1..6, then again); medians and spreads are reported.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from tqdm.auto import tqdm

from xlserve.bench.serve_bench import Setup, median_rows, run_setup
from xlserve.config import EngineConfig

DEVICE_ONLY, HOST, HOST_DISK = "device only", "+ host", "+ host + disk"
CLUSTER, AFFINITY, IDEAL = "2 workers, round_robin + cluster", "2 workers, affinity + host", "unbounded device pool"
METRICS = ("ttft_p50_s", "ttft_p90_s", "cache_hit_ratio", "output_tok_s")


def tier_setups(device_tokens: int, host_gib: float, disk_dir: str, cores: int) -> list[Setup]:
    both = tuple(range(min(cores, 2)))
    one, two = (0,), (min(1, cores - 1),)
    small = (("cache", "kv_cache_tokens", device_tokens),)
    host = small + (("tiers", "kv_tiers", "host"), ("tiers", "kv_host_gib", host_gib))  # later flags override
    colocated = ("--policy", "least_tokens")
    return [
        Setup(DEVICE_ONLY, (("both", both),), colocated, engine_flags=small),
        Setup(HOST, (("both", both),), colocated, engine_flags=host),
        Setup(HOST_DISK, (("both", both),), colocated,
              engine_flags=host + (("tiers", "kv_tiers", "host,disk"), ("tiers", "kv_disk_dir", disk_dir))),
        Setup(CLUSTER, (("both", one), ("both", two)), ("--policy", "round_robin", "--no-affinity"),
              engine_flags=host + (("tiers", "kv_tiers", "host,mooncake"),), kvstore=True),
        Setup(AFFINITY, (("both", one), ("both", two)), ("--policy", "cache_aware"), engine_flags=host),
        Setup(IDEAL, (("both", both),), colocated, engine_flags=(("cache", "kv_cache_tokens", 1 << 16),)),
    ]


def run_tier_compare(workload, total: int, device_tokens: int, host_gib: float, repeats: int) -> list[dict]:
    """``workload``: ``async run(url, progress)``; returns one row per setup and run."""
    cores = len(os.sched_getaffinity(0))
    rows = []
    with tqdm(total=total * 6 * repeats, desc="bench serve --tiers", unit="req") as bar:
        for run in range(repeats):
            for i in range(6):
                disk = tempfile.mkdtemp(prefix="xlserve-bench-disk-")  # every run starts cold
                try:
                    setup = tier_setups(device_tokens, host_gib, disk, cores)[i]
                    rows += [{**row, "run": run} for row in run_setup(setup, EngineConfig(), {"trace": workload}, bar)]
                finally:
                    shutil.rmtree(disk, ignore_errors=True)
    return rows


def summarize_runs(rows: list[dict]) -> list[dict]:
    """Per setup: the median of each metric over the runs, and its spread (min, max)."""
    return median_rows(rows, METRICS)


def tier_table(summary: list[dict]) -> str:
    lines = ["| setup | TTFT p50 s | TTFT p90 s | cache hit ratio | output tok/s | errors |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in summary:
        cells = []
        for key in METRICS:
            lo, hi = r.get(key + "_spread", (None, None))
            cells.append("n/a" if key not in r else f"{r[key]:.3f} ({lo:.3f}–{hi:.3f})" if r["runs"] > 1
                         else f"{r[key]:.3f}")
        lines.append(f"| {r['setup']} | " + " | ".join(cells) + f" | {r['errors']} |")
    return "\n".join(lines)


def tier_goals(summary: list[dict]) -> list[str]:
    """The issue's goals, each with the measured ratio and whether it was met."""
    by = {r["setup"]: r for r in summary}

    def ratio(a: str, b: str, key: str) -> float | None:
        if by.get(a, {}).get(key) and by.get(b, {}).get(key):
            return by[a][key] / by[b][key]
        return None
    goals = [("cache hit ratio, + host + disk ÷ ideal", ratio(HOST_DISK, IDEAL, "cache_hit_ratio"), 0.95),
             ("TTFT p50, device only ÷ + host + disk", ratio(DEVICE_ONLY, HOST_DISK, "ttft_p50_s"), 3.0),
             ("cache hit ratio, round_robin + cluster ÷ affinity", ratio(CLUSTER, AFFINITY, "cache_hit_ratio"), 0.95)]
    return [f"{label}: {value:.2f} (goal ≥ {goal:g}: {'met' if value >= goal else 'missed'})"
            for label, value, goal in goals if value is not None]


def tier_png(summary: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["setup"] for r in summary]
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for ax, key, label in ((axes[0], "ttft_p50_s", "TTFT p50, s (lower is better)"),
                           (axes[1], "cache_hit_ratio", "cache hit ratio (higher is better)")):
        values = [r.get(key) or 0 for r in summary]
        spreads = [r.get(key + "_spread", (v, v)) for r, v in zip(summary, values)]
        errors = [[v - lo for v, (lo, _) in zip(values, spreads)], [hi - v for v, (_, hi) in zip(values, spreads)]]
        ax.barh(names, values, xerr=errors, capsize=3)
        ax.invert_yaxis()
        ax.set_xlabel(label)
    axes[1].set_yticklabels([])
    fig.suptitle("bench serve --tiers: the conversation trace, device pool smaller than its working set")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
