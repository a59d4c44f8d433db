"""No single request and no single dead process takes the service down: hostile inputs
against a real worker and a real router (default dtype, as users run them), a huge body
beside a live stream, disconnected streams, a worker whose engine cannot go on. Processes
killed under load: ``test_fault_injection.py``."""

import json
import socket
import threading
import time

import httpx
import openai
import psutil
import pytest

from tests.e2e.server_process import PROCESSES, metric, running_server

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6}
KILLERS = [{"temperature": 5e-324}, {"top_p": 1e-300}, {"temperature": 1e-30, "top_p": 1e-300, "seed": 3}]
BAD_TOOL = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "no-such-type"}}}]
MISTAKES = {
    "schema that does not compile": {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}},
    "tool schema with a required call": {**CHAT, "tools": BAD_TOOL, "tool_choice": "required"},
    "repetition penalty that underflows": {**CHAT, "repetition_penalty": 1e-300, "temperature": 1.0},
    "temperature that overflows": {**CHAT, "temperature": "HUGE"},  # sent as the literal 1e400
    "token ids outside the vocabulary": {"model": MODEL, "prompt": [1, 2, 10**6], "max_tokens": 4},
}


@pytest.fixture(scope="module")
def servers():
    with running_server("--log-level", "warning") as colocated, \
            running_server("--role", "prefill", "--log-level", "warning", "--kv-pin-seconds", "300") as p, \
            running_server("--role", "decode", "--log-level", "warning") as d, \
            running_server("--prefill", p, "--decode", d, "--log-level", "warning", command="router") as router:
        yield {"colocated": colocated, "router": router, "p": p, "d": d}


def _post(url, body, stream=False):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    raw = json.dumps({**body, "stream": stream}).replace('"HUGE"', "1e400")
    return httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=120)


@pytest.mark.parametrize("target", ["colocated", "router"])
def test_engine_killing_requests_leave_the_service_serving(servers, target):
    url = servers[target]
    pids = {name: PROCESSES[servers[name]].pid for name in ("colocated", "p", "d")}
    for body in KILLERS:
        for stream in (False, True):
            r = _post(url, {**CHAT, **body}, stream)
            assert r.status_code == 200, r.text
            assert '"error"' not in r.text
    ok = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0).chat.completions.create(**CHAT)
    assert ok.choices[0].finish_reason in ("stop", "length")
    for name, pid in pids.items():  # no worker restarted or died
        assert PROCESSES[servers[name]].pid == pid and PROCESSES[servers[name]].poll() is None
        assert httpx.get(f"{servers[name]}/health").status_code == 200


@pytest.mark.parametrize("target", ["colocated", "router"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_client_mistakes_are_400_with_an_openai_error_body(servers, target, stream, mistake):
    r = _post(servers[target], MISTAKES[mistake], stream)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if target == "router":  # the worker's own words reach the client
        assert error["message"] == _post(servers["colocated"], MISTAKES[mistake], stream).json()["error"]["message"]


def _stream_gaps(url, gaps, started):
    body = {**CHAT, "messages": [{"role": "user", "content": "Count from one to a hundred."}],
            "max_tokens": 160, "ignore_eos": True, "temperature": 0, "stream": True}
    last = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                now = time.monotonic()
                if last is not None:
                    gaps.append((now, now - last))
                last = now
                started.set()


def test_a_7mb_body_does_not_stall_another_clients_stream(servers):
    router = servers["router"]
    gaps, started = [], threading.Event()
    streamer = threading.Thread(target=_stream_gaps, args=(router, gaps, started))
    streamer.start()
    assert started.wait(60)
    huge = {**CHAT, "messages": [{"role": "user", "content": "All work and no play. " * 320_000}]}
    sent = time.monotonic()
    r = httpx.post(f"{router}/v1/chat/completions", content=json.dumps(huge), timeout=120,
                   headers={"content-type": "application/json"})
    answered = time.monotonic()
    streamer.join(120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    during = [gap for at, gap in gaps if sent <= at <= answered + 0.5]
    assert answered - sent > 1.0 and len(during) >= 3  # the stream ran while the body was tokenized
    print(f"max inter-token gap {max(gap for _, gap in gaps):.3f} s over {len(gaps)} gaps")
    assert max(gap for _, gap in gaps) < 0.5, max(gap for _, gap in gaps)


def test_64_disconnected_streams_leave_no_close_wait_socket_on_the_router(servers):
    router = servers["router"]
    port = int(router.rsplit(":", 1)[1])
    body = json.dumps({**CHAT, "max_tokens": 300, "ignore_eos": True, "stream": True}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
    for i, s in enumerate(socks):
        s.sendall(head + body)
        if i % 2:  # half leave mid-stream, half before the first token
            got = b""
            while got.count(b"data: {") < 2:
                got += s.recv(65536)
    for s in socks:
        s.close()
    router_proc = psutil.Process(PROCESSES[router].pid)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        waiting = [c for c in router_proc.net_connections("tcp") if c.status == psutil.CONN_CLOSE_WAIT]
        busy = httpx.get(f"{router}/router/workers").json()
        if not waiting and all(w["decode_tokens"] == 0 for w in busy):
            break
        time.sleep(0.5)
    assert waiting == []
    assert all(w["decode_tokens"] == 0 for w in busy)  # the decode streams were closed, not left running
    deadline = time.monotonic() + 60  # prefills already running finish first; pins would last 300 s
    while metric(servers["p"], "xlserve_kv_pins") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metric(servers["p"], "xlserve_kv_pins") == 0  # the prefill's pins were released, not left to expire


FATAL_WORKER = """
import sys
from xlserve.config import EngineConfig
from xlserve.server_config import ServerConfig
from xlserve.engine.errors import EngineFatal
from xlserve.engine.llm_engine import LLMEngine
from xlserve.worker.server import run_worker

def step(self):  # test hook: the device is lost at the first step
    raise EngineFatal("device lost")
LLMEngine.step = step
run_worker(EngineConfig.from_kwargs(model=sys.argv[1], kv_cache_tokens=1024),
           ServerConfig(port=int(sys.argv[2]), log_level="warning"))
"""


def test_a_worker_whose_engine_cannot_continue_answers_then_exits_non_zero(tiny_llama_dir):
    import subprocess
    import sys

    from tests.e2e.server_process import free_port
    from xlserve.launcher import wait_healthy
    from xlserve.worker.server import EXIT_ENGINE_DEAD
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", FATAL_WORKER, tiny_llama_dir, str(port)])
    try:
        wait_healthy([(proc, url)])
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
        assert proc.wait(timeout=30) == EXIT_ENGINE_DEAD  # never a live process answering 5xx forever
    finally:
        if proc.poll() is None:
            proc.kill()
