"""Keeps the processes of ``xlserve serve`` alive (its router and workers): one that exits,
or stops answering ``/health`` for a while (hung engine, stopped process), is killed and
started again on the same port, so the router's health check finds a worker back without
being told, and clients find the router back where it was. Restarts
back off and have a budget; a worker that keeps failing stops the whole stack with a
non-zero exit instead of flapping forever.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import httpx

from xlserve.server_config import SupervisorConfig

log = logging.getLogger("xlserve.serve")
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """In the child, before exec: the kernel sends ``sig`` when the parent dies, so
    workers never outlive a killed ``xlserve serve`` (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass


def exit_cause(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


@dataclass
class WorkerProcess:
    """One supervised process (a worker, or the router): how to start it, and the process
    running now."""
    role: str  # prefill, decode, both or router
    url: str
    spawn: Callable[[], subprocess.Popen]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    ready: bool = False  # answered /health since its last start
    unhealthy_since: float | None = None
    restarts: deque = field(default_factory=deque)  # monotonic times of recent restarts

    def start(self) -> None:
        self.proc, self.started, self.ready, self.unhealthy_since = self.spawn(), time.monotonic(), False, None

    @property
    def name(self) -> str:
        return "router" if self.role == "router" else f"{self.role} worker"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Supervisor:
    def __init__(self, workers: list[WorkerProcess], config: SupervisorConfig, on_give_up: Callable[[str], None]):
        self.workers, self.config, self.on_give_up = workers, config, on_give_up
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xlserve-supervisor", daemon=True)
        # one client for every check: a new one per call (httpx.get) loads a TLS context each
        # time, and the supervisor's RSS grew 7 MiB in a minute of checks
        self._http = httpx.Client(timeout=2)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._http.close()

    def _run(self) -> None:
        while not self._stop.wait(self.config.check_interval):
            for worker in self.workers:
                cause = self._problem(worker)
                if cause is not None and not self._restart(worker, cause):
                    return

    def _problem(self, worker: WorkerProcess) -> str | None:
        """Why ``worker`` needs a restart, or None."""
        code = worker.proc.poll()
        if code is not None:
            return exit_cause(code)
        healthy, why = self._health(worker)
        now = time.monotonic()
        if healthy:
            worker.ready, worker.unhealthy_since = True, None
            return None
        if not worker.ready:  # still loading its model
            over = now - worker.started > self.config.startup_timeout
            return f"not up within {self.config.startup_timeout:g} s ({why})" if over else None
        worker.unhealthy_since = worker.unhealthy_since or now
        if now - worker.unhealthy_since > self.config.unhealthy_restart:
            return f"unhealthy for {self.config.unhealthy_restart:g} s ({why})"
        return None

    def _health(self, worker: WorkerProcess) -> tuple[bool, str]:
        try:
            r = self._http.get(f"{worker.url}/health")
        except httpx.HTTPError as e:
            return False, f"/health: {type(e).__name__}"
        if r.status_code == 200:
            return True, ""
        try:
            return False, f"/health {r.status_code}: {r.json()['error']['message']}"
        except (ValueError, KeyError, TypeError):
            return False, f"/health {r.status_code}"

    def _restart(self, worker: WorkerProcess, cause: str) -> bool:
        now = time.monotonic()
        while worker.restarts and now - worker.restarts[0] > self.config.restart_window:
            worker.restarts.popleft()
        if len(worker.restarts) >= self.config.max_restarts:
            why = (f"{worker.name} {worker.url}: {cause}; it was restarted {len(worker.restarts)} times "
                   f"in {self.config.restart_window:g} s, the budget; giving up")
            log.error(why)
            self.on_give_up(why)
            return False
        delay = min(self.config.max_backoff, 2.0 ** len(worker.restarts) - 1)
        log.warning("%s %s (pid %s) %s; restarting it in %.0f s", worker.name, worker.url,
                    worker.proc.pid, cause, delay)
        worker.kill()
        worker.restarts.append(now)
        if self._stop.wait(delay):
            return False
        worker.start()
        log.info("%s %s restarted as pid %d", worker.name, worker.url, worker.proc.pid)
        return True


def stop_processes(procs: list[subprocess.Popen], grace: float = 15.0) -> None:
    """SIGINT (a worker's graceful stop), then SIGKILL whatever is left after ``grace``."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def raise_on_sigterm() -> None:
    """SIGTERM (docker stop, systemd, kill) ends ``xlserve serve`` through its cleanup, as
    Ctrl-C does, instead of killing it on the spot and orphaning the workers."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def stop_on_interrupt() -> None:
    """SIGINT raises KeyboardInterrupt here even when this process started with it ignored (a
    background job of a script: ``nohup xlserve serve &``). Its children are uvicorn servers,
    which stop on SIGINT whatever they inherit: with the signal ignored here, Ctrl-C sent to the
    group stopped every child and the supervisor restarted them, leaving the stack running."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def stop_on_hangup() -> None:
    """SIGHUP (the terminal closed, ``kill -HUP``) stops a server as SIGTERM does: through
    whichever SIGTERM handler is installed when it arrives (uvicorn's graceful exit, or
    ``raise_on_sigterm``'s cleanup), never the default instant death."""
    signal.signal(signal.SIGHUP, lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM))
