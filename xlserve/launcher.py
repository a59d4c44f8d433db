"""``xlserve serve``: the whole stack on one machine. By default a router, one prefill and
one decode worker, each its own child process (the workers on 127.0.0.1); ``--colocated``
runs one worker in this process instead. This process only supervises: it restarts any of
the three that exits or stops answering (see ``xlserve.supervisor``), the router included,
so a killed router is back on its port within seconds; Ctrl-C or SIGTERM stops every process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

import httpx

from xlserve.cli_args import config_to_args
from xlserve.config import ROUTER, SERVE, WORKER, EngineConfig, KVStoreConfig
from xlserve.server_config import ServerConfig, SupervisorConfig
from xlserve.supervisor import (
    Supervisor,
    WorkerProcess,
    die_with_parent,
    raise_on_sigterm,
    stop_on_interrupt,
    stop_processes,
)

log = logging.getLogger("xlserve.serve")
STARTUP_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_process(role: str, engine: EngineConfig, server: ServerConfig, key: str,
                   cores: list[int] | None = None) -> WorkerProcess:
    """A worker on a free loopback port, started (and restarted) on that same port;
    ``cores``: pin it there (one thread each)."""
    port = free_port()
    args = [sys.executable, "-m", "xlserve.cli", "worker", "--role", role, "--host", "127.0.0.1",
            "--port", str(port)]
    for part in [getattr(engine, f.name) for f in dataclasses.fields(engine)] + [worker_server_config(server)]:
        args += config_to_args(part)
    env = {**os.environ, "XLSERVE_INTERNAL_API_KEY": key}  # never on a command line
    if cores:
        env["OMP_NUM_THREADS"] = str(len(cores))

    def spawn() -> subprocess.Popen:
        proc = subprocess.Popen(args, env=env, preexec_fn=die_with_parent)
        if cores:
            os.sched_setaffinity(proc.pid, cores)
        return proc
    worker = WorkerProcess(role, f"http://127.0.0.1:{port}", spawn)
    worker.start()
    return worker


def router_process(server: ServerConfig, workers: list[WorkerProcess], model: str, chat_template: str,
                   policy: str, key: str) -> WorkerProcess:
    """``xlserve router`` on the public address over ``workers``; the keys travel in its
    environment, never on its command line."""
    (prefill,), (decode,) = ([w.url for w in workers if w.role == role] for role in ("prefill", "decode"))
    args = [sys.executable, "-m", "xlserve.cli", "router", "--prefill", prefill, "--decode", decode,
            "--model", model, "--policy", policy, *(["--chat-template", chat_template] if chat_template else []),
            *config_to_args(router_server_config(server))]
    env = {**os.environ, "XLSERVE_INTERNAL_API_KEY": key, "XLSERVE_API_KEY": server.api_key}
    host = "127.0.0.1" if server.host in ("0.0.0.0", "") else "[::1]" if server.host == "::" else server.host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    router = WorkerProcess(ROUTER, f"http://{host}:{server.port}",
                           lambda: subprocess.Popen(args, env=env, preexec_fn=die_with_parent))
    router.start()
    return router


def router_server_config(server: ServerConfig) -> ServerConfig:
    """The flags of ``serve`` that configure its router; the keys are left out (they go by
    the environment)."""
    keys = {"api_key", "api_key_file", "internal_api_key", "internal_api_key_file"}
    shared = {f.name for f in dataclasses.fields(ServerConfig)
              if ROUTER in f.metadata.get("commands", (ROUTER,)) and SERVE in f.metadata.get("commands", (SERVE,))}
    return ServerConfig(**{name: getattr(server, name) for name in shared - keys})


def worker_engine(engine: EngineConfig, role: str) -> EngineConfig:
    """A worker's engine flags: each keeps its disk tier in its own directory (one index per
    directory; the cluster tier is the one workers share)."""
    tiers = engine.tiers
    if "disk" not in tiers.tier_names:
        return engine
    return dataclasses.replace(engine, tiers=dataclasses.replace(tiers, kv_disk_dir=os.path.join(tiers.disk_dir, role)))


def worker_server_config(server: ServerConfig) -> ServerConfig:
    """The flags of ``serve`` that configure its workers (logging, KV hand-off, hang
    timeout); the rest (address, keys, prices) belong to the router."""
    shared = {f.name for f in dataclasses.fields(ServerConfig)
              if {WORKER, SERVE} <= set(f.metadata.get("commands", ()))} | {"log_level", "log_requests"}
    return ServerConfig(**{name: getattr(server, name) for name in shared})


def start_worker(role: str, engine: EngineConfig, key: str, log_level: str,
                 cores: list[int] | None = None) -> tuple[subprocess.Popen, str]:
    """A worker process on a free loopback port (benchmarks start their own)."""
    worker = worker_process(role, engine, ServerConfig(log_level=log_level), key, cores)
    return worker.proc, worker.url


def wait_healthy(procs: list[tuple[subprocess.Popen, str]]) -> None:
    """Until every process answers /health; raises if one exits or the time runs out."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    pending = dict((url, proc) for proc, url in procs)
    while pending:
        for url, proc in list(pending.items()):
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited with code {proc.returncode} while starting")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    del pending[url]
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"not up within {STARTUP_TIMEOUT_S} s: {list(pending)}")
        time.sleep(0.3)


def stop_all(procs: list[tuple[subprocess.Popen, str]]) -> None:
    stop_processes([proc for proc, _ in procs])


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports."""
    for _ in range(50):
        first = free_port()
        if first + n < 65536 and all(port_is_free(first + i) for i in range(1, n)):
            return first
    raise RuntimeError(f"found no {n} consecutive free ports on 127.0.0.1")


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def serve(engine: EngineConfig, server: ServerConfig, colocated: bool, policy: str = "cache_aware",
          supervision: SupervisorConfig | None = None) -> None:
    """The stack; with the 'mooncake' tier and no --kv-store-address, a Mooncake store of its own too."""
    tiers = engine.tiers
    if "mooncake" not in tiers.tier_names or tiers.kv_store_address:
        return _serve(engine, server, colocated, policy, supervision)
    from xlserve.kvstore.master import spawn_kvstore
    store = KVStoreConfig(port=free_ports(3), log_level=server.log_level)
    log.info("starting a Mooncake store for the cluster KV tier on %s", store.address)
    proc = spawn_kvstore(store)
    try:
        engine = dataclasses.replace(engine, tiers=dataclasses.replace(tiers, kv_store_address=store.address))
        _serve(engine, server, colocated, policy, supervision)
    finally:
        stop_processes([proc])


def _serve(engine: EngineConfig, server: ServerConfig, colocated: bool, policy: str,
           supervision: SupervisorConfig | None) -> None:
    if colocated:
        from xlserve.worker.server import run_worker
        run_worker(engine, server)
        return
    raise_on_sigterm()
    stop_on_interrupt()
    if server.port == 0:  # the router is restarted on the same port: fix it now
        server = dataclasses.replace(server, port=free_port())
    key = secrets.token_hex(16)  # workers listen on loopback and still want a key: only the router has it
    children: list[WorkerProcess] = []
    supervisor, gave_up = None, threading.Event()
    try:
        for role in ("prefill", "decode"):
            children.append(worker_process(role, worker_engine(engine, role), server, key))
        wait_healthy([(w.proc, w.url) for w in children])
        log.info("workers ready: prefill %s, decode %s", children[0].url, children[1].url)
        children.append(router_process(server, children, engine.model.model, engine.model.chat_template, policy, key))
        wait_healthy([(children[-1].proc, children[-1].url)])
        log.info("serving on http://%s:%d (router pid %d)", server.host, server.port, children[-1].proc.pid)
        why: list[str] = []

        def give_up(reason: str) -> None:  # on the supervisor's thread
            why.append(reason)
            gave_up.set()
        supervisor = Supervisor(children, supervision or SupervisorConfig(), give_up)
        supervisor.start()
        while not gave_up.wait(0.5):  # until the supervisor gives up, or Ctrl-C, SIGTERM, SIGHUP
            pass
        raise SystemExit(f"xlserve serve: {why[0]}")
    finally:
        if supervisor is not None:
            supervisor.stop()
        stop_processes([w.proc for w in reversed(children) if w.proc is not None])  # the router first
