"""Child process of ``xlserve bench engine``: measures one system and prints one JSON line.

Run in a fresh process per system so its peak RSS and its cold start (process start to
first token) are its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from statistics import median


def rss_bytes(field: str = "VmHWM", pid: int | None = None) -> int:
    """VmHWM: peak resident set; VmRSS: current; of this process or ``pid``."""
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


RUNTIME_IMPORTS = {"xlserve": ("torch", "xlserve.engine.llm_engine"), "llama.cpp": ("httpx",),
                   "transformers": ("torch", "transformers")}


def make_system(spec: dict):
    name = spec["system"]
    if name == "xlserve":
        from xlserve.bench.engine_systems import XlserveSystem
        return XlserveSystem(spec["model"], spec["dtype"], spec["threads"], spec["kv_tokens"], spec["budget"],
                             spec["device"], **spec["engine_options"])
    if name == "llama.cpp":
        from xlserve.bench.llama_cpp_peer import LlamaServerSystem
        return LlamaServerSystem(spec["model"], spec["threads"], spec["kv_tokens"], spec["flash_attn"],
                                 spec["llama_batch"], max(map(int, spec["workload"]["batches"])))
    if name == "transformers":
        from xlserve.bench.engine_systems import TransformersSystem
        return TransformersSystem(spec["model"], spec["threads"], spec["device"], spec.get("dtype", "auto"))
    raise ValueError(f"unknown system {name!r}")


def measure(spec: dict, spawn_time: float) -> dict:
    w = spec["workload"]
    import importlib
    for module in RUNTIME_IMPORTS[spec["system"]]:
        importlib.import_module(module)
    runtime_rss = rss_bytes("VmRSS")  # the interpreter and libraries, before any model
    system = make_system(spec)
    try:
        return _figures(system, w, spawn_time, runtime_rss, spec)
    finally:
        system.close()


def _figures(system, w: dict, spawn_time: float, runtime_rss: int, spec: dict) -> dict:
    system.prefill(w["chat"][:32])
    cold_start = time.time() - spawn_time
    system.decode(w["chat"], 8)  # warm-up
    repeats = len(w["cache_pairs"])
    out = {"system": system.name, "cold_start_s": cold_start, "repeats": repeats,
           "decode_b1_tok_s": median(system.decode(w["chat"], w["decode_tokens"]) for _ in range(repeats))}
    seconds = {n: [system.prefill(ids) for ids in prompts] for n, prompts in w["prefill"].items()}
    for n, runs in seconds.items():
        out[f"prefill_{n}_tok_s"] = median(int(n) / s for s in runs)
    for n, prompts in w["batches"].items():
        out[f"decode_b{n}_tok_s"] = system.decode_batch(prompts, w["batch_tokens"])
    out["ttft_uncached_s"] = median(seconds["4000"])  # each a fresh prompt: nothing cached
    out["ttft_cached_s"] = median(system.cached_ttft(first, second) for first, second in w["cache_pairs"])
    out["peak_rss_bytes"] = rss_bytes("VmHWM", system.pid)
    out["peak_gpu_bytes"] = system.peak_gpu_bytes()
    out["runtime_rss_bytes"] = 0 if system.pid else runtime_rss  # a server has no interpreter of its own
    out["weights_bytes"] = system.weights_bytes() or spec.get("weights_file_bytes", 0)
    out["kv_bytes"] = system.kv_bytes()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True, help="JSON file with the system and the workload")
    parser.add_argument("--spawn-time", type=float, required=True, help="time.time() when the parent spawned us")
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    print(json.dumps(measure(spec, args.spawn_time)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
