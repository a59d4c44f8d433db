"""The servers' configuration: HTTP front, router and worker knobs (``ServerConfig``), how
``xlserve serve`` keeps its processes alive (``SupervisorConfig``), and the keys, read from
files or the environment, never from a command line. Fields as in ``xlserve.config``."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from xlserve.config import ROUTER, SERVE, WORKER, option


def parse_peers(text: str) -> set[tuple[str, int]]:
    """``host:port,host:port`` (``--kv-peers``) as a set of addresses."""
    peers = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"a KV peer must be host:port, got {item!r}")
        peers.add((host.strip("[]"), int(port)))
    return peers


@dataclass(frozen=True)
class SupervisorConfig:
    """How ``xlserve serve`` keeps its router and workers alive."""
    max_restarts: int = option(5, "Restarts allowed per process (router or worker) within --restart-window; one "
                               "more stops the whole stack with a non-zero exit.")
    restart_window: float = option(600.0, "Seconds over which --max-restarts is counted.")
    unhealthy_restart: float = option(10.0, "Seconds a started router or worker may fail its /health check (hung "
                                      "engine, stopped process) before it is killed and restarted.")
    startup_timeout: float = option(600.0, "Seconds a router or worker may take to load its model and answer "
                                    "/health.")
    max_backoff: float = option(30.0, "Longest wait before a restart (waits double from 0 s per recent restart).")
    check_interval: float = option(1.0, "Seconds between checks of every worker.")

    def __post_init__(self):
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        for name in ("restart_window", "unhealthy_restart", "startup_timeout", "check_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_backoff < 0:
            raise ValueError(f"max_backoff must be >= 0, got {self.max_backoff}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = option("127.0.0.1", "Address to bind. Loopback by default; use 0.0.0.0 only behind a firewall.")
    port: int = option(8000, "TCP port to listen on.")
    api_key: str = option("", "If set, every /v1 request must send 'Authorization: Bearer <key>'. A flag "
                          "shows the key to anyone who lists processes: prefer XLSERVE_API_KEY in the "
                          "environment or --api-key-file.", secret=True)
    api_key_file: str = option("", "File whose first line is the API key (see --api-key).")
    internal_api_key: str = option("", "Key of the internal endpoints between router and workers; empty: the "
                                   "API key guards them too. Read from XLSERVE_INTERNAL_API_KEY or "
                                   "--internal-api-key-file, never from a flag.", secret=True, cli=False)
    internal_api_key_file: str = option("", "File whose first line is the internal key (router and workers).")
    allowed_hosts: str = option("", "Comma-separated Host names answered besides loopback ones when bound to "
                                "a loopback address ('*': any). Guards against DNS rebinding.")
    metrics_need_key: bool = option(False, "Put /metrics and /router/workers behind the API key too.")
    max_body_bytes: int = option(8 * 1024 * 1024, "Largest request body accepted; larger ones get 413.")
    heap_trim_interval: float = option(60.0, "Seconds between handing the free pages glibc's malloc keeps back to "
                                       "the system (malloc_trim; 0: never). Without it a long-running server's "
                                       "RSS creeps up with freed memory it no longer uses (xlserve/native_heap.py).")
    request_head_timeout: float = option(30.0, "Seconds a connection may take to send a whole request head, after "
                                         "it opened or after its last response, before it is closed: a client "
                                         "cannot hold sockets open by sending nothing.")
    tool_parser: str = option("auto", "Tool-call format to read from the model's output: auto (from the chat "
                              "template: Kimi K2, DeepSeek-V3/V3.1, Mistral, pythonic, Llama 3 JSON, else Hermes) "
                              "or one of kimi_k2, deepseek_v3, deepseek_v31, mistral, pythonic, llama3_json, hermes.")
    reasoning_parser: str = option("auto", "Where <think>...</think> goes: auto (reasoning_content when the chat "
                                   "template mentions <think>), think (always), none (left in content).",
                                   choices=("auto", "think", "none"))
    responses_kept: int = option(1024, "Responses (/v1/responses) kept in memory for previous_response_id and "
                                 "GET /v1/responses/{id}, the oldest dropped first (also at most 256 MiB in all).")
    log_level: str = option("info", "Log level: debug, info, warning, error.",
                            choices=("debug", "info", "warning", "error"))
    log_requests: bool = option(True, "Log one line per finished request (id, session, workers, status, "
                                "prompt/cached/generated tokens, TTFT, duration).")
    role: str = option("both", "Worker role in prefill/decode disaggregation: both, prefill or decode.",
                       choices=("both", "prefill", "decode"), commands=(WORKER,))
    kv_transport: str = option("tcp", "How KV blocks travel between workers: 'tcp' (built in: the bytes follow the "
                               "checked header on one connection) or 'mooncake' (the same checked exchange, the bytes "
                               "read through Mooncake's Transfer Engine: TCP here, RDMA where it has it; needs the "
                               "mooncake package, and a private network: its engine does not authenticate peers).",
                               choices=("tcp", "mooncake"), commands=(WORKER, SERVE))
    kv_host: str = option("127.0.0.1", "Address the KV transfer server binds (prefill role).", commands=(WORKER,))
    kv_port: int = option(0, "Port of the KV transfer server; 0 picks a free one.", commands=(WORKER,))
    kv_peers: str = option("", "Comma-separated host:port of KV servers this worker may always pull from, "
                           "besides those its router registers (POST /internal/kv/peers).", commands=(WORKER,))
    kv_pin_seconds: float = option(30.0, "How long exported KV blocks stay pinned for a decode worker to pull.",
                                   commands=(WORKER, SERVE))
    kv_pull_timeout: float = option(10.0, "Seconds a decode worker waits for a KV pull.", commands=(WORKER, SERVE))
    kv_pull_failure: str = option("recompute", "When a KV pull fails: recompute the prefill here, or fail.",
                                  choices=("recompute", "fail"), commands=(WORKER, SERVE))
    hang_timeout: float = option(60.0, "Seconds one engine step may run before /health reports the worker "
                                 "hung (503), so the router stops sending it work and `xlserve serve` "
                                 "restarts it.", commands=(WORKER, SERVE))
    worker_timeout: float = option(60.0, "Router: seconds a worker may send nothing (no answer, no streamed "
                                   "token) before the request fails over and the worker is marked down.",
                                   commands=(ROUTER, SERVE))
    router_queue: int = option(0, "Router: requests held, first come first served, before their prefill while "
                               "every slot of the workers is taken (each its --max-num-seqs plus --max-waiting); "
                               "beyond it, 429 with Retry-After. 0: as many as the workers hold.",
                               commands=(ROUTER, SERVE))
    router_queue_timeout: float = option(0.0, "Router: seconds a request may wait in that queue before it is "
                                         "refused as busy (429 with Retry-After); 0: it waits as long as it takes.",
                                         commands=(ROUTER, SERVE))
    price_input: float = option(0.60, "Price per million uncached input tokens, reported in usage.cost.")
    price_cached_input: float = option(0.10, "Price per million cached input tokens (the cache discount).")
    price_output: float = option(3.00, "Price per million output tokens.")

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not 0 <= self.responses_kept <= 1_000_000:
            raise ValueError(f"responses_kept must be in 0..1000000, got {self.responses_kept}")
        if not 0 < self.request_head_timeout <= 3600:
            raise ValueError(f"request_head_timeout must be in (0, 3600], got {self.request_head_timeout}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not 0 < self.kv_pin_seconds <= 600:
            raise ValueError(f"kv_pin_seconds must be in (0, 600], got {self.kv_pin_seconds}")
        parse_peers(self.kv_peers)
        if not 0 < self.worker_timeout <= 3600:
            raise ValueError(f"worker_timeout must be in (0, 3600], got {self.worker_timeout}")
        if not 0 < self.hang_timeout <= 3600:
            raise ValueError(f"hang_timeout must be in (0, 3600], got {self.hang_timeout}")
        if not 0 <= self.router_queue <= 1_000_000:
            raise ValueError(f"router_queue must be in 0..1000000, got {self.router_queue}")
        if not 0 <= self.router_queue_timeout <= 86400:
            raise ValueError(f"router_queue_timeout must be in [0, 86400] seconds, got {self.router_queue_timeout}")
        if not 0 < self.kv_pull_timeout <= 600:
            raise ValueError(f"kv_pull_timeout must be in (0, 600], got {self.kv_pull_timeout}")


def read_key(path: str, what: str) -> str:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the {what} from {path}: {e.strerror}") from e
    if not lines or not lines[0].strip():
        raise ValueError(f"{path} holds no {what} on its first line")
    return lines[0].strip()


def resolve_keys(server: ServerConfig, environ=os.environ) -> ServerConfig:
    """Fill the keys from their files or the environment, so none has to be on a command
    line: the API key from --api-key, --api-key-file or XLSERVE_API_KEY; the internal key
    from --internal-api-key-file or XLSERVE_INTERNAL_API_KEY."""
    api = server.api_key or (read_key(server.api_key_file, "API key") if server.api_key_file else "") \
        or environ.get("XLSERVE_API_KEY", "")
    internal = server.internal_api_key or (read_key(server.internal_api_key_file, "internal key")
                                           if server.internal_api_key_file else "") \
        or environ.get("XLSERVE_INTERNAL_API_KEY", "")
    return replace(server, api_key=api, internal_api_key=internal)
