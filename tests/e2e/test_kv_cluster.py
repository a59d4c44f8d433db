"""The cluster KV tier with real processes: a Mooncake store ('xlserve kvstore'), two colocated
workers with --kv-tiers host,mooncake behind a round_robin router. A prefix one worker computed
is a hit on the other; a master killed mid-load or down at start never fails a request."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from tests.e2e.server_process import free_port, metric, running_server, stop
from xlserve.config import KVStoreConfig
from xlserve.kvstore.master import spawn_kvstore
from xlserve.launcher import free_ports

try:
    import mooncake.store  # noqa: F401
except ImportError as e:  # the package or its system library (libibverbs1) is missing
    pytest.skip(f"Mooncake cannot run here: {e}", allow_module_level=True)

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = "You are the build assistant of a large monorepo. Rules: " + " ".join(
    f"rule {i}: keep module {i} free of cycles and document its public API." for i in range(40))
COMMON = ("--dtype", "float32", "--log-level", "warning")
DEADLINE_S = 60  # no request may take longer, whatever the store does


def _kvstore(port: int) -> subprocess.Popen:
    return spawn_kvstore(KVStoreConfig(port=port, gib=0.5, log_level="warning"))


def _store_port() -> int:
    return free_ports(3)  # the master takes port, port + 1 (metadata) and port + 2 (metrics)


@pytest.fixture(scope="module")
def cluster():
    port = _store_port()
    store = _kvstore(port)
    tiers = ("--kv-tiers", "host,mooncake", "--kv-host-gib", "0.25", "--kv-store-address", f"127.0.0.1:{port}")
    try:
        with running_server(*COMMON, *tiers) as a, running_server(*COMMON, *tiers) as b, \
                running_server("--both", a, b, "--policy", "round_robin", "--no-affinity", "--log-level", "warning",
                               command="router") as router:
            for url in (a, b):
                _wait_for(lambda u=url: _tier_metric(u, "xlserve_kv_tier_enabled") == 1, "the tier to connect")
            yield {"store": store, "port": port, "a": a, "b": b, "router": router}
    finally:
        stop(store)


def _tier_metric(url: str, name: str, tier: str = "mooncake") -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'{name}{{tier="{tier}"}}') or line.startswith(f'{name}_total{{tier="{tier}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def _wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        time.sleep(0.2)


def _writes_done(*urls) -> None:
    """Until the workers have stored what they queued (a write-through lands after the answer)."""
    def done():
        return all(float(line.rsplit(" ", 1)[1]) == 0 for url in urls
                   for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
                   if line.startswith("xlserve_kv_tier_pending_write_bytes "))
    _wait_for(done, "queued tier writes to land")


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)


def _ask(url, question: str, max_tokens: int = 12, context: str = CONTEXT):
    messages = [{"role": "system", "content": context}, {"role": "user", "content": question}]
    raw = _client(url).chat.completions.with_raw_response.create(model=MODEL, messages=messages,
                                                                 max_tokens=max_tokens, temperature=0)
    return raw.parse(), raw.headers.get("x-xlserve-served-by", url).split("=", 1)[-1]  # "both=URL"


def test_a_prefix_computed_on_one_worker_is_a_hit_on_the_other(cluster):
    first, first_by = _ask(cluster["router"], "Which module may import module 7?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    _writes_done(cluster["a"], cluster["b"])
    assert _tier_metric(first_by, "xlserve_kv_tier_written_bytes") > 0
    second, second_by = _ask(cluster["router"], "Which module may import module 7?")
    assert second_by != first_by  # round_robin: the other worker
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * first.usage.prompt_tokens
    assert second.choices[0].message.content == first.choices[0].message.content
    assert _tier_metric(second_by, "xlserve_kv_tier_hit_blocks") > 0
    workers = httpx.get(f"{cluster['router']}/router/workers").json()
    assert all("mooncake" in w["kv_tiers"]["tiers"] for w in workers)


def _masters(store: subprocess.Popen) -> list[psutil.Process]:
    return [c for c in psutil.Process(store.pid).children() if "mooncake_master" in c.name()]


def _master(store: subprocess.Popen) -> psutil.Process:
    children = _masters(store)
    assert len(children) == 1
    return children[0]


def _restarted(store: subprocess.Popen, killed: psutil.Process) -> bool:
    """A new master runs (between the kill and kvstore's restart there is none, for its backoff)."""
    try:
        return any(c.pid != killed.pid and c.status() != psutil.STATUS_ZOMBIE for c in _masters(store))
    except psutil.NoSuchProcess:  # a child that went between listing and asking
        return False


def test_killing_the_master_mid_load_fails_no_request(cluster):
    master = _master(cluster["store"])
    questions = [f"Summarize rule {i} in five words." for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_ask, cluster["router"], q) for q in questions]
        time.sleep(1.0)
        master.send_signal(signal.SIGKILL)  # mid-load: requests are running on both workers
        started = time.monotonic()
        answers = [f.result(timeout=DEADLINE_S) for f in futures]
    assert all(a.choices[0].finish_reason in ("stop", "length") for a, _ in answers)
    assert time.monotonic() - started < DEADLINE_S
    # kvstore restarts its master; the workers' clients reconnect and sharing comes back
    _wait_for(lambda: _restarted(cluster["store"], master), "the master to be restarted")
    attempts = iter(range(1000))

    def shared_again():  # a context neither worker has seen: a hit on the second is the cluster's
        context = f"Attempt {next(attempts)}. {CONTEXT}"
        first, _ = _ask(cluster["router"], "Which rule is first?", context=context)
        _writes_done(cluster["a"], cluster["b"])
        second, _ = _ask(cluster["router"], "Which rule is first?", context=context)
        return second.usage.prompt_tokens_details.cached_tokens >= 0.9 * first.usage.prompt_tokens
    _wait_for(shared_again, "the cluster tier to serve hits again", timeout=60)


def test_a_worker_whose_master_is_down_at_start_serves_and_joins_when_it_comes_up():
    port = _store_port()
    tiers = ("--kv-tiers", "mooncake", "--kv-store-address", f"127.0.0.1:{port}")
    with running_server(*COMMON, *tiers) as url:
        started = time.monotonic()
        answer, _ = _ask(url, "Is anyone there?")
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert time.monotonic() - started < DEADLINE_S
        assert _tier_metric(url, "xlserve_kv_tier_enabled") == 0
        store = _kvstore(port)
        try:
            _wait_for(lambda: _tier_metric(url, "xlserve_kv_tier_enabled") == 1, "the tier to connect", timeout=30)
        finally:
            stop(store)
    assert not [p for p in psutil.process_iter(["name"]) if p.info["name"] == "mooncake_master"
                and p.ppid() == os.getpid()]


def test_serve_with_its_own_store_hands_off_over_the_transfer_engine_and_ctrl_c_stops_all(cluster):
    """'xlserve serve --kv-tiers host,mooncake --kv-transport mooncake' without --kv-store-address:
    the stack starts a Mooncake store on loopback and its workers join it; the prefill ->
    decode hand-off reads the bytes through Mooncake's Transfer Engine and the answer equals
    a colocated worker's; Ctrl-C stops every process."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "xlserve.cli", "serve", "--port", str(port), "--dtype", "float32",
                             "--kv-tiers", "host,mooncake", "--kv-host-gib", "0.25", "--kv-transport", "mooncake",
                             "--log-level", "warning"], start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        from xlserve.launcher import wait_healthy
        wait_healthy([(proc, url)])
        stack = psutil.Process(proc.pid).children(recursive=True)
        assert len([p for p in stack if "mooncake_master" in p.name()]) == 1
        answer, _ = _ask(url, "Which rule is last?", max_tokens=16)
        colocated, _ = _ask(cluster["a"], "Which rule is last?", max_tokens=16)
        assert answer.choices[0].message.content == colocated.choices[0].message.content
        assert metric(url, "xlserve_kv_transfer_bytes_total") > 0
        assert metric(url, "xlserve_kv_transfer_failures_total") == 0
        # the store's master and metadata server listen on loopback only (the Mooncake clients'
        # own data ports do not take a bind address: see docs/operations.md)
        store = [p for p in stack if "mooncake_master" in p.name() or "mooncake.http_metadata_server" in p.cmdline()]
        listening = {(p.name(), c.laddr.ip, c.laddr.port) for p in store
                     for c in p.net_connections() if c.status == "LISTEN"}
        assert len(listening) == 3 and {ip for _, ip, _ in listening} == {"127.0.0.1"}, listening

        def joined():
            workers = httpx.get(f"{url}/router/workers").json()
            return all(w["kv_tiers"].get("tiers", {}).get("mooncake", {}).get("enabled") for w in workers)
        _wait_for(joined, "both workers to join the store")
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group, as in a terminal
        proc.wait(timeout=60)
    time.sleep(1)
    assert subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split() == []
