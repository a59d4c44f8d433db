"""Foreign backends without servers: worker URLs, pool rules, request bodies, index aging,
answer rewriting."""

import asyncio

import pytest

from xlserve.openai.pricing import PriceTable
from xlserve.router.backend import Answer, BackendKind, ForeignCall, cached_tokens_of, parse_worker_address
from xlserve.router.backend_probe import BackendInfo
from xlserve.router.foreign_backends import for_server
from xlserve.router.index import PrefixIndex
from xlserve.router.pool import Worker, WorkerPool
from xlserve.router.relay import Relay


def test_worker_urls_name_their_kind_by_prefix():
    assert parse_worker_address("http://127.0.0.1:8000/").kind is BackendKind.XLSERVE
    openai = parse_worker_address("openai+http://127.0.0.1:8080")
    assert (openai.kind, openai.url) == (BackendKind.OPENAI, "http://127.0.0.1:8080")
    sglang = parse_worker_address("sglang-pd+http://10.0.0.2:30000?bootstrap_port=9000")
    assert sglang.kind is BackendKind.SGLANG_PD and sglang.option("bootstrap_port") == "9000"
    assert sglang.url == "http://10.0.0.2:30000"
    with pytest.raises(ValueError, match="vllm-pd"):
        parse_worker_address("tgi+http://h:1")
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_worker_address("openai+ftp://h:1")


def test_pool_refuses_roles_a_kind_cannot_take_and_kinds_missing_a_stage():
    with pytest.raises(ValueError, match="--both, not --prefill"):
        WorkerPool(["openai+http://h:1"], ["http://h:2"], [])
    with pytest.raises(ValueError, match="vllm-pd worker for each stage"):
        WorkerPool(["vllm-pd+http://h:1"], ["http://h:2"], [])
    pool = WorkerPool(["vllm-pd+http://h:1", "http://h:3"], ["vllm-pd+http://h:2"], ["openai+http://h:4", "http://h:5"])
    assert [w.url for w in pool.candidates("prefill")] == ["http://h:3", "http://h:5"]  # the token path: xlserve only
    assert len(pool.candidates("prefill", None)) == 4


def test_bodies_for_a_server_carry_its_model_and_usage_but_never_a_clients_hand_off_fields():
    call = ForeignCall("/v1/chat/completions", {
        "model": "default", "messages": [], "stream": True, "stream_options": {"continuous_usage_stats": True},
        "kv_transfer_params": {"remote_host": "10.9.9.9"}, "bootstrap_room": 1, "bootstrap_host": "10.9.9.9",
        "top_k": 5}, 3, "m")
    worker = Worker("http://h:1", "both", info=BackendInfo("served/model"))
    body = for_server(call, worker)
    assert body["model"] == "served/model" and body["top_k"] == 5  # other extras pass through
    assert not {"kv_transfer_params", "bootstrap_room", "bootstrap_host"} & body.keys()
    assert body["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert not call.client_wants_usage
    assert for_server(call, worker, bootstrap_room=7)["bootstrap_room"] == 7  # the router's own


def test_index_forgets_what_a_server_without_events_would_have_evicted():
    index = PrefixIndex(block_size=4)
    hashes = [bytes([i]) * 8 for i in range(6)]
    index.set_capacity("u", 4 * 4)  # four blocks
    index.record(hashes[:4], "u")
    assert index.cached_blocks(hashes[:4], ["u"])["u"] == 4
    index.record(hashes[4:], "u")  # two more: the two oldest go
    assert index.cached_blocks(hashes, ["u"])["u"] == 0
    assert index.cached_blocks(hashes[2:], ["u"])["u"] == 4
    index.record(hashes[2:3], "u")  # used again: now the youngest
    index.record([b"x" * 8], "u")
    assert index.cached_blocks(hashes[2:3], ["u"])["u"] == 1 and index.cached_blocks(hashes[3:4], ["u"])["u"] == 0


async def _events(*events):
    for e in events:
        yield e


def _relay(body: dict, first: dict, rest: list, cached=None) -> tuple[list[str], list[int]]:
    ended: list[int] = []
    answer = Answer(first=first, rest=_events(*rest), cached_tokens=cached)
    relay = Relay(ForeignCall("/v1/chat/completions", body, 40, "router-name"), answer, PriceTable(), ended.append)

    async def run():
        return [line async for line in relay.events()]
    return asyncio.run(run()), ended


def test_relay_prices_usage_reports_the_servers_cache_and_drops_usage_the_client_did_not_ask_for():
    chunk = {"model": "file.gguf", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
    usage = {"model": "file.gguf", "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 2},
             "timings": {"cache_n": 30}}
    asked, ended = _relay({"stream": True, "stream_options": {"include_usage": True}}, dict(chunk), [dict(usage)])
    assert '"model": "router-name"' in asked[0] and asked[-1] == "data: [DONE]\n\n" and ended == [30]
    assert '"cached_tokens": 30' in asked[1] and '"cost"' in asked[1] and '"total_tokens": 42' in asked[1]
    not_asked, ended = _relay({"stream": True}, dict(chunk), [dict(usage)])
    assert len(not_asked) == 2 and "usage" not in not_asked[0] and ended == [30]
    # a disaggregated prefill's figure wins over what the decode server says
    _, ended = _relay({"stream": True}, dict(chunk), [dict(usage)], cached=12)
    assert ended == [12]


def test_cached_tokens_come_from_usage_or_llama_server_timings():
    assert cached_tokens_of({"usage": {"prompt_tokens_details": {"cached_tokens": 5}}}) == 5
    assert cached_tokens_of({"timings": {"cache_n": 7}}) == 7
    assert cached_tokens_of({"usage": {"prompt_tokens": 3}}) is None
