"""Samples the processes of a running ``xlserve serve`` over time: per process its RSS,
threads and open file descriptors; per server (router and workers) the bytes glibc's malloc
holds in use and keeps free; per worker its KV blocks in use, pins, running and waiting
requests; for the router its in-flight tokens. The soak suite judges the series
(``growth``, ``fifth_ratio``) and can write them out as JSON and a plot."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import psutil

WORKER_GAUGES = {"kv_blocks_used": "xlserve_kv_blocks_used", "kv_pins": "xlserve_kv_pins",
                 "running": "xlserve_num_requests_running", "waiting": "xlserve_num_requests_waiting"}
# A rising RSS over a flat "in use" is memory the allocator keeps, not a leak (docs/reliability.md).
HEAP_GAUGES = {"heap_in_use_mib": "xlserve_native_heap_in_use_bytes", "heap_free_mib": "xlserve_native_heap_free_bytes"}
PROCESS_FIELDS = ("rss_mib", "threads", "open_files")


def serve_children(serve_pid: int) -> dict[str, int]:
    """role -> pid of ``xlserve serve``'s router and workers."""
    roles = {}
    for child in psutil.Process(serve_pid).children():
        cmd = child.cmdline()
        roles["router" if "router" in cmd else cmd[cmd.index("--role") + 1]] = child.pid
    return roles


def metric_sum(text: str, name: str) -> float:
    """The sum of every series of ``name`` in a Prometheus text page (0 when absent)."""
    pattern = re.compile(rf"^{name}(\{{[^}}]*\}})? (\S+)$", re.M)
    return sum(float(value) for _, value in pattern.findall(text))


class ProcessSampler:
    """Every ``interval`` seconds, one row per process: ``{"t", "process", "pid", *fields}``."""

    def __init__(self, serve_pid: int, router_url: str, interval: float):
        self.serve_pid, self.router_url, self.interval = serve_pid, router_url, interval
        self.pids = {"serve": serve_pid, **serve_children(serve_pid)}
        self.workers = {w["role"]: w["url"] for w in httpx.get(f"{router_url}/router/workers").json()}
        self.servers = {**self.workers, "router": router_url}  # role -> the URL of its /metrics
        self.rows: list[dict] = []
        self._stop, self._t0 = threading.Event(), time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def snapshot(self) -> list[dict]:
        now, rows = time.monotonic() - self._t0, []
        for role, pid in self.pids.items():
            proc = psutil.Process(pid)
            row = {"t": round(now, 2), "process": role, "pid": pid, "rss_mib": proc.memory_info().rss / 2**20,
                   "threads": proc.num_threads(), "open_files": proc.num_fds()}
            if role in self.servers:  # the supervisor serves no metrics
                page = httpx.get(f"{self.servers[role]}/metrics", timeout=10).text
                row.update({key: metric_sum(page, name) / 2**20 for key, name in HEAP_GAUGES.items()})
                if role == "router":
                    row["inflight_tokens"] = metric_sum(page, "xlserve_router_inflight_tokens")
                else:
                    row.update({key: metric_sum(page, name) for key, name in WORKER_GAUGES.items()})
            rows.append(row)
        return rows

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.rows += self.snapshot()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.interval + 30)

    def series(self, process: str, field: str) -> list[tuple[float, float]]:
        return [(r["t"], r[field]) for r in self.rows if r["process"] == process and field in r]


def growth(points: list[tuple[float, float]]) -> float:
    """How much the least-squares line through ``points`` rises from the first to the last."""
    n = len(points)
    if n < 2:
        return 0.0
    mt, mv = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    slope = sum((t - mt) * (v - mv) for t, v in points) / var if var else 0.0
    return slope * (points[-1][0] - points[0][0])


def fifth_ratio(points: list[tuple[float, float]]) -> float:
    """Mean of the last fifth of the values over the mean of the first fifth."""
    k = max(1, len(points) // 5)
    first, last = [v for _, v in points[:k]], [v for _, v in points[-k:]]
    return (sum(last) / len(last)) / (sum(first) / len(first))


def write_report(sampler: ProcessSampler, summary: dict, path_stem: str) -> None:
    """``<stem>.json`` (summary and every sample) and, with matplotlib, ``<stem>.png``."""
    with open(f"{path_stem}.json", "w") as f:
        json.dump({"summary": summary, "samples": sampler.rows}, f, indent=1)
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    labels = ("RSS (MiB)", "threads", "open files", "malloc in use (MiB)")
    for ax, field, label in zip(axes, (*PROCESS_FIELDS, "heap_in_use_mib"), labels):
        for color, process in enumerate(sampler.pids):
            if points := sampler.series(process, field):
                ax.plot([t / 60 for t, _ in points], [v for _, v in points], label=process, color=f"C{color}")
        ax.set_xlabel("minutes")
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"xlserve serve under the soak load: {summary['clients']} clients, {summary['minutes']:g} min, "
                 f"{summary['requests']} requests")
    fig.tight_layout()
    fig.savefig(f"{path_stem}.png", dpi=100)
    plt.close(fig)
