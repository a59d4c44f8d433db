"""Start ``xlserve`` as a real subprocess on 127.0.0.1 and wait until it answers."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

PROCESSES: dict[str, subprocess.Popen] = {}  # url -> process, for tests that kill a server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(*args: str, timeout: float = 180.0, command: str = "worker", env: dict | None = None):
    """``env``: extra environment variables (keys, which never go on a command line). A server
    that exits before it answers is started again on a fresh port, twice at most: the port
    ``free_port`` found can be taken (as some connection's local port) before the server binds."""
    for attempt in range(3):
        port = free_port()
        cmd = [sys.executable, "-m", "xlserve.cli", command, "--port", str(port), *args]
        log = open(os.devnull, "w") if os.environ.get("XLSERVE_TEST_QUIET") else None
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None,
                                env={**os.environ, **(env or {})})
        url = f"http://127.0.0.1:{port}"
        PROCESSES[url] = proc
        try:
            wait_up(url, proc, timeout, " ".join(cmd))
            break
        except RuntimeError:  # exited: a failure that is not the port's repeats on the next tries
            stop(proc)
            if attempt == 2:
                raise
    try:
        yield url
    finally:
        stop(proc)


def wait_up(url: str, proc: subprocess.Popen, timeout: float, what: str = "server") -> None:
    """Until ``url``/health answers 200; raises if ``proc`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not come up within {timeout:g} s")
        time.sleep(0.3)


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (a graceful stop), then SIGKILL after 20 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def workers_by_role(router: str) -> dict[str, str]:
    """The URL of each role's worker behind ``router`` (``xlserve serve``'s prefill and decode)."""
    return {w["role"]: w["url"] for w in httpx.get(f"{router}/router/workers").json()}


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def metric_value(url: str, name: str, **labels) -> float:
    """The value of the series of ``name`` with exactly ``labels`` in ``url``'s /metrics (0 when absent)."""
    want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name}{want} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
