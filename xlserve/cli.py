"""Command line: ``xlserve serve | worker | generate``.

Engine and server flags come from the config dataclasses (``xlserve.config``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from xlserve.allocator import limit_malloc_arenas
from xlserve.cli_args import add_config_args, config_from_args
from xlserve.config import (
    ROUTER,
    SERVE,
    WORKER,
    CacheConfig,
    EngineConfig,
    KVStoreConfig,
    KVTierConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from xlserve.server_config import ServerConfig, SupervisorConfig, read_key, resolve_keys

ENGINE_GROUPS = ((ModelConfig, "model"), (CacheConfig, "KV cache"), (SchedulerConfig, "scheduler"),
                 (ParallelConfig, "model parallelism"), (SpeculativeConfig, "speculative decoding"),
                 (KVTierConfig, "KV tiers"))


def _server_config(args) -> ServerConfig:
    return resolve_keys(config_from_args(args, ServerConfig))


def _engine_config(args) -> EngineConfig:
    return EngineConfig(*(config_from_args(args, cls) for cls, _ in ENGINE_GROUPS))


def _add_engine_args(parser: argparse.ArgumentParser, command: str) -> None:
    for cls, title in ENGINE_GROUPS:
        add_config_args(parser, cls, title, command=command)


def _setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    # httpx logs every internal call (health checks, KV events) at INFO: ~7,000 lines an idle hour
    logging.getLogger("httpx").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)


def _preflight(args, model: str) -> None:
    """What can be known wrong before anything loads, reported once (see ``xlserve.preflight``);
    then SIGHUP is made to stop the server as SIGTERM does."""
    from xlserve.loader.chat_template import read_chat_template
    from xlserve.preflight import check_model, check_port
    from xlserve.supervisor import stop_on_hangup
    check_port(args.host, args.port)
    check_model(model)
    if args.chat_template:
        read_chat_template(args.chat_template)
    stop_on_hangup()


def cmd_serve(args) -> int:
    from xlserve.launcher import serve
    _preflight(args, args.model)
    _setup_logging(args.log_level)
    serve(_engine_config(args), _server_config(args), colocated=args.colocated,
          supervision=config_from_args(args, SupervisorConfig))
    return 0


def cmd_worker(args) -> int:
    from xlserve.worker.server import run_worker
    _preflight(args, args.model)
    _setup_logging(args.log_level)
    engine = _engine_config(args)
    if engine.parallel.node_rank > 0:  # another machine's share of the ranks; node 0 serves
        from xlserve.parallel.ranks import host_node
        return host_node(engine)
    run_worker(engine, _server_config(args))
    return 0


def cmd_router(args) -> int:
    from xlserve.router.app import RouterOptions, run_router
    _preflight(args, args.model)
    _setup_logging(args.log_level)
    server = _server_config(args)
    opts = RouterOptions(prefill=tuple(args.prefill), decode=tuple(args.decode), both=tuple(args.both),
                         policy=args.policy, affinity=not args.no_affinity, model=args.model,
                         chat_template=args.chat_template,
                         worker_api_key=server.internal_api_key,
                         backend_api_key=_backend_key(args.backend_api_key_file),
                         tokenize_with=args.tokenize_with)
    run_router(opts, server)
    return 0


def _backend_key(path: str, environ=os.environ) -> str:
    """The foreign servers' key, from a file or XLSERVE_BACKEND_API_KEY: never a flag's value."""
    return read_key(path, "backend key") if path else environ.get("XLSERVE_BACKEND_API_KEY", "")


def cmd_kvstore(args) -> int:
    from xlserve.kvstore.master import run_kvstore
    config = config_from_args(args, KVStoreConfig)
    _setup_logging(config.log_level)
    run_kvstore(config)
    return 0


def cmd_generate(args) -> int:
    from xlserve import LLM, SamplingParams
    _setup_logging("warning")
    cfg = _engine_config(args)
    llm = LLM(**{k: v for part in (cfg.model, cfg.cache, cfg.scheduler) for k, v in vars(part).items()})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    completion = out.outputs[0]
    if args.json:
        print(json.dumps({"token_ids": completion.token_ids, "text": completion.text,
                          "finish_reason": completion.finish_reason, "prompt_tokens": out.num_prompt_tokens,
                          "cached_tokens": out.cached_tokens}, ensure_ascii=False))
    else:
        print(completion.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xlserve", description="Serve large language models, "
                                     "built for agentic traffic. Run 'xlserve COMMAND --help' for the flags.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, func in (
            (SERVE, "the main job: a router plus a prefill and a decode worker, each its own process, "
                    "serving the OpenAI API (--colocated: one worker)", cmd_serve),
            (WORKER, "run one worker: an HTTP server around one engine", cmd_worker)):
        p = sub.add_parser(name, help=help_text, description=help_text)
        _add_engine_args(p, name)
        add_config_args(p, ServerConfig, "server", command=name)
        if name == "serve":
            add_config_args(p, SupervisorConfig, "supervision of the router and workers")
            p.add_argument("--colocated", action="store_true",
                           help="one worker doing prefill and decode instead of router + prefill + decode")
        p.set_defaults(func=func)
    r = sub.add_parser("router", help="the front door: OpenAI API over prefill/decode workers",
                       description="Route OpenAI-compatible requests over workers: prefill on one, KV hand-off, "
                                   "decode on another; cache-aware, token-aware, x-session-affinity.")
    kinds = ("URL: an xlserve worker, or a foreign server named by a prefix: openai+http://H:P (any "
             "OpenAI-compatible server, --both), vllm-pd+http://H:P and sglang-pd+http://H:P[?bootstrap_port=N] "
             "(their disaggregated prefill and decode servers)")
    r.add_argument("--prefill", nargs="*", default=[], metavar="URL", help=f"prefill workers. {kinds}")
    r.add_argument("--decode", nargs="*", default=[], metavar="URL", help="decode workers")
    r.add_argument("--both", nargs="*", default=[], metavar="URL", help="colocated workers (prefill and decode)")
    r.add_argument("--backend-api-key-file", default="", metavar="FILE",
                   help="file whose first line is the key foreign servers want (else XLSERVE_BACKEND_API_KEY); "
                        "they never see the internal key")
    r.add_argument("--policy", default="cache_aware", choices=("round_robin", "least_tokens", "cache_aware"),
                   help="how workers are picked")
    r.add_argument("--no-affinity", action="store_true", help="ignore the x-session-affinity header")
    r.add_argument("--model", default="default", help="the workers' model, for the tokenizer and chat template")
    r.add_argument("--chat-template", default="", metavar="FILE",
                   help="Jinja file to use as the chat template instead of the model's own")
    r.add_argument("--tokenize-with", default="", metavar="URL",
                   help="a foreign server whose chat template differs from the model's: it renders each chat "
                        "(llama-server's /apply-template, vLLM's /tokenize) and the router counts the tokens")
    add_config_args(r, ServerConfig, "server", command=ROUTER)
    r.set_defaults(func=cmd_router)
    g = sub.add_parser("generate", help="generate text for one prompt and print it",
                       description="Generate text for one prompt with the offline engine.")
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--seed", type=int, default=None, help="sampling seed for reproducible output")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    _add_engine_args(g, "generate")
    g.set_defaults(func=cmd_generate)
    _config_command(sub, "kvstore", "run a Mooncake Store for the 'mooncake' KV tier: its master and HTTP "
                    "metadata server (no etcd) supervised and restarted if it exits, and the store's memory; until "
                    "Ctrl-C", "Workers reach it with --kv-tiers ...,mooncake --kv-store-address HOST:PORT.",
                    KVStoreConfig, "store", cmd_kvstore)
    _add_plan_parser(sub)
    _add_train_eagle_parser(sub)
    from xlserve.bench.cli import add_bench_parser
    add_bench_parser(sub)
    return parser


def _config_command(sub, name: str, text: str, more: str, config, group: str, func) -> None:
    """A subcommand whose flags are ``config``'s fields: ``text`` is its help, and with ``more``
    its description."""
    p = sub.add_parser(name, help=text, description=f"{text[0].upper()}{text[1:]}. {more}")
    add_config_args(p, config, group)
    p.set_defaults(func=func)


def _add_plan_parser(sub) -> None:
    from xlserve.planner.report import PRESETS, PlanConfig
    _config_command(sub, "plan", "print where a model's memory goes on a set of GPUs: weights per GPU by format and "
                    "component, activation peak, CUDA-graph pool, KV bytes per token by layer group, KV memory and "
                    "token capacity, and whether it fits", f"Presets: {', '.join(PRESETS)}. Example: xlserve plan "
                    "--model llama-4-scout --gpus 2xH200", PlanConfig, "plan", cmd_plan)


def cmd_plan(args) -> int:
    from xlserve.planner.report import PlanConfig, make_plan, to_json, to_table
    plan = make_plan(config_from_args(args, PlanConfig))
    print(json.dumps(to_json(plan), indent=2) if args.json else to_table(plan))
    return 0


def _add_train_eagle_parser(sub) -> None:
    from xlserve.config import EagleTrainingConfig
    _config_command(sub, "train-eagle", "train an EAGLE head for --speculative eagle: the model answers agent "
                    "and free-text asks greedily, and a one-layer head learns to guess its next tokens from its "
                    "hidden states", "About 11 minutes for the default model on 2 CPU cores; serve with "
                    "--speculative eagle --eagle-head OUT.", EagleTrainingConfig, "training", cmd_train_eagle)


def cmd_train_eagle(args) -> int:
    from xlserve.config import EagleTrainingConfig
    from xlserve.speculative.eagle_training import train_eagle
    _setup_logging("info")
    print(json.dumps(train_eagle(config_from_args(args, EagleTrainingConfig)), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    limit_malloc_arenas()  # before any thread starts (xlserve/allocator.py says why)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"xlserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
