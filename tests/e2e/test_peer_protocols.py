"""The router in front of vLLM's and SGLang's disaggregated servers, each side played from a
recorded exchange (tests/peers/*.json, with where each came from) by a real HTTP server."""

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server_process import PROCESSES, free_port, running_server, stop, wait_up
from xlserve.router.connections import fetch

PEERS = Path(__file__).parent.parent / "peers"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@contextlib.contextmanager
def replaying(recording: str, role: str, fail: int = 0, port: int | None = None, *flags: str):
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, str(PEERS / "replay_server.py"), "--recording", str(PEERS / recording),
                             "--role", role, "--port", str(port), "--fail", str(fail), *flags])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc, 30, f"{recording} {role} replay")
        yield url
    finally:
        stop(proc)


def _ports_sorted_by_url(n: int) -> list[int]:
    """Free ports ordered so that the first one's URL sorts last: the cache-aware policy
    breaks ties by URL, so that worker is picked first."""
    return sorted((free_port() for _ in range(n)), key=lambda p: f"http://127.0.0.1:{p}", reverse=True)


def _received(url: str) -> list[dict]:
    return httpx.get(f"{url}/_received").json()


def _chat(router: str, **kw):
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="none")
    return client.chat.completions.with_raw_response.create(model="default", messages=QUESTION, **kw)


def _streamed(router: str) -> tuple[str, dict, httpx.Headers]:
    raw = _chat(router, stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in raw.parse():
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage.model_dump() if chunk.usage else usage
    return text, usage, raw.headers


@pytest.fixture(scope="module")
def vllm_pair():
    recording = json.loads((PEERS / "vllm_pd.json").read_text())
    broken_port, good_port = _ports_sorted_by_url(2)
    with replaying("vllm_pd.json", "prefill") as p, \
            replaying("vllm_pd.json", "decode", fail=10_000, port=broken_port) as broken, \
            replaying("vllm_pd.json", "decode", port=good_port) as good, \
            running_server("--prefill", f"vllm-pd+{p}", "--decode", f"vllm-pd+{broken}", f"vllm-pd+{good}",
                           "--log-level", "warning", command="router") as router:
        yield {"router": router, "p": p, "broken": broken, "good": good, "recording": recording}


def test_vllm_pd_hands_the_prefills_transfer_params_to_the_decode_and_reports_its_cache(vllm_pair):
    rec, router = vllm_pair["recording"], vllm_pair["router"]
    # a client's own transfer parameters never reach a server (the replay refuses any other)
    hostile = {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 1}}
    raw = _chat(router, max_tokens=16, extra_body=hostile)
    answer = raw.parse()
    assert answer.choices[0].message.content == rec["decode"]["json"]["choices"][0]["message"]["content"]
    assert answer.model == rec["model"]  # a pool of foreign servers only: the router serves their model id
    # cached tokens are the prefill's (32), not the decode's count of what it pulled (41)
    assert answer.usage.prompt_tokens_details.cached_tokens == 32
    cost = answer.usage.model_extra["cost"]
    assert cost["cached_input"] > 0 and cost["total"] > 0
    served = raw.headers["x-xlserve-served-by"]
    assert f"prefill={vllm_pair['p']}" in served and f"decode={vllm_pair['good']}" in served
    prefill_sent = _received(vllm_pair["p"])[-1]
    assert prefill_sent["max_tokens"] == 1 and prefill_sent["stream"] is False
    assert prefill_sent["model"] == rec["model"]  # the server's own model id, not the client's "default"
    workers = {w["url"]: w for w in httpx.get(f"{router}/router/workers").json()}
    assert workers[vllm_pair["p"]]["cache_tokens"] == 4096 * 16  # num_gpu_blocks x block_size on /metrics
    decode_sent = _received(vllm_pair["good"])[-1]
    assert decode_sent["kv_transfer_params"] == rec["prefill"]["json"]["kv_transfer_params"]
    assert decode_sent["max_tokens"] == 16


def test_vllm_pd_stream_is_rewritten_and_a_decode_failure_after_prefill_moves_to_another(vllm_pair):
    rec, router = vllm_pair["recording"], vllm_pair["router"]
    text, usage, headers = _streamed(router)
    assert text == rec["decode"]["json"]["choices"][0]["message"]["content"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 32 and usage["completion_tokens"] == 8
    assert f"decode={vllm_pair['good']}" in headers["x-xlserve-served-by"]
    # the broken decode server was tried first (it sorts first), with the same transfer parameters
    tried = _received(vllm_pair["broken"])
    assert tried and all(b["kv_transfer_params"] == rec["prefill"]["json"]["kv_transfer_params"] for b in tried)


def test_sglang_pd_sends_one_unguessable_room_to_both_sides_and_reports_the_prefills_cache():
    broken_port, good_port = _ports_sorted_by_url(2)
    with replaying("sglang_pd.json", "prefill") as p, replaying("sglang_pd.json", "decode", port=good_port) as d, \
            replaying("sglang_pd.json", "decode", fail=10_000, port=broken_port) as broken, \
            running_server("--prefill", f"sglang-pd+{p}", "--decode", f"sglang-pd+{broken}", f"sglang-pd+{d}",
                           "--log-level", "warning", command="router") as router:
        answer = _chat(router, max_tokens=16, extra_body={"bootstrap_host": "10.9.9.9", "bootstrap_room": 1}).parse()
        assert answer.choices[0].message.content == "Paris is the capital of France."
        assert answer.usage.prompt_tokens_details.cached_tokens == 16  # the prefill's; the decode says 0
        text, usage, _ = _streamed(router)
        assert text == "Paris is the capital of France." and usage["prompt_tokens_details"]["cached_tokens"] == 16
        workers = {w["url"]: w for w in httpx.get(f"{router}/router/workers").json()}
        assert workers[p]["cache_tokens"] == 65536  # max_total_num_tokens of /get_server_info
        # the broken decode (tried first) failed the first pair: it started again in a new room
        to_prefill = {b["bootstrap_room"]: b for b in _received(p)}
        to_decode, to_broken = _received(d), _received(broken)
        assert len(to_decode) == 2 and to_broken
        assert not {b["bootstrap_room"] for b in to_broken} & {b["bootstrap_room"] for b in to_decode}
        for b in to_decode:
            a = to_prefill[b["bootstrap_room"]]  # the prefill got the same room
            assert a["bootstrap_host"] == b["bootstrap_host"] == "127.0.0.1"
            assert a["bootstrap_port"] == b["bootstrap_port"] == 8998  # from the prefill's /get_server_info
        assert to_decode[0]["bootstrap_room"] != to_decode[1]["bootstrap_room"]
        assert 1 not in to_prefill  # not the client's room


def test_all_decodes_failing_after_prefill_is_a_clear_retryable_error():
    with replaying("vllm_pd.json", "prefill") as p, replaying("vllm_pd.json", "decode", fail=10_000) as d, \
            running_server("--prefill", f"vllm-pd+{p}", "--decode", f"vllm-pd+{d}", "--log-level", "warning",
                           command="router") as router:
        with pytest.raises(openai.APIStatusError) as e:
            _chat(router, max_tokens=4)
        assert e.value.status_code == 503 and "decode" in e.value.message
        assert httpx.get(f"{p}/health").status_code == 200 and _received(d)


def _peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024


def test_a_decode_server_streaming_a_line_without_end_fails_at_the_bound_and_the_router_stays_small():
    """Without a bound on a line the router would read the endless line into memory until the
    client's 30 s timeout; with it the stream fails after 16 MiB (MAX_SSE_LINE_BYTES)."""
    with replaying("vllm_pd.json", "prefill") as p, \
            replaying("vllm_pd.json", "decode", 0, None, "--endless-line") as d, \
            running_server("--prefill", f"vllm-pd+{p}", "--decode", f"vllm-pd+{d}", "--log-level", "warning",
                           command="router") as router:
        pid = PROCESSES[router].pid
        before = _peak_rss_mib(pid)
        client = openai.OpenAI(base_url=f"{router}/v1", api_key="none", timeout=30, max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="default", messages=QUESTION, stream=True)
        assert e.value.status_code == 503 and "decode" in e.value.message  # marked down: the log says why
        assert _peak_rss_mib(pid) - before < 128
        assert httpx.get(f"{router}/health").status_code == 200


@pytest.mark.parametrize("how", ["chunked", "announced", "gzip"])
def test_a_prefill_server_answering_an_oversized_body_fails_at_the_bound_and_the_router_stays_small(how):
    """An answer read whole is bounded (64 MiB, MAX_BODY_BYTES): past it, announced past it, or
    compressed when the router asked for identity (65 MiB in ~65 KiB of gzip), the server
    failed; the router never holds the 65 MiB."""
    with replaying("vllm_pd.json", "prefill", 0, None, "--oversized", how) as p, \
            replaying("vllm_pd.json", "decode") as d, \
            running_server("--prefill", f"vllm-pd+{p}", "--decode", f"vllm-pd+{d}", "--log-level", "warning",
                           command="router") as router:
        pid = PROCESSES[router].pid
        before = _peak_rss_mib(pid)
        with pytest.raises(openai.APIStatusError) as e:
            openai.OpenAI(base_url=f"{router}/v1", api_key="none", timeout=30, max_retries=0).chat.completions.create(
                model="default", messages=QUESTION, max_tokens=4)
        assert e.value.status_code == 503 and "prefill" in e.value.message  # marked down: the log says why
        assert _peak_rss_mib(pid) - before < (96 if how == "chunked" else 16)
        assert httpx.get(f"{router}/health").status_code == 200
        with pytest.raises(httpx.ReadError, match="over|announced|encoded"):  # the synchronous reads
            fetch("POST", f"{p}/v1/chat/completions", json={})
