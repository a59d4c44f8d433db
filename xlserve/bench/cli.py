"""``xlserve bench engine`` wiring: flags, progress, table, JSON, PNG."""

from __future__ import annotations

import json

from xlserve.bench.trace_replay import DEFAULT_TRACE
from xlserve.kernels import cpu_isa


def write_results(path: str, results: dict) -> None:
    """The run's figures as JSON, with the machine they were measured on (``cpu_isa.machine``:
    a run capped by XLSERVE_MAX_CPU_ISA says so)."""
    with open(path, "w") as f:
        json.dump({**results, "machine": cpu_isa.machine()}, f, indent=2)


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: xlserve beside its peers in one run")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    for add in (_engine_parser, _serve_parser, _parallel_parser, _spec_parser, _quantized_parser):
        add(kinds)


def _engine_parser(kinds) -> None:
    e = kinds.add_parser("engine", help="engine speed and memory vs llama.cpp and transformers",
                         description="Runs xlserve and its peers (llama.cpp's own server and llama-bench, "
                                     "transformers) on the same BF16 weights, token ids and threads, one process "
                                     "each; llama.cpp with flash attention on and off, the better figure counting.")
    e.add_argument("--model", default="default",
                   help="GGUF model (default: the bundled SmolLM2-135M), or a Hugging Face directory "
                        "(then without llama.cpp)")
    e.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="xlserve dtype; auto as in serving: bfloat16 where the CPU has bf16 math, else float32")
    e.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="device of xlserve and transformers (auto: cuda when present)")
    e.add_argument("--threads", type=int, default=2, help="threads for every system")
    e.add_argument("--systems", default="xlserve,llama.cpp,transformers", help="comma-separated systems to run")
    e.add_argument("--out", default="bench-engine.json", help="where to write the JSON results")
    e.add_argument("--png", default="", help="also write a bar chart here")
    e.add_argument("--budget", type=int, default=2048, help="xlserve token budget per step")
    e.add_argument("--repeats", type=int, default=3,
                   help="latency figures (decode b1, prefill, TTFT) are the median of this many runs")
    e.add_argument("--rounds", type=int, default=1,
                   help="run every system this many times, each in a fresh process, rounds interleaved; "
                        "the table shows each figure's median over the rounds and its min-max")
    e.add_argument("--prepack-weights", action="store_true",
                   help="run xlserve with a oneDNN-prepacked copy of its weights (faster batches, 2x weights)")
    e.add_argument("--no-cuda-graphs", action="store_true",
                   help="run xlserve's decode steps eagerly on CUDA instead of replaying CUDA graphs")
    e.set_defaults(func=cmd_bench_engine)


def _serve_parser(kinds) -> None:
    s = kinds.add_parser("serve", help="agentic multi-turn workload: one server, or setups side by side",
                         description="Runs N sessions x T turns of an agentic workload (shared system prompt with "
                                     "tools, growing history, short answers, x-session-affinity) and a scaled replay "
                                     "of a public request trace. With --url, against that server; without, it starts "
                                     "and compares: colocated vs prefill+decode, two workers under round_robin, "
                                     "cache_aware and session affinity, and llama.cpp's llama-server when installed.")
    s.add_argument("--url", default="", help="an OpenAI-compatible server to measure (default: compare setups)")
    s.add_argument("--sessions", type=int, default=8, help="agent sessions")
    s.add_argument("--turns", type=int, default=4, help="turns per session")
    s.add_argument("--concurrency", type=int, default=4, help="sessions running at once")
    s.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    s.add_argument("--trace", default=DEFAULT_TRACE, help="request trace to replay (JSONL, optionally gzipped; "
                   "default: the Mooncake conversation trace shipped with xlserve)")
    s.add_argument("--trace-requests", type=int, default=40,
                   help="trace requests to replay, whole conversations sampled at random (0: no replay)")
    s.add_argument("--trace-length-scale", type=float, default=1 / 32,
                   help="prompt and output lengths are multiplied by this")
    s.add_argument("--trace-min-turns", type=int, default=1, help="replay only conversations of at least this many "
                   "requests (agent sessions that come back)")
    s.add_argument("--trace-seconds", type=float, default=40.0, help="the sampled arrivals are squeezed into this")
    s.add_argument("--no-peers", action="store_true", help="skip llama-server even when installed")
    s.add_argument("--tiers", action="store_true", help="instead: the trace against a small device pool, with and "
                   "without KV tiers (host, disk, the cluster store), beside an unbounded pool")
    s.add_argument("--kv-cache-tokens", type=int, default=4096, help="with --tiers: the device pool, in tokens")
    s.add_argument("--kv-host-gib", type=float, default=0.25, help="with --tiers: each worker's host tier")
    s.add_argument("--repeats", type=int, default=1, help="runs of every setup, interleaved; tables show the "
                   "median and its spread")
    s.add_argument("--setups", default="", help="comma-separated: run only the setups whose names contain one of "
                   "these (e.g. 'llama-server' for llama-server alone and behind the router)")
    s.add_argument("--out", default="bench-serve.json", help="where to write the JSON results")
    s.add_argument("--png", default="", help="also write a chart here")
    s.set_defaults(func=cmd_bench_serve)


def _parallel_parser(kinds) -> None:
    p = kinds.add_parser("parallel", help="tensor and pipeline parallelism: load and step times, one rank "
                         "beside several",
                         description="Loads the model in each layout (alternating, --repeats times) and times the "
                                     "load against a raw read of its files, a 512-token prefill and batch-1 / "
                                     "batch-8 decode steps, with the share of each step rank 0 spent in "
                                     "collectives and transfers between stages.")
    p.add_argument("--model", default="", help="a Hugging Face directory (default: a 0.2B Llama-shaped model "
                   "with random weights, written under --workdir)")
    p.add_argument("--layouts", default="1x1,2x1,1x2", help="comma-separated TPxPP layouts: tensor-parallel "
                   "ranks per stage x pipeline stages (1x1: one process); for a MoE, TPxPPep splits the experts "
                   "over the tensor-parallel ranks and TPxPPdp adds data-parallel attention")
    p.add_argument("--moe", action="store_true", help="without --model: a 0.3B DeepSeek-V3-shaped MoE with random "
                   "weights (latent attention, 16 experts, 4 a token) instead of the Llama-shaped one")
    p.add_argument("--repeats", type=int, default=3, help="runs of every layout, alternating")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    p.add_argument("--workdir", default=".bench-parallel", help="where the synthetic model is written")
    p.add_argument("--out", default="bench-parallel.json", help="where to write the JSON results")
    p.set_defaults(func=cmd_bench_parallel)


def _spec_parser(kinds) -> None:
    s = kinds.add_parser("spec", help="speculative decoding: decode tok/s with each proposer beside none",
                         description="Greedy answers to tool-call and free-text prompts through the model's chat "
                                     "template, at batch 1 and batch 8, with each proposer and without "
                                     "(alternating, --repeats times): decode tokens per second, the speedup, the "
                                     "accepted proposals per checking step, and whether the answers equal none's.")
    s.add_argument("--model", default="default", help="the model to serve (default: the shipped default model)")
    s.add_argument("--methods", default="none,ngram", help="comma-separated --speculative values; none first")
    s.add_argument("--repeats", type=int, default=3, help="runs of every setup, alternating")
    s.add_argument("--max-tokens", type=int, default=64, help="tokens per answer at most")
    s.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    s.add_argument("--int8-activations", action="store_true",
                   help="every setup multiplies kept Q4_0 / Q4_1 / Q8_0 weights by 8-bit activations, as "
                        "llama.cpp does")
    s.add_argument("--out", default="bench-spec.json", help="where to write the JSON results")
    s.add_argument("--png", default="", help="also write a chart here")
    s.set_defaults(func=cmd_bench_spec)


def _quantized_parser(kinds) -> None:
    q = kinds.add_parser("quantized", help="a quantized GGUF as shipped: xlserve vs llama.cpp",
                         description="On the model's own GGUF file (the default: Q4_1): xlserve keeping the weights "
                                     "as stored (fp32 and 8-bit activations) and dequantized, beside llama.cpp's "
                                     "llama-bench at its best (flash attention on and off, weights repacked and as "
                                     "stored), each in a fresh process, interleaved over --repeats rounds: batch-1 "
                                     "decode, 512-token prefill, 32 sequences, peak RSS; medians and min-max.")
    q.add_argument("--model", default="default", help="a GGUF file (default: the shipped Q4_1 model)")
    q.add_argument("--threads", type=int, default=2, help="threads for every setup")
    q.add_argument("--repeats", type=int, default=3, help="rounds, every setup once per round")
    q.add_argument("--out", default="bench-quantized.json", help="where to write the JSON results")
    q.set_defaults(func=cmd_bench_quantized)


def cmd_bench_quantized(args) -> int:
    from xlserve.bench.quant_bench import run_quantized_bench, table
    results = run_quantized_bench(args.model, args.threads, args.repeats)
    write_results(args.out, results)
    print(table(results))
    for setup, why in results.get("skipped", {}).items():
        print(f"skipped {setup}: {why}")
    return 0


def cmd_bench_engine(args) -> int:
    from xlserve.bench.engine_bench import BenchOptions, run_bench
    from xlserve.bench.report import engine_goals, engine_png, engine_table, goals_table
    opts = BenchOptions(model=args.model, dtype=args.dtype, device=args.device, threads=args.threads,
                        systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()),
                        out=args.out, png=args.png, budget=args.budget, repeats=args.repeats,
                        rounds=args.rounds, prepack=args.prepack_weights, cuda_graphs=not args.no_cuda_graphs)
    results = run_bench(opts)
    results["goals"] = engine_goals(results) if "xlserve" in results["systems"] else []
    write_results(opts.out, results)
    print(engine_table(results))
    print()
    print(f"weight file read: {results['weight_file_read_s']:.2f} s ({results['weights']})")
    for system, why in results["skipped"].items():
        print(f"skipped {system}: {why}")
    for system, r in results["systems"].items():
        if "error" in r:
            print(f"{system} failed: {r['error']}")
    for i, run in enumerate(results["rounds"].get("llama.cpp", []), 1):  # what each round's llama.cpp chose
        if "flash_attn" in run:
            print(f"round {i}: llama.cpp flash attention by figure: {run['flash_attn']}")
        if "llama_bench" in run:
            print(f"round {i}: llama-bench on the same file: {run['llama_bench']}")
    if results["goals"]:
        print()
        print(goals_table(results["goals"]))
    if opts.png:
        engine_png(results, opts.png)
        print(f"chart: {opts.png}")
    return 0


def cmd_bench_serve(args) -> int:
    import asyncio

    import httpx

    from xlserve.bench.agentic import run_agentic, summarize
    from xlserve.bench.serve_bench import run_compare, serve_png, serve_ratios, serve_table
    from xlserve.bench.trace_replay import TraceReplay, build_requests, describe, load_trace, run_trace
    from xlserve.config import EngineConfig
    agentic = {"sessions": args.sessions, "turns": args.turns, "concurrency": args.concurrency,
               "max_tokens": args.max_tokens}
    workloads = {"agentic": lambda url, bar: run_agentic(url, progress=bar, **agentic)}
    total = args.sessions * args.turns
    scale = None
    if args.trace_requests:
        replay = TraceReplay(path=args.trace, requests=args.trace_requests, length_scale=args.trace_length_scale,
                             duration_s=args.trace_seconds, min_turns=args.trace_min_turns)
        trace_requests, scale = build_requests(load_trace(replay.path), replay)
        print(describe(scale))
        workloads["trace"] = lambda url, bar: run_trace(url, trace_requests, progress=bar)
        total += len(trace_requests)
    if args.tiers:
        return _bench_tiers(args, workloads.get("trace"), total - args.sessions * args.turns, scale)
    if args.url:
        try:
            rows = [{"setup": args.url, "workload": name, **summarize(asyncio.run(run(args.url.rstrip("/"), None)))}
                    for name, run in workloads.items()]
        except httpx.HTTPError as e:
            raise ValueError(f"cannot measure {args.url}: {e}") from e
    else:
        only = tuple(part.strip() for part in args.setups.split(",") if part.strip())
        rows = run_compare(EngineConfig(), workloads, total, peers=not args.no_peers, only=only,
                           repeats=args.repeats)
    write_results(args.out, {"agentic": agentic, "trace_scale": scale, "results": rows})
    print(serve_table(rows))
    for line in serve_ratios(rows):
        print(line)
    if args.png:
        serve_png(rows, args.png)
        print(f"chart: {args.png}")
    return 0


def _bench_tiers(args, workload, total: int, scale: dict | None) -> int:
    from xlserve.bench.tier_bench import run_tier_compare, summarize_runs, tier_goals, tier_png, tier_table
    if workload is None:
        raise ValueError("--tiers replays the trace: give --trace-requests > 0")
    rows = run_tier_compare(workload, total, args.kv_cache_tokens, args.kv_host_gib, args.repeats)
    summary = summarize_runs(rows)
    write_results(args.out, {"trace_scale": scale, "kv_cache_tokens": args.kv_cache_tokens,
                             "kv_host_gib": args.kv_host_gib, "repeats": args.repeats, "summary": summary,
                             "results": rows})
    print(tier_table(summary))
    for line in tier_goals(summary):
        print(line)
    if args.png:
        tier_png(summary, args.png)
        print(f"chart: {args.png}")
    return 0


def cmd_bench_spec(args) -> int:
    from xlserve.bench.spec_bench import SpecBenchOptions, run_spec_bench, spec_plot, spec_table
    methods = tuple(args.methods.split(","))
    if methods[0] != "none":
        raise SystemExit("--methods must start with none: the figures are ratios to it")
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--png needs matplotlib: pip install -e '.[peers]'") from None
    results = run_spec_bench(SpecBenchOptions(model=args.model, methods=methods, repeats=args.repeats,
                                              max_tokens=args.max_tokens, dtype=args.dtype,
                                              int8_activations=args.int8_activations))
    write_results(args.out, results)
    if args.png:
        spec_plot(results, args.png)
    print(spec_table(results))
    return 0


def cmd_bench_parallel(args) -> int:
    from xlserve.bench.parallel_bench import ParallelBenchOptions, parallel_table, run_parallel_bench
    opts = ParallelBenchOptions(model=args.model, moe=args.moe, layouts=tuple(args.layouts.split(",")),
                                repeats=args.repeats, dtype=args.dtype, workdir=args.workdir)
    results = run_parallel_bench(opts)
    write_results(args.out, results)
    print(parallel_table(results))
    return 0
