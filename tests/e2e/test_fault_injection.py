"""Faults injected while clients keep the stack busy: each of the three processes of
``xlserve serve`` killed and stopped, KV pulls that stall, drop or arrive truncated, and ten
times the load the workers admit. Clients see bounded errors and waits, never a hang, and
the stack serves again afterwards with nothing left held."""

import signal
import sys
import threading
import time

import httpx
import psutil
import pytest

from tests.e2e.load import CHAT, Load
from tests.e2e.server_process import PROCESSES, free_port, metric, running_server, stop


def _child_pid(serve_pid: int, role: str) -> int:
    """The pid of ``xlserve serve``'s router, prefill or decode child."""
    for child in psutil.Process(serve_pid).children():
        cmd = child.cmdline()
        if role == "router" and "router" in cmd:
            return child.pid
        if "--role" in cmd and cmd[cmd.index("--role") + 1] == role:
            return child.pid
    raise LookupError(role)


def _probe(url: str, path: str) -> int | str:
    try:
        return httpx.get(f"{url}{path}", timeout=2).status_code
    except httpx.HTTPError as e:
        return type(e).__name__


def _until_recovered(url: str, serve_pid: int, role: str, old_pid: int, health: list) -> float:
    """Seconds until a request succeeds through a new ``role`` process; the router's
    liveness and readiness are sampled on the way (as (health, ready) pairs)."""
    began = time.monotonic()
    while time.monotonic() - began < 90:
        health.append((_probe(url, "/health"), _probe(url, "/ready")))
        try:
            new_pid = _child_pid(serve_pid, role)
        except (LookupError, psutil.Error):
            new_pid = old_pid
        if new_pid != old_pid:
            try:
                if httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200:
                    return time.monotonic() - began
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    raise AssertionError(f"no new {role} process served within 90 s")


FAULTS = [("decode", signal.SIGKILL), ("prefill", signal.SIGKILL), ("router", signal.SIGKILL),
          ("decode", signal.SIGSTOP), ("prefill", signal.SIGSTOP), ("router", signal.SIGSTOP)]
# What a client may see while a process is down: a worker's gap is a 503 (no worker) or a
# 502 (the worker failed mid-request), or a 200 stream that ends in an error event; the
# router's gap is a refused or cut connection.
CLIENT_SAW = {"ok", "200", "502", "503", "ConnectError", "RemoteProtocolError", "ReadError", "ReadTimeout"}


def test_serve_brings_back_each_of_its_processes_killed_or_stopped_under_load():
    with running_server("--log-level", "warning", "--worker-timeout", "8", "--unhealthy-restart", "4",
                        command="serve") as url:
        serve = PROCESSES[url]
        load = Load(url)
        time.sleep(2)
        recovered = {}
        try:
            for role, sig in FAULTS:
                pid, health = _child_pid(serve.pid, role), []
                psutil.Process(pid).send_signal(sig)
                recovered[f"{role} {sig.name}"] = _until_recovered(url, serve.pid, role, pid, health)
                if role != "router":  # the router alive all along, and not ready during the gap
                    assert (200, 503) in health, health
                    assert {live for live, _ in health} == {200}, health
                assert httpx.get(f"{url}/ready", timeout=5).status_code == 200
                assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
                time.sleep(3)  # the load runs on the recovered stack
        finally:
            outcomes = load.finish()
        assert serve.poll() is None
        children = [_child_pid(serve.pid, role) for role in ("router", "prefill", "decode")]
        serve.send_signal(signal.SIGINT)  # Ctrl-C
        serve.wait(20)
    print("recovered within (s):", {k: round(v, 1) for k, v in recovered.items()})
    time.sleep(1)
    assert not any(psutil.pid_exists(pid) for pid in children)  # no orphan
    assert all(seconds < 60 for seconds in recovered.values()), recovered
    assert all(o.end - o.start < Load.DEADLINE_S for o in outcomes)  # nobody waited past the deadline
    assert {o.result for o in outcomes} <= CLIENT_SAW, {o.result for o in outcomes}
    last = {o.client: o.result for o in outcomes}
    assert set(last.values()) == {"ok"}, last  # every client is served again at the end
