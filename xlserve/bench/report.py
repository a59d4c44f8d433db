"""Tables (markdown), goal checks and PNG charts for benchmark results."""

from __future__ import annotations

from xlserve.bench.engine_bench import ROWS


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.3f}" if value < 10 else f"{value:,.0f}"
    return str(value)


def _with_spread(value, bounds) -> str:
    """The median, and its runs' min-max where there were several distinct figures."""
    if value is None or not bounds or bounds[0] == bounds[1]:
        return _fmt(value)
    return f"{_fmt(value)} ({_fmt(bounds[0])}–{_fmt(bounds[1])})"


def ratio(row_key: str, higher_better: bool, ours: dict, peer: dict) -> float | None:
    a, b = ours.get(row_key), peer.get(row_key)
    if not a or not b:
        return None
    return a / b if higher_better else b / a


def engine_table(results: dict) -> str:
    systems = results["systems"]
    names = [n for n in systems if "error" not in systems[n]]
    peers = [n for n in names if n != "xlserve"]
    head = ["", *names, *(f"xlserve ÷ {p}" for p in peers if "xlserve" in names)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for key, label, higher in ROWS:
        if all(systems[n].get(key) is None for n in names):
            continue  # a row no system measured here (GPU memory on a CPU run)
        cells = [label, *(_with_spread(systems[n].get(key), results.get("spread", {}).get(n, {}).get(key))
                          for n in names)]
        if "xlserve" in names:
            cells += [_fmt(ratio(key, higher, systems["xlserve"], systems[p])) + "×"
                      if ratio(key, higher, systems["xlserve"], systems[p]) else "n/a" for p in peers]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def engine_goals(results: dict) -> list[tuple[str, str, bool | None]]:
    s = results["systems"]
    xl, cpp = s.get("xlserve", {}), s.get("llama.cpp", {})
    read = results["weight_file_read_s"]

    def check(desc, value, target, higher=True):
        if value is None:
            return desc, "n/a", None
        return desc, f"{value:.2f} (goal {'≥' if higher else '≤'} {target:.2f})", \
            value >= target if higher else value <= target
    goals = [
        check("decode b1 vs llama.cpp", ratio("decode_b1_tok_s", True, xl, cpp), 1.2),
        check("prefill 1,000 vs llama.cpp", ratio("prefill_1000_tok_s", True, xl, cpp), 1.5),
        check("prefill 4,000 vs llama.cpp", ratio("prefill_4000_tok_s", True, xl, cpp), 1.5),
        check("aggregate decode 32 seqs vs own batch 1",
              (xl.get("decode_b32_tok_s") or 0) / xl["decode_b1_tok_s"] if xl.get("decode_b1_tok_s") else None, 8.0),
        check("cached vs uncached TTFT at 4,000",
              xl["ttft_uncached_s"] / xl["ttft_cached_s"] if xl.get("ttft_cached_s") else None, 20.0),
        check("memory overhead %", xl.get("overhead_pct"), 10.0, higher=False),
        check("cold start s", xl.get("cold_start_s"), 2 * read + 3.0, higher=False),
    ]
    return goals


def goals_table(goals) -> str:
    lines = ["| goal | measured | met |", "| --- | --- | --- |"]
    for desc, text, ok in goals:
        lines.append(f"| {desc} | {text} | {'yes' if ok else ('n/a' if ok is None else 'no')} |")
    return "\n".join(lines)


def engine_png(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    systems = {n: r for n, r in results["systems"].items() if "error" not in r}
    rows = [(k, label) for k, label, higher in ROWS if higher]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(len(systems), 1)
    for i, (name, r) in enumerate(systems.items()):
        values = [r.get(k) or 0 for k, _ in rows]
        bounds = [results.get("spread", {}).get(name, {}).get(k, (v, v)) for (k, _), v in zip(rows, values)]
        errors = [[v - lo for v, (lo, _) in zip(values, bounds)], [hi - v for v, (_, hi) in zip(values, bounds)]]
        ax.bar([j + i * width for j in range(len(rows))], values, width, label=name, yerr=errors, capsize=3)
    ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(rows))])
    ax.set_xticklabels([label.replace(", ", "\n") for _, label in rows], fontsize=8)
    ax.set_ylabel("tokens / s")
    ax.set_yscale("log")
    where = "GPU" if results["options"].get("device") == "cuda" else f"{results['options']['threads']} threads"
    rounds = results["options"].get("rounds", 1)
    spread = f", median of {rounds} rounds (bars: min-max)" if rounds > 1 else ""
    ax.set_title(f"Engine throughput, {where}, same BF16 weights{spread}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
