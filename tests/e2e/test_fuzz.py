"""Schema-driven fuzzing of real servers: schemathesis reads each server's own
``/openapi.json`` and sends what it generates from it, valid and invalid, to every route of
a worker (the internal disaggregation routes included) and of ``xlserve serve``'s router.
No answer may be a 5xx, every error carries the OpenAI error body, no request takes longer
than its bound, and afterwards the servers still serve with no request or KV block left
behind.

``XLSERVE_FUZZ_EXAMPLES`` sets the examples per server and mode: a few in CI, hundreds under
``make fuzz``.
"""

import json
import os
import time
from collections import Counter

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.e2e.server_process import PROCESSES, metric, running_server

EXAMPLES = int(os.environ.get("XLSERVE_FUZZ_EXAMPLES", "60"))  # per target and mode, over all routes
# A generated request may ask for 16 choices of as many tokens as fit: --max-model-len bounds
# the work, and a request past this many seconds counts as hung.
MAX_MODEL_LEN = "128"
REQUEST_TIMEOUT_S = 60.0
QUIET = ("--log-level", "warning")
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def targets():
    with running_server("--role", "prefill", "--max-model-len", MAX_MODEL_LEN, "--kv-pin-seconds", "5",
                        *QUIET) as worker, \
            running_server("--max-model-len", MAX_MODEL_LEN, *QUIET, command="serve") as serve:
        pids = {url: PROCESSES[url].pid for url in (worker, serve)}
        yield {"worker": worker, "serve": serve, "pids": pids}


def openai_error_body(ctx, response, case):
    """Every 4xx and 5xx answer is ``{"error": {"message", "type", "param", "code"}}``."""
    if response.status_code < 400:
        return None
    error = response.json().get("error")
    assert isinstance(error, dict) and error.get("message") and error.get("type"), response.text[:300]
    return None


TRIED: Counter = Counter()  # (target, mode, status) -> cases, printed at the end


def _check(case, tally: tuple) -> None:
    started = time.monotonic()
    response = case.call(timeout=REQUEST_TIMEOUT_S)
    TRIED[(*tally, response.status_code)] += 1
    assert time.monotonic() - started < REQUEST_TIMEOUT_S
    case.validate_response(response, checks=[not_a_server_error, openai_error_body])


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("target", ["worker", "serve"])
def test_fuzzing_finds_no_server_error(targets, target, mode):
    """Cases over every route of the target's own document: valid bodies (positive) and
    bodies that break the schema (negative)."""
    schema = schemathesis.openapi.from_url(f"{targets[target]}/openapi.json")

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        _check(case, (target, mode.value))
    fuzz()


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
NESTED = 100_000  # deeper than any JSON parser's recursion limit
HOSTILE = {
    "a 10 MB body": b'{"messages": [{"role": "user", "content": "' + b"a" * 10_000_000 + b'"}]}',
    "nesting 100,000 deep": b'{"messages": ' + b"[" * NESTED + b"]" * NESTED + b"}",
    "broken UTF-8": b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}',
    "a huge n": json.dumps({**CHAT, "n": 10**9}).encode(),
    "a huge max_tokens": json.dumps({**CHAT, "max_tokens": 10**18}).encode(),
    "a huge top_logprobs": json.dumps({**CHAT, "logprobs": True, "top_logprobs": 10**6}).encode(),
    "a number past float64": json.dumps(CHAT).replace('"max_tokens": 4', '"temperature": 1e999').encode(),
    "a JSON schema that admits nothing": json.dumps({**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}).encode(),
}


@pytest.mark.parametrize("target", ["worker", "serve"])
@pytest.mark.parametrize("hostile", sorted(HOSTILE))
def test_a_hostile_body_is_a_4xx_in_the_openai_shape(targets, target, hostile):
    r = httpx.post(f"{targets[target]}/v1/chat/completions", content=HOSTILE[hostile],
                   headers={"content-type": "application/json"}, timeout=REQUEST_TIMEOUT_S)
    assert 400 <= r.status_code < 500, r.text[:300]
    assert r.json()["error"]["message"]


def test_after_the_fuzzing_every_server_serves_and_holds_nothing(targets):
    for key in sorted({k[:2] for k in TRIED}):
        statuses = {status: n for (*k, status), n in sorted(TRIED.items()) if tuple(k) == key}
        print(f"fuzzed {key[0]} ({key[1]}): {sum(statuses.values())} cases, answered {statuses}")
    for url, pid in targets["pids"].items():
        assert PROCESSES[url].pid == pid and PROCESSES[url].poll() is None  # none died or restarted
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert ok.choices[0].finish_reason in ("stop", "length")
    worker = targets["worker"]
    deadline = time.monotonic() + 30  # the fuzzed kv_export requests' pins last 5 s
    def held():
        return metric(worker, "xlserve_kv_pins") or metric(worker, "xlserve_kv_blocks_used")
    while time.monotonic() < deadline and held():
        time.sleep(0.5)
    assert metric(worker, "xlserve_kv_pins") == 0 and metric(worker, "xlserve_kv_blocks_used") == 0
    assert metric(worker, "xlserve_num_requests_running") == 0 and metric(worker, "xlserve_num_requests_waiting") == 0
    assert httpx.get(f"{targets['serve']}/ready", timeout=10).status_code == 200
