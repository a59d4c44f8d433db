"""The router in front of real prefill and decode workers, driven by the openai client."""

import time

import httpx
import openai
import pytest

from tests.e2e.server_process import metric, metric_value, running_server

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a meticulous travel assistant. " * 25
QUESTION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three rivers in Europe."}]


@pytest.fixture(scope="module")
def cluster():
    common = ("--dtype", "float32", "--log-level", "warning")
    with running_server("--role", "prefill", *common) as p, running_server("--role", "decode", *common) as d, \
            running_server("--prefill", p, "--decode", d, "--log-level", "warning", command="router") as pd, \
            running_server("--both", p, d, "--policy", "least_tokens", "--log-level", "warning",
                           command="router") as pair:
        yield {"p": p, "d": d, "router": pd, "pair": pair}


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_pd_greedy_equals_colocated_streamed_and_not(cluster):
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    alone = _client(cluster["d"]).chat.completions.create(**kw, logprobs=True).choices[0]
    colocated = alone.message.content
    raw = _client(cluster["router"]).chat.completions.with_raw_response.create(**kw, logprobs=True)
    routed = raw.parse()
    assert routed.choices[0].message.content == colocated
    # the same values: the decode worker continues from the prefill worker's KV as from its own (in
    # float32 not the same bits: a prompt prefilled whole or after a prefix hit differs by ~2e-7)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(routed.choices[0].logprobs.content,
                                                          alone.logprobs.content)) < 1e-4
    assert raw.headers["x-xlserve-served-by"] == f"prefill={cluster['p']}, decode={cluster['d']}"
    raw_stream = _client(cluster["router"]).chat.completions.with_raw_response.create(
        stream=True, stream_options={"include_usage": True}, **kw)
    assert raw_stream.headers["x-xlserve-served-by"] == f"prefill={cluster['p']}, decode={cluster['d']}"
    stream = raw_stream.parse()
    text, usage = "", None
    for chunk in stream:
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert text == colocated
    assert usage.completion_tokens == routed.usage.completion_tokens
    # the decode worker pulled the KV (the router registered the prefill's KV server with it)
    assert metric(cluster["router"], "xlserve_kv_transfer_bytes_total") > 0
    assert metric(cluster["router"], "xlserve_kv_transfer_failures_total") == 0
    assert metric(cluster["p"], "xlserve_kv_blocks_used") == 0  # pins released
    assert metric(cluster["d"], "xlserve_kv_blocks_used") == 0


def _streamed_text(client, **kw):
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices)


SCHEMA = {"type": "object", "properties": {"river": {"type": "string"}, "km": {"type": "integer"}},
          "required": ["river", "km"], "additionalProperties": False}


def test_pd_continues_seeds_grammars_and_stop_strings_like_one_worker(cluster):
    """The decode worker resumes the prefill's answer: a seeded sample, a JSON-schema answer
    and a stop string that spans the first and second token come out as on one worker."""
    colocated, routed = _client(cluster["d"]), _client(cluster["router"])
    seeded = dict(model=MODEL, messages=QUESTION, max_tokens=16, temperature=1.0, top_p=0.9, seed=11,
                  frequency_penalty=0.4)
    guided = dict(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "river", "schema": SCHEMA}})
    for kw in (seeded, guided):
        want = colocated.chat.completions.create(**kw).choices[0].message.content
        assert routed.chat.completions.create(**kw).choices[0].message.content == want
        assert _streamed_text(routed, **kw) == want
    text = colocated.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4,
                                             temperature=0).choices[0].message.content
    cut = len(colocated.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1,
                                                temperature=0).choices[0].message.content)
    stop = text[cut - 1:cut + 1]  # one character each side of the hand-off
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, stop=[stop])
    want = colocated.chat.completions.create(**kw).choices[0]
    got = routed.chat.completions.create(**kw).choices[0]
    assert (got.message.content, got.finish_reason) == (want.message.content, "stop")
    assert stop not in want.message.content
    assert _streamed_text(routed, **kw) == want.message.content
    assert metric(cluster["p"], "xlserve_kv_blocks_used") == 0
    assert metric(cluster["d"], "xlserve_kv_blocks_used") == 0


def test_second_turn_reports_cached_prefix_through_the_router(cluster):
    client = _client(cluster["router"])
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    turn2 = QUESTION + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And three in Asia?"}]
    second = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=8, temperature=0)
    shared = first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= shared - 16
    u = second.usage  # priced with the cached-input discount (defaults 0.60 / 0.10 / 3.00 per million)
    cached = u.prompt_tokens_details.cached_tokens
    expected = ((u.prompt_tokens - cached) * 0.60 + cached * 0.10 + u.completion_tokens * 3.00) / 1e6
    assert u.cost["total"] == pytest.approx(expected) and u.cost["currency"] == "USD"
    stream = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens >= shared - 16


def _served(url):
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("xlserve_request_success_total{"))


def test_session_affinity_keeps_a_session_on_one_worker(cluster):
    client = _client(cluster["pair"])
    before = {w: _served(cluster[w]) for w in ("p", "d")}
    for i in range(4):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Question {i}"}],
                                       max_tokens=4, temperature=0, extra_headers={"x-session-affinity": "agent-7"})
    grown = {w: _served(cluster[w]) - before[w] for w in ("p", "d")}
    assert sorted(grown.values()) == [0, 4]  # all four turns on one worker, the other idle
    workers = httpx.get(f"{cluster['pair']}/router/workers").json()
    assert all(w["healthy"] for w in workers) and len(workers) == 2


def test_router_index_learns_from_worker_kv_events(cluster):
    import time
    client = _client(cluster["router"])
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        blocks = {w["role"]: w["indexed_blocks"] for w in httpx.get(f"{cluster['router']}/router/workers").json()}
        if blocks["prefill"] > 5 and blocks["decode"] > 5:
            break
        time.sleep(0.5)
    assert blocks["prefill"] > 5 and blocks["decode"] > 5
    feed = httpx.get(f"{cluster['p']}/internal/kv/events", params={"since": 0}).json()
    assert feed["reset"] and len(feed["snapshot"]) >= blocks["prefill"] - 5


def test_router_predicted_cache_hits_match_the_workers_report(cluster):
    router, client = cluster["router"], _client(cluster["router"])
    chat = [{"role": "system", "content": "You plan rail journeys across the Alps. " * 20},
            {"role": "user", "content": "Zurich to Milan?"}]

    def counters():
        return (metric(router, "xlserve_router_predicted_cached_tokens_total"),
                metric(router, "xlserve_router_actual_cached_tokens_total"))
    before = counters()
    first = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, temperature=0)
    after_first = counters()
    assert after_first[0] - before[0] == 0 == after_first[1] - before[1]  # a new prompt: nothing cached
    second = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, temperature=0)
    predicted, actual = (b - a for a, b in zip(after_first, counters()))
    assert actual == second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    assert predicted == actual  # the index knew exactly what the prefill worker held
    assert "xlserve_router_cache_prediction_error_tokens_bucket" in httpx.get(f"{router}/metrics").text


def test_router_metrics_and_errors(cluster):
    text = httpx.get(f"{cluster['router']}/metrics").text
    for name in ("xlserve_router_decisions_total", "xlserve_router_inflight_tokens", "xlserve_kv_transfer_bytes_total",
                 "xlserve_time_to_first_token_seconds_bucket", "xlserve_inter_token_latency_seconds_bucket"):
        assert name in text, name
    assert metric(cluster["router"], "xlserve_gc_frozen_objects") > 10_000  # the startup heap (openai/app.py)
    r = httpx.post(f"{cluster['router']}/v1/chat/completions", json={"messages": [], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["message"]


def _families(text: str) -> dict[str, str]:
    """Metric family name -> type, from Prometheus text (a counter's name without ``_total``)."""
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
    return {name.removesuffix("_total") if kind == "counter" else name: kind for name, kind in types.items()}


def test_metrics_follow_prometheus_conventions_and_carry_every_workers_engine(cluster):
    import time
    router = cluster["router"]
    _client(router).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    time.sleep(2.5)  # one health round: the router has read the workers' engine counters
    for url in (router, cluster["p"], cluster["d"]):
        text = httpx.get(f"{url}/metrics").text
        assert "_created" not in text
        samples = [line.split("{")[0].split()[0] for line in text.splitlines() if not line.startswith("#")]
        for name, kind in _families(text).items():
            mine = [s for s in samples if s == name or s.startswith(name + "_")]
            if kind == "counter":
                assert all(s == name + "_total" for s in mine), (name, mine)
            else:
                assert not name.endswith("_total"), name  # a gauge named like a counter misleads
    text = httpx.get(f"{router}/metrics").text
    for worker in (cluster["p"], cluster["d"]):
        for name in ("xlserve_num_requests_running", "xlserve_kv_cache_usage_perc", "xlserve_prefix_cache_hits_total"):
            assert f'{name}{{worker="{worker}"}}' in text, (name, worker)
    assert metric(cluster["p"], "xlserve_prefix_cache_queries_total") > 0


def test_the_grafana_dashboard_loads_and_queries_only_metrics_that_exist(cluster):
    """The committed JSON is what Grafana's typed SDK builds (deploy/grafana/dashboard.py) and
    loads back unchanged; every metric a panel queries is on the router's /metrics."""
    import importlib.util
    import json
    import pathlib
    import re

    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard
    root = pathlib.Path(__file__).parents[2] / "deploy" / "grafana"
    data = json.loads((root / "xlserve-dashboard.json").read_text())
    assert json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder)) == data
    spec = importlib.util.spec_from_file_location("dashboard", root / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.build() == data  # regenerated: nobody edited the JSON by hand
    exprs = [t["expr"] for p in data["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    for topic in ("time_to_first_token", "inter_token", "generation_tokens", "prefix_cache_hits", "inflight_tokens",
                  "kv_cache_usage", "kv_transfer", 'finished_reason="abort"'):
        assert any(topic in e for e in exprs), topic
    _client(cluster["router"]).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    families = _families(httpx.get(f"{cluster['router']}/metrics").text)
    exposed = {f + suffix for f, kind in families.items()
               for suffix in (("_total",) if kind == "counter" else ("_bucket", "_sum", "_count", ""))}
    used = {m for e in exprs for m in re.findall(r"xlserve_[a-z0-9_]+", e)}
    assert used and used <= exposed, sorted(used - exposed)


def test_serve_starts_router_prefill_and_decode_and_ctrl_c_stops_all():
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.e2e.server_process import free_port
    from xlserve.launcher import wait_healthy
    port = free_port()

    def as_a_script_background_job():  # `xlserve serve &` in a script starts with SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    proc = subprocess.Popen([sys.executable, "-m", "xlserve.cli", "serve", "--port", str(port), "--log-level",
                             "warning"], start_new_session=True, preexec_fn=as_a_script_background_job,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy([(proc, url)])
        workers = httpx.get(f"{url}/router/workers").json()
        assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
        r = _client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                                 max_tokens=8)
        assert r.choices[0].message.content
        internal = httpx.get(f"{workers[0]['url']}/internal/info")
        assert internal.status_code == 401  # workers want the key only the router holds
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group, as in a terminal
        log = proc.communicate(timeout=30)[1]
    time.sleep(1)
    leftover = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert leftover == [] and "restart" not in log, log


def test_killing_the_decode_worker_mid_stream(cluster):
    """The client gets a clean error event, the router marks the worker down, and the next
    request succeeds on the other decode worker."""
    import time

    from tests.e2e.server_process import PROCESSES
    common = ("--dtype", "float32", "--log-level", "warning")
    with running_server("--role", "decode", *common) as d1, running_server("--role", "decode", *common) as d2, \
            running_server("--prefill", cluster["p"], "--decode", d1, d2, "--policy", "round_robin",
                           "--no-affinity", "--log-level", "warning", command="router") as router:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count slowly."}], "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{router}/v1/chat/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            while len(events) < 5:
                line = next(lines)
                if line.startswith("data: "):
                    events.append(line)
            busy = [w for w in httpx.get(f"{router}/router/workers").json() if w["decode_tokens"] > 0]
            assert len(busy) == 1
            PROCESSES[busy[0]["url"]].kill()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = {w["url"]: w["healthy"] for w in httpx.get(f"{router}/router/workers").json()}
            if state[busy[0]["url"]] is False:
                break
            time.sleep(0.3)
        assert state[busy[0]["url"]] is False
        ok = _client(router).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=4)
        assert ok.choices[0].finish_reason in ("stop", "length")
    assert metric(cluster["p"], "xlserve_kv_blocks_used") == 0  # the killed stream's pin was released


def test_affinity_session_moves_when_its_worker_is_killed(cluster):
    """Turns of a session stay on their worker; once that worker dies, the next turn is
    answered by the other one (a failure before the first token is retried there)."""
    from tests.e2e.server_process import PROCESSES
    common = ("--dtype", "float32", "--log-level", "warning")
    with running_server(*common) as w1, running_server(*common) as w2, \
            running_server("--both", w1, w2, "--log-level", "warning", command="router") as router:
        client = _client(router)

        def turn(i):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"Step {i} of the plan?"}], max_tokens=4,
                temperature=0, extra_headers={"x-session-affinity": "agent-42"})
            assert raw.parse().choices[0].finish_reason in ("stop", "length")
            return raw.headers["x-xlserve-served-by"].split("=", 1)[1]
        homes = {turn(i) for i in range(3)}
        assert len(homes) == 1
        home = homes.pop()
        PROCESSES[home].kill()
        PROCESSES[home].wait()
        assert {turn(i) for i in range(3, 5)} == {w2 if home == w1 else w1}


def test_agentic_workload_through_the_router(cluster):
    import asyncio

    from xlserve.bench.agentic import run_agentic, summarize
    result = asyncio.run(run_agentic(cluster["router"], sessions=2, turns=2, concurrency=2, max_tokens=4))
    summary = summarize(result)
    assert summary["turns"] == 4 and summary["errors"] == 0
    assert summary["cache_hit_ratio"] > 0.3  # later turns reuse the shared system prompt and their history
    assert summary["ttft_p50_s"] > 0 and summary["cost_usd"] > 0


def test_trace_replay_through_the_router(cluster):
    import asyncio

    from xlserve.bench.agentic import summarize
    from xlserve.bench.trace_replay import TraceReplay, build_requests, load_trace, run_trace
    replay = TraceReplay(requests=6, length_scale=1 / 64, duration_s=2, seed=3)
    requests, _ = build_requests(load_trace(replay.path), replay)
    summary = summarize(asyncio.run(run_trace(cluster["router"], requests)))
    assert summary["turns"] == 6 and summary["errors"] == 0
    assert summary["output_tok_s"] > 0 and summary["ttft_p90_s"] > 0


def test_a_worker_failing_before_its_first_token_is_retried_elsewhere(cluster):
    """A decode worker that is up (/health answers) but refuses work (it expects another API
    key) fails before its first token: the router marks it down and the request succeeds
    on the other decode worker."""
    common = ("--dtype", "float32", "--log-level", "warning")
    with running_server("--role", "decode", "--api-key", "not-the-routers-key", *common) as refusing, \
            running_server("--prefill", cluster["p"], "--decode", refusing, cluster["d"], "--policy", "round_robin",
                           "--no-affinity", "--log-level", "warning", command="router") as router:
        for i in range(2):  # round robin reaches the refusing worker within two requests
            r = _client(router).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Hi {i}"}],
                                                        max_tokens=4, temperature=0)
            assert r.choices[0].message.content
        state = {w["url"]: w["healthy"] for w in httpx.get(f"{router}/router/workers").json()}
        assert state[cluster["d"]] is True
    assert metric(cluster["p"], "xlserve_kv_blocks_used") == 0


def test_a_prefill_longer_than_the_worker_timeout_is_not_taken_for_a_hang(cluster):
    """A worker computing a prompt for longer than the router's --worker-timeout sends
    heartbeats (worker/heartbeat.py), so the router neither fails the request nor marks the
    worker down: as the prefill of a hand-off (a JSON answer) and as a colocated worker (a
    stream). One token per engine step, and a prompt sized to this CPU's step time, make the
    prefill last about four timeouts."""
    import time
    timeout, sentence = 1.0, "You are a meticulous travel assistant. "
    with running_server("--dtype", "float32", "--log-level", "warning", "--max-num-batched-tokens", "1") as slow, \
            running_server("--prefill", slow, "--decode", cluster["d"], "--worker-timeout", str(timeout),
                           "--log-level", "warning", command="router") as pd, \
            running_server("--both", slow, "--worker-timeout", str(timeout), "--log-level", "warning",
                           command="router") as colocated:
        began = time.monotonic()
        usage = _client(slow).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": sentence * 8}],
                                                      max_tokens=1).usage
        seconds_per_sentence = (time.monotonic() - began) / usage.prompt_tokens * len(sentence.split()) * 1.3
        sentences = int(4 * timeout / seconds_per_sentence) + 1
        for router, stream in ((pd, False), (colocated, True)):
            # another prompt each time: nothing of it cached
            kw = dict(model=MODEL, messages=[{"role": "user", "content": f"{router} {sentence * sentences}"}],
                      max_tokens=3, temperature=0)
            want = _client(cluster["d"]).chat.completions.create(**kw).choices[0].message.content
            began = time.monotonic()
            text = _streamed_text(_client(router), **kw) if stream else \
                _client(router).chat.completions.create(**kw).choices[0].message.content
            assert time.monotonic() - began > 2 * timeout  # else this test proves nothing
            assert text == want
            assert all(w["healthy"] for w in httpx.get(f"{router}/router/workers").json())


def test_logit_bias_colocated_and_disaggregated_streamed_and_not(cluster):
    """+100 on one token makes the answer that token repeated; -100 bans the token greedy
    would pick first. The bias travels to the decode worker (it is in the wire form)."""
    chat = dict(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0)
    plain = _client(cluster["d"]).chat.completions.create(**chat, logprobs=True)
    first_token = plain.choices[0].logprobs.content[0].token
    from xlserve.loader.model_loader import load_tokenizer
    tok = load_tokenizer("default")
    word = tok.encode(" river", add_special_tokens=False)[0]
    banned_id = tok.encode(first_token, add_special_tokens=False)[0]
    for url in (cluster["d"], cluster["router"]):
        client = _client(url)
        forced = client.chat.completions.create(**chat, logit_bias={str(word): 100}).choices[0].message.content
        assert forced == tok.decode([word] * 6)
        assert _streamed_text(client, **chat, logit_bias={str(word): 100}) == forced
        banned = client.chat.completions.create(**chat, logit_bias={str(banned_id): -100}, logprobs=True)
        assert banned.choices[0].logprobs.content[0].token != first_token
        assert _streamed_text(client, **chat, logit_bias={str(banned_id): -100}) == banned.choices[0].message.content
    r = httpx.post(f"{cluster['router']}/v1/chat/completions", json={**chat, "logit_bias": {"99999999": 5}})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]


def test_a_started_router_never_loads_torch(cluster):
    """The router needs only the tokenizer and chat template: no torch in its process
    (its memory maps hold no libtorch), after it has served requests."""
    import psutil

    from tests.e2e.server_process import PROCESSES
    _client(cluster["router"]).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    router = psutil.Process(PROCESSES[cluster["router"]].pid)
    assert not [m.path for m in router.memory_maps() if "libtorch" in m.path]
    worker = psutil.Process(PROCESSES[cluster["d"]].pid)
    assert [m.path for m in worker.memory_maps() if "libtorch" in m.path]  # the check can see torch


def test_clients_that_leave_at_the_first_token_cost_the_decode_worker_no_recompute(cluster):
    """A streaming client that leaves as its first token arrives (from the prefill) leaves while
    the router asks the decode worker, which pulls the KV before it answers: the prefill's pin
    must outlive that pull. Released at once, the pull was refused and the decode worker
    computed the whole prompt again for nobody (8 of 12 such clients did)."""
    def recomputed():
        return metric_value(cluster["d"], "xlserve_kv_pulls_total", outcome="recomputed")
    before, pulled = recomputed(), metric_value(cluster["d"], "xlserve_kv_pulls_total", outcome="pulled")
    for i in range(12):
        body = {"model": MODEL, "max_tokens": 32, "stream": True,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Count to {i}."}]}
        with httpx.stream("POST", f"{cluster['router']}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if '"content"' in line:
                    break  # the first token: leave
    deadline = time.monotonic() + 20
    while (metric(cluster["p"], "xlserve_kv_pins") or metric(cluster["d"], "xlserve_num_requests_running")) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(cluster["p"], "xlserve_kv_pins") == 0 and metric(cluster["p"], "xlserve_kv_blocks_used") == 0
    assert recomputed() == before
    assert metric_value(cluster["d"], "xlserve_kv_pulls_total", outcome="pulled") > pulled
