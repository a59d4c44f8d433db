"""Prefill/decode disaggregation between two real worker processes on 127.0.0.1: the
prefill worker computes the prompt and pins its KV, the decode worker pulls it over TCP
and generates. Output equals a colocated run; failed pulls follow the policy; no pinned
block is left behind."""

import json
import time

import httpx
import pytest

from tests.e2e.server_process import metric, metric_value, running_server

PROMPT_TEXT = ("You are a careful assistant. " * 20) + "Name three rivers in Europe."
SAMPLING = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def workers():
    common = ("--dtype", "float32", "--log-level", "warning")
    with running_server("--role", "prefill", *common) as p, running_server("--role", "decode", *common) as d:
        kv = httpx.get(f"{p}/internal/info").json()["kv"]  # what a router registers with its decode workers
        assert httpx.post(f"{d}/internal/kv/peers", json={"peers": [{"host": kv["host"], "port": kv["port"]}]},
                          ).json() == {"peers": 1}
        yield p, d


def _ids(url):
    from xlserve.loader.gguf_file import GGUFFile
    from xlserve.loader.model_source import default_model_path
    from xlserve.loader.tokenizer import load_gguf_tokenizer
    tok = load_gguf_tokenizer(GGUFFile(default_model_path()).meta)
    return tok.encode_chat([{"role": "user", "content": PROMPT_TEXT}])


def _generate(url, **body):
    r = httpx.post(f"{url}/internal/generate", json=body, timeout=120)
    return r


def _wait_unpinned(url):
    assert metric(url, "xlserve_kv_blocks_used") == 0


def test_pd_equals_colocated_and_releases_pins(workers):
    p, d = workers
    ids = _ids(p)
    colocated = _generate(d, prompt_token_ids=ids, sampling=SAMPLING).json()
    first = _generate(p, prompt_token_ids=ids, sampling=SAMPLING, kv_export=True).json()
    assert first["token_ids"] == colocated["token_ids"][:1]
    handle = first["kv"]
    assert handle["transport"] == "tcp" and len(handle["block_hashes"]) == len(ids) // 16
    assert metric(p, "xlserve_kv_blocks_used") == len(ids) // 16  # pinned for the pull
    assert first["finish_reason"] == "paused"
    second = _generate(d, prompt_token_ids=ids, kv_import=handle, resume_token_ids=first["token_ids"],
                       sampling=SAMPLING).json()
    assert second["kv_import"]["blocks"] == len(ids) // 16 and second["kv_import"]["error"] is None
    assert second["cached_tokens"] >= (len(ids) // 16) * 16 - 16
    assert first["token_ids"] + second["token_ids"] == colocated["token_ids"]
    assert httpx.post(f"{p}/internal/kv/release", json={"pin_id": handle["pin_id"]}).json() == {"released": True}
    _wait_unpinned(p)


def test_pd_streamed_equals_colocated(workers):
    p, d = workers
    ids = _ids(p)[:-3] + [28, 29, 30]  # a prompt the decode worker has not cached
    colocated = _generate(p, prompt_token_ids=ids, sampling=SAMPLING).json()["token_ids"]
    first = _generate(p, prompt_token_ids=ids, sampling=SAMPLING, kv_export=True).json()
    tokens, final = [], None
    body = {"prompt_token_ids": ids, "resume_token_ids": first["token_ids"], "kv_import": first["kv"],
            "stream": True, "sampling": SAMPLING}
    with httpx.stream("POST", f"{d}/internal/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                tokens += event["token_ids"]
                final = event if event["finish_reason"] else final
    assert first["token_ids"] + tokens == colocated
    assert final["kv_import"]["blocks"] > 0
    httpx.post(f"{p}/internal/kv/release", json={"pin_id": first["kv"]["pin_id"]})
    _wait_unpinned(p)


def test_failed_pull_recomputes_or_fails_and_leaves_no_pin(workers):
    p, d = workers
    ids = _ids(p)[:-3] + [40, 41, 42]
    colocated = _generate(p, prompt_token_ids=ids, sampling=SAMPLING).json()["token_ids"]
    first = _generate(p, prompt_token_ids=ids, sampling=SAMPLING, kv_export=True).json()
    broken = {**first["kv"], "secret": "0" * 32}  # a registered server that refuses this secret
    resume = {"resume_token_ids": first["token_ids"], "sampling": SAMPLING}
    recomputed = _generate(d, prompt_token_ids=ids, kv_import=broken, on_pull_failure="recompute", **resume).json()
    assert recomputed["kv_import"]["error"] and recomputed["kv_import"]["blocks"] == 0
    assert first["token_ids"] + recomputed["token_ids"] == colocated
    failed = _generate(d, prompt_token_ids=ids, kv_import=broken, on_pull_failure="fail", **resume)
    assert failed.status_code == 502 and "KV pull failed" in failed.json()["error"]["message"]
    httpx.post(f"{p}/internal/kv/release", json={"pin_id": first["kv"]["pin_id"]})
    _wait_unpinned(p)
    assert metric(d, "xlserve_kv_blocks_used") == 0


def test_roles_and_bad_internal_requests(workers):
    p, d = workers
    assert httpx.get(f"{p}/internal/info").json()["role"] == "prefill"
    info = httpx.get(f"{d}/internal/info").json()
    assert info["role"] == "decode" and info["kv"] is None
    assert _generate(d, prompt_token_ids=[1, 2, 3], kv_export=True).status_code == 400
    assert _generate(d, prompt_token_ids=[]).status_code == 400
    assert _generate(d, prompt_token_ids=[1, 2], sampling={"top_p": 2.0}).status_code == 400
    assert _generate(d, prompt_token_ids=[10 ** 9]).status_code == 400
    too_many = _generate(d, prompt_token_ids=[1, 2], resume_token_ids=[5, 6], sampling={"max_tokens": 2})
    assert too_many.status_code == 400 and "leave nothing to generate" in too_many.json()["error"]["message"]


def test_unregistered_kv_servers_and_foreign_blocks_are_refused_before_any_connection(workers):
    import socket
    p, d = workers
    ids = _ids(p)[:-3] + [50, 51, 52]
    first = _generate(p, prompt_token_ids=ids, sampling=SAMPLING, kv_export=True).json()
    resume = {"resume_token_ids": first["token_ids"], "sampling": SAMPLING, "on_pull_failure": "recompute"}
    with socket.socket() as listener:  # records any connection made to it
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.setblocking(False)
        rogue = {**first["kv"], "port": listener.getsockname()[1]}
        out = _generate(d, prompt_token_ids=ids, kv_import=rogue, **resume).json()
        assert "not a registered KV server" in out["kv_import"]["error"] and out["kv_import"]["blocks"] == 0
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    other = _generate(d, prompt_token_ids=ids[:-20] + [60] * 20, kv_import=first["kv"], **resume).json()
    assert "not this prompt's" in other["kv_import"]["error"]  # would have entered the cache under its hashes
    httpx.post(f"{p}/internal/kv/release", json={"pin_id": first["kv"]["pin_id"]})
    _wait_unpinned(p)
    assert metric(d, "xlserve_kv_blocks_used") == 0


def test_a_caller_that_leaves_during_the_kv_pull_starts_nothing(workers):
    """The router closes its decode call when its client leaves; a decode worker still pulling
    then starts nothing for it (it used to submit the request, recomputing a failed pull, and
    abort it right after)."""
    import socket
    p, d = workers
    ids = _ids(p)[:-3] + [70, 71, 72]
    first = _generate(p, prompt_token_ids=ids, sampling=SAMPLING, kv_export=True).json()
    aborted = metric_value(d, "xlserve_request_success_total", finished_reason="abort")
    with socket.create_server(("127.0.0.1", 0)) as stalling:  # a KV server that answers when told
        peers = [{"host": first["kv"]["host"], "port": first["kv"]["port"]},
                 {"host": "127.0.0.1", "port": stalling.getsockname()[1]}]
        assert httpx.post(f"{d}/internal/kv/peers", json={"peers": peers}).json() == {"peers": 2}
        body = json.dumps({"prompt_token_ids": ids, "kv_import": {**first["kv"], "port": peers[1]["port"]},
                           "resume_token_ids": first["token_ids"], "sampling": SAMPLING, "stream": True,
                           "on_pull_failure": "recompute"}).encode()
        caller = socket.create_connection(("127.0.0.1", int(d.rsplit(":", 1)[1])))
        caller.sendall(b"POST /internal/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        stalling.settimeout(30)
        pull, _ = stalling.accept()  # the decode worker is pulling
        caller.close()  # and its caller leaves
        time.sleep(1)
        pull.close()  # the pull fails: recompute, unless nobody waits for the answer
    time.sleep(2)
    assert metric_value(d, "xlserve_request_success_total", finished_reason="abort") == aborted  # none submitted
    assert metric(d, "xlserve_num_requests_running") == 0
    kv = httpx.get(f"{p}/internal/info").json()["kv"]
    assert httpx.post(f"{d}/internal/kv/peers", json={"peers": [{"host": kv["host"], "port": kv["port"]}]},
                      ).json() == {"peers": 1}
    httpx.post(f"{p}/internal/kv/release", json={"pin_id": first["kv"]["pin_id"]})
    _wait_unpinned(p)


def test_each_router_registers_its_own_kv_peers(workers):
    """Two routers with other prefill workers share this decode worker: the second's
    registration does not take the first's KV server away; a router replaces only its own."""
    p, d = workers
    kv = httpx.get(f"{p}/internal/info").json()["kv"]
    mine, theirs = [{"host": kv["host"], "port": kv["port"]}], [{"host": "127.0.0.1", "port": 9}]

    def pull(tail):
        ids = _ids(p)[:-3] + tail
        first = _generate(p, prompt_token_ids=ids, sampling=SAMPLING, kv_export=True).json()
        out = _generate(d, prompt_token_ids=ids, kv_import=first["kv"], resume_token_ids=first["token_ids"],
                        sampling=SAMPLING, on_pull_failure="recompute").json()
        httpx.post(f"{p}/internal/kv/release", json={"pin_id": first["kv"]["pin_id"]})
        return out["kv_import"]
    try:  # the fixture registered as the anonymous router: here that one allows another server
        httpx.post(f"{d}/internal/kv/peers", json={"peers": theirs})
        assert httpx.post(f"{d}/internal/kv/peers", json={"peers": mine, "router": "a"}).json() == {"peers": 1}
        assert httpx.post(f"{d}/internal/kv/peers", json={"peers": theirs, "router": "b"}).json() == {"peers": 1}
        assert pull([80, 81, 82])["error"] is None  # a's server is still allowed
        httpx.post(f"{d}/internal/kv/peers", json={"peers": theirs, "router": "a"})
        assert "not a registered KV server" in pull([83, 84, 85])["error"]
    finally:
        httpx.post(f"{d}/internal/kv/peers", json={"peers": [], "router": "a"})
        httpx.post(f"{d}/internal/kv/peers", json={"peers": [], "router": "b"})
        httpx.post(f"{d}/internal/kv/peers", json={"peers": mine})
    _wait_unpinned(p)
