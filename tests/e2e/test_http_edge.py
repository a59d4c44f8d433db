"""The HTTP edge of real servers: JSON bodies only, loopback Host names only, a key on
every door, and no key on any command line."""

import re
import socket
import time

import httpx
import psutil
import pytest

from tests.e2e.server_process import PROCESSES, running_server

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
KEY = "edge-test-key-5a1c"
HEAD_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def edge():
    quiet = ("--log-level", "warning", "--request-head-timeout", str(HEAD_TIMEOUT_S))
    with running_server(*quiet) as worker, running_server("--both", worker, *quiet, "--metrics-need-key",
                                                          command="router", env={"XLSERVE_API_KEY": KEY}) as router:
        yield {"worker": worker, "router": router}


@pytest.mark.parametrize("target", ["worker", "router"])
def test_a_cross_site_text_plain_post_gets_415(edge, target):
    headers = {"content-type": "text/plain", "authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{edge[target]}/v1/chat/completions", content=b'{"messages": []}', headers=headers)
    assert r.status_code == 415 and r.json()["error"]["type"] == "unsupported_media_type"


@pytest.mark.parametrize("target", ["worker", "router"])
def test_a_foreign_host_name_gets_421_on_a_loopback_bind(edge, target):
    headers = {"host": "evil.example", "authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{edge[target]}/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status_code == 421 and "evil.example" in r.json()["error"]["message"]
    port = edge[target].rsplit(":", 1)[1]
    ok = httpx.post(f"{edge[target]}/v1/chat/completions", json=CHAT,
                    headers={"host": f"localhost:{port}", "authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200


def _closed_after(sock: socket.socket, trickle: bytes = b"") -> float:
    """Seconds until the server closes ``sock``, sending it ``trickle`` one byte every 0.2 s."""
    start = time.monotonic()
    sock.settimeout(0.2)
    for i in range(100):
        try:
            if sock.recv(1) == b"":
                return time.monotonic() - start
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - start
        if trickle:
            try:
                sock.sendall(trickle[i % len(trickle):][:1])
            except OSError:
                return time.monotonic() - start
    raise AssertionError("still open after 20 s")


@pytest.mark.parametrize("target", ["worker", "router"])
def test_a_connection_without_a_whole_request_head_is_closed(edge, target):
    address = ("127.0.0.1", int(edge[target].rsplit(":", 1)[1]))
    with socket.create_connection(address) as silent:
        assert HEAD_TIMEOUT_S - 0.5 < _closed_after(silent) < HEAD_TIMEOUT_S + 2  # sends nothing
    with socket.create_connection(address) as slow:
        head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200
        assert HEAD_TIMEOUT_S - 0.5 < _closed_after(slow, trickle=head) < HEAD_TIMEOUT_S + 2  # a byte at a time
    assert httpx.get(f"{edge[target]}/health").status_code == 200


def test_the_router_wants_its_key_from_the_environment(edge):
    router = edge["router"]
    assert httpx.post(f"{router}/v1/chat/completions", json=CHAT).status_code == 401
    assert httpx.get(f"{router}/metrics").status_code == 401  # --metrics-need-key
    assert httpx.get(f"{router}/router/workers").status_code == 401
    assert httpx.get(f"{router}/openapi.json").status_code == 401  # the document of the routes it guards
    auth = {"authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{router}/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
    assert httpx.get(f"{router}/metrics", headers=auth).status_code == 200
    assert "/v1/chat/completions" in httpx.get(f"{router}/openapi.json", headers=auth).json()["paths"]
    assert httpx.get(f"{router}/health").status_code == 200  # liveness stays open


def test_serve_puts_no_key_on_any_command_line():
    with running_server("--log-level", "warning", command="serve", env={"XLSERVE_API_KEY": KEY}) as url:
        serve = psutil.Process(PROCESSES[url].pid)
        procs = [serve, *serve.children(recursive=True)]
        assert len(procs) >= 3
        for proc in procs:
            cmdline = " ".join(proc.cmdline())
            assert KEY not in cmdline and not re.search(r"\b[0-9a-f]{32}\b", cmdline), cmdline
        workers = httpx.get(f"{url}/router/workers", headers={"authorization": f"Bearer {KEY}"}).json()
        for w in workers:  # the workers want the internal key, which only the router holds
            assert httpx.get(f"{w['url']}/internal/info").status_code == 401
            assert httpx.get(f"{w['url']}/internal/info", headers={"authorization": f"Bearer {KEY}"}).status_code == 401
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT,
                          headers={"authorization": f"Bearer {KEY}"}).status_code == 200
