"""``xlserve serve``: the whole stack on one machine. By default a router plus one prefill
and one decode worker, each its own process on 127.0.0.1; ``--colocated`` runs one
worker instead. A supervisor restarts a worker that exits or stops answering (see
``xlserve.supervisor``); Ctrl-C or SIGTERM stops every process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import httpx

from xlserve.cli_args import config_to_args
from xlserve.config import SERVE, WORKER, EngineConfig, ServerConfig, SupervisorConfig
from xlserve.supervisor import Supervisor, WorkerProcess, die_with_parent, raise_on_sigterm, stop_processes

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
    for part in (engine.model, engine.cache, engine.scheduler, engine.parallel, worker_server_config(server)):
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


def serve(engine: EngineConfig, server: ServerConfig, colocated: bool, policy: str = "cache_aware",
          supervision: SupervisorConfig | None = None) -> None:
    if colocated:
        from xlserve.worker.server import run_worker
        run_worker(engine, server)
        return
    from xlserve.router.app import RouterOptions, run_router
    raise_on_sigterm()
    key = secrets.token_hex(16)  # workers listen on loopback and still want a key: only the router has it
    workers: list[WorkerProcess] = []
    supervisor = None
    try:
        workers.append(worker_process("prefill", engine, server, key))
        workers.append(worker_process("decode", engine, server, key))
        wait_healthy([(w.proc, w.url) for w in workers])
        log.info("workers ready: prefill %s, decode %s", workers[0].url, workers[1].url)
        gave_up: list[str] = []

        def give_up(why: str) -> None:  # on the supervisor's thread: stop the router, then exit non-zero
            gave_up.append(why)
            os.kill(os.getpid(), signal.SIGINT)
        supervisor = Supervisor(workers, supervision or SupervisorConfig(), give_up)
        supervisor.start()
        opts = RouterOptions(prefill=(workers[0].url,), decode=(workers[1].url,), policy=policy,
                             model=engine.model.model, chat_template=engine.model.chat_template, worker_api_key=key)
        try:
            run_router(opts, server)
        except (KeyboardInterrupt, SystemExit):
            if not gave_up:
                raise
        if gave_up:
            raise SystemExit(f"xlserve serve: {gave_up[0]}")
    finally:
        if supervisor is not None:
            supervisor.stop()
        stop_processes([w.proc for w in workers if w.proc is not None])
