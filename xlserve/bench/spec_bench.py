"""``xlserve bench spec``: speculative decoding on this machine, each proposer beside none.

Two kinds of answers, both greedy, through the model's chat template:

- tool calls: the agentic workload's asks with its four tools in the prompt, answered with
  one call as the server answers ``tool_choice: "required"`` (the model's tool-call format
  under its grammar, which checks each proposal too): an agent's turn;
- free text: short writing prompts.

For each, batch 1 (the prompts one at a time) and batch 8 (eight at once): decode tokens
per second — the tokens emitted after each request's first one, over the time from the
step that emitted the batch's first tokens to the last step. Every setup runs the same
prompts, the setups alternating, ``--repeats`` times (median and range); the answers of
each proposer are checked against none's (they must be identical), and the mean accepted
proposals per checking step and tokens per request-step are reported beside. Each
measurement starts the proposer from nothing (the suffix proposer's store of earlier
answers is emptied): within one, earlier answers to other prompts are fair game.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from statistics import median

from xlserve.bench.agentic import ASKS, TOOLS

TOOL_SYSTEM = "You are a coding agent. Answer with exactly one tool call."
FREE_TEXT = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
             "Describe your favourite city.", "Write a poem about autumn leaves.",
             "Give advice to a new programmer.", "Describe a day at the beach.",
             "Explain why the sky is blue.", "Tell me about the history of tea."]


@dataclass(frozen=True)
class SpecBenchOptions:
    model: str = "default"
    methods: tuple[str, ...] = ("none", "ngram")
    repeats: int = 3
    max_tokens: int = 64
    dtype: str = "auto"
    int8_activations: bool = False  # kept Q4_0 / Q4_1 / Q8_0 weights: llama.cpp's 8-bit activations
    batches: tuple[int, ...] = (1, 8)
    prompts: int = 8  # per workload (at most 8)


def workloads(tokenizer, count: int = 8) -> dict[str, list[list[int]]]:
    """Prompt token ids of each workload, ``count`` each."""
    tools = [{"role": "system", "content": TOOL_SYSTEM}]
    asks = (ASKS * 2)[:count]
    return {"tool_calls": [tokenizer.encode_chat(tools + [{"role": "user", "content": a}], tools=TOOLS)
                           for a in asks],
            "free_text": [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in FREE_TEXT[:count]]}


def tool_call_grammar(tokenizer):
    """The constraint of a forced call to one of the workload's tools, in the model's format."""
    from xlserve.openai.tool_parsers import detect_tool_parser, get_tool_parser
    parser = get_tool_parser(detect_tool_parser(tokenizer.chat_template.source), tokenizer.special_token_ids)
    return parser.forced_call_grammar(TOOLS, None, False)


def decode_run(engine, prompts: list[list[int]], max_tokens: int, guided=None) -> dict:
    """One batch to the end: decode seconds and tokens (after every request's first), the
    answers, the proposals' fate."""
    from xlserve.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0, guided=guided)
    stats = engine.speculation.stats
    before = (stats.proposed, stats.accepted, sum(stats.lengths.values()))
    ids = [f"spec-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    answers, begun, started, tokens, request_steps = {}, set(), None, 0, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for out in outputs:
            if started is not None:
                tokens += len(out.new_token_ids)
                request_steps += 1 if out.new_token_ids else 0
            begun.add(out.request_id)
            if out.finished:
                answers[out.request_id] = out.outputs[0].token_ids
        if started is None and len(begun) == len(ids):
            started = time.perf_counter()  # every request has its first token: prefill is behind
    seconds = time.perf_counter() - (started or time.perf_counter())
    proposed, accepted, checks = (stats.proposed - before[0], stats.accepted - before[1],
                                  sum(stats.lengths.values()) - before[2])
    return {"seconds": seconds, "tokens": tokens, "answers": [answers[r] for r in ids], "proposed": proposed,
            "accepted": accepted, "checks": checks, "request_steps": request_steps}


def measure(engine, prompts: list[list[int]], batch: int, max_tokens: int, guided=None) -> dict:
    """The prompts in batches of ``batch``, the proposer starting from nothing: answers of an
    earlier run (the same prompts) would make the next one's a replay."""
    engine.speculation.reset()
    runs = [decode_run(engine, prompts[i:i + batch], max_tokens, guided) for i in range(0, len(prompts), batch)]
    total = {k: sum(r[k] for r in runs) for k in ("seconds", "tokens", "proposed", "accepted", "checks",
                                                   "request_steps")}
    total["answers"] = [a for r in runs for a in r["answers"]]
    return total


def run_spec_bench(opts: SpecBenchOptions) -> dict:
    from xlserve import LLM
    llms = {m: LLM(opts.model, dtype=opts.dtype, speculative=m, int8_activations=opts.int8_activations)
            for m in opts.methods}
    try:
        tokenizer = next(iter(llms.values())).tokenizer
        prompts = workloads(tokenizer, opts.prompts)
        guided = {"tool_calls": tool_call_grammar(tokenizer), "free_text": None}
        for llm in llms.values():  # warm-up: first-call costs stay out of the figures
            decode_run(llm.engine, prompts["free_text"][:1], 8)
        runs: dict = {w: {str(b): {m: [] for m in opts.methods} for b in opts.batches} for w in prompts}
        for _ in range(opts.repeats):  # interleaved: a drifting machine hits every setup alike
            for workload, ids in prompts.items():
                for batch in opts.batches:
                    for method, llm in llms.items():
                        runs[workload][str(batch)][method].append(
                            measure(llm.engine, ids, batch, opts.max_tokens, guided[workload]))
    finally:
        for llm in llms.values():
            llm.close()
    return {"model": opts.model, "repeats": opts.repeats, "max_tokens": opts.max_tokens,
            "int8_activations": opts.int8_activations,
            "summary": {w: {b: summarize(r) for b, r in by_batch.items()} for w, by_batch in runs.items()}}


def summarize(by_method: dict[str, list[dict]]) -> dict:
    """tok/s (median, range), the speedup over none, acceptance, and whether the answers equal
    none's. The speedup is the median of each round's ratio to none's run in the same round
    (and its range): on a noisy VM two runs minutes apart differ by more than a proposer's
    gain, two runs side by side much less; the ratio of the medians is kept beside it."""
    reference = by_method.get("none", [{}])[0].get("answers")
    rates = {method: [r["tokens"] / r["seconds"] for r in runs] for method, runs in by_method.items()}
    out = {}
    for method, runs in by_method.items():
        checks, steps = sum(r["checks"] for r in runs), sum(r["request_steps"] for r in runs)
        out[method] = {"tok_s": _spread(rates[method]),
                       "accepted_per_check": sum(r["accepted"] for r in runs) / checks if checks else 0.0,
                       "proposed_per_check": sum(r["proposed"] for r in runs) / checks if checks else 0.0,
                       "tokens_per_request_step": sum(r["tokens"] for r in runs) / steps if steps else 0.0,
                       "same_answers": reference is None or all(r["answers"] == reference for r in runs)}
        if "none" in rates:
            paired = _spread([mine / none for mine, none in zip(rates[method], rates["none"])])
            out[method].update(speedup=paired["median"], speedup_range=[paired["min"], paired["max"]],
                               speedup_of_medians=out[method]["tok_s"]["median"] / median(rates["none"]))
        else:
            out[method]["speedup"] = None
    return out


def _spread(values: list[float]) -> dict:
    return {"median": median(values), "min": min(values), "max": max(values)}


def spec_table(results: dict) -> str:
    lines = [f"{'workload':<11} {'batch':>5} {'proposer':<8} {'decode tok/s':>22} {'speedup (paired)':>20} "
             f"{'accepted/check':>15} {'tokens/step':>12} {'same answers':>13}"]
    for workload, by_batch in results["summary"].items():
        for batch, by_method in by_batch.items():
            for method, r in by_method.items():
                t, low, high = r["tok_s"], *r.get("speedup_range", (1.0, 1.0))
                lines.append(f"{workload:<11} {batch:>5} {method:<8} "
                             f"{t['median']:>8.1f} ({t['min']:.1f}-{t['max']:.1f}) "
                             f"{r['speedup']:>7.2f}x ({low:.2f}-{high:.2f}) "
                             f"{r['accepted_per_check']:>15.2f} {r['tokens_per_request_step']:>12.2f} "
                             f"{'yes' if r['same_answers'] else 'NO':>13}")
    return "\n".join(lines)


def spec_plot(results: dict, path: str) -> None:
    """Speedup over none per workload and batch, a bar per proposer, its rounds' range."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = [(w, b) for w, by_batch in results["summary"].items() for b in by_batch]
    methods = [m for m in next(iter(next(iter(results["summary"].values())).values())) if m != "none"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        rows = [results["summary"][w][b][method] for w, b in groups]
        ranges = [r.get("speedup_range", (r["speedup"], r["speedup"])) for r in rows]
        ax.bar([g + i * width for g in range(len(groups))], [r["speedup"] for r in rows], width, label=method,
               yerr=[[r["speedup"] - low for r, (low, _) in zip(rows, ranges)],
                     [high - r["speedup"] for r, (_, high) in zip(rows, ranges)]], capsize=2)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([g + width * (len(methods) - 1) / 2 for g in range(len(groups))],
                  [f"{w.replace('_', ' ')}, batch {b}" for w, b in groups])
    ax.set_ylabel("decode tok/s vs none (paired rounds:\nmedian, range)")
    ax.set_title(f"Speculative decoding, {results['model']} model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
