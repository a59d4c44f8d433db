"""``xlserve serve``: the whole stack on one machine. By default a router plus one prefill
and one decode worker, each its own process on 127.0.0.1; ``--colocated`` runs one
worker instead. Ctrl-C stops every process; a worker that dies takes the stack down
rather than leaving half of it running.
"""

from __future__ import annotations

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
from xlserve.config import EngineConfig, ServerConfig

log = logging.getLogger("xlserve.serve")
STARTUP_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(role: str, engine: EngineConfig, key: str, log_level: str,
                 cores: list[int] | None = None) -> tuple[subprocess.Popen, str]:
    """A worker process on a free loopback port; ``cores``: pin it there (one thread each)."""
    port = free_port()
    args = [sys.executable, "-m", "xlserve.cli", "worker", "--role", role, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", log_level]
    for part in (engine.model, engine.cache, engine.scheduler):
        args += config_to_args(part)
    env = {**os.environ, "XLSERVE_WORKER_API_KEY": key}
    if cores:
        env["OMP_NUM_THREADS"] = str(len(cores))
    proc = subprocess.Popen(args, env=env)
    if cores:
        os.sched_setaffinity(proc.pid, cores)
    return proc, f"http://127.0.0.1:{port}"


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
    for proc, _ in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 15
    for proc, _ in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve(engine: EngineConfig, server: ServerConfig, colocated: bool, policy: str = "cache_aware") -> None:
    if colocated:
        from xlserve.worker.server import run_worker
        run_worker(engine, server)
        return
    from xlserve.router.app import RouterOptions, run_router
    key = secrets.token_hex(16)  # workers listen on loopback and still want a key: only the router has it
    procs: list[tuple[subprocess.Popen, str]] = []
    try:
        procs.append(start_worker("prefill", engine, key, server.log_level))
        procs.append(start_worker("decode", engine, key, server.log_level))
        wait_healthy(procs)
        log.info("workers ready: prefill %s, decode %s", procs[0][1], procs[1][1])
        opts = RouterOptions(prefill=(procs[0][1],), decode=(procs[1][1],), policy=policy,
                             model=engine.model.model, worker_api_key=key)
        run_router(opts, server)
    finally:
        stop_all(procs)
