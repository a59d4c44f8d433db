"""Speculative decoding in the served product (the default model in its default
configuration, greedy): a worker and a prefill/decode pair with ``--speculative`` answer
exactly as a plain worker, streamed tool calls included (a step that emits several tokens
streams them as one delta; the call's grammar checks each proposal), and /metrics counts
the proposed and accepted tokens."""

import json

import pytest
from openai import OpenAI

from tests.e2e.server_process import metric, running_server, workers_by_role
from tests.e2e.test_server import WEATHER_Q, WEATHER_TOOL

COMMON = ("--log-level", "warning")
CHATS = [[{"role": "user", "content": "Repeat exactly: red, green, blue, red, green, blue, red, green, blue"}],
         [{"role": "user", "content": "Write a haiku about the sea."}]]


def _answers(url: str) -> list:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    chats = [client.chat.completions.create(model=model, messages=m, max_tokens=40, temperature=0, logprobs=True)
             .choices[0] for m in CHATS]
    out = [(c.message.content, [t.logprob for t in c.logprobs.content]) for c in chats]
    # required: the call is grammar-constrained, and the grammar checks each proposal too
    call = dict(model=model, messages=WEATHER_Q, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=60,
                temperature=0)
    whole = client.chat.completions.create(**call).choices[0].message
    arguments, names = "", []
    for chunk in client.chat.completions.create(**call, stream=True):
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names += [d.function.name] if d.function.name else []
            arguments += d.function.arguments or ""
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls or []]
    assert calls and calls[0][0] == "get_weather"
    assert names == [name for name, _ in calls]  # streamed as they were parsed whole
    assert (json.loads(arguments) if arguments else None) == (calls[0][1] if calls else None)
    return out + [whole.content, calls]


def _answer_as(reference: list, url: str) -> None:
    """The same chats, tool call and text, and each chat token's logprob within 1e-4 of the
    plain worker's (the same bits measured in bfloat16; the room is for float32, the default
    of CPUs without AVX512-BF16, where a prefix hit alone moves a logprob by ~2e-7)."""
    answers = _answers(url)
    assert [a[0] for a in answers[:2]] + answers[2:] == [r[0] for r in reference[:2]] + reference[2:]
    assert max(abs(a - b) for (_, mine), (_, theirs) in zip(answers[:2], reference[:2])
               for a, b in zip(mine, theirs)) < 1e-4


@pytest.fixture(scope="module")
def reference() -> list:
    with running_server(*COMMON) as plain:
        return _answers(plain)


def test_a_speculating_worker_answers_as_a_plain_one(reference):
    with running_server(*COMMON, "--speculative", "suffix") as url:
        _answer_as(reference, url)
        assert metric(url, "xlserve_spec_decode_accepted_tokens_total") > 0
        proposed = metric(url, "xlserve_spec_decode_proposed_tokens_total")
        assert proposed >= metric(url, "xlserve_spec_decode_accepted_tokens_total")
        assert metric(url, "xlserve_spec_decode_acceptance_length_count") > 0


def test_a_speculating_decode_worker_answers_as_a_plain_worker(reference):
    """The decode worker rebuilds what the n-gram proposer needs from the handed-off tokens."""
    with running_server(*COMMON, "--speculative", "ngram", command="serve") as url:
        _answer_as(reference, url)
        assert _decode_worker_accepted(url) > 0


def test_an_eagle_decode_worker_answers_as_a_plain_worker(reference):
    """The EAGLE head shipped for the default model proposes on the decode worker (its cache
    of the head's keys starts at the hand-off) and on the prefill worker's first token."""
    with running_server(*COMMON, "--speculative", "eagle", command="serve") as url:
        _answer_as(reference, url)
        assert _decode_worker_accepted(url) > 0


def test_a_draft_model_decode_worker_answers_as_a_plain_worker(reference):
    """The draft model (the default model as its own draft) keeps its own paged KV: on the
    decode worker it computes the handed-off prompt's draft KV before its first guesses."""
    with running_server(*COMMON, "--speculative", "draft", "--draft-model", "default", command="serve") as url:
        _answer_as(reference, url)
        assert _decode_worker_accepted(url) > 0


def _decode_worker_accepted(url: str) -> float:
    """Proposals the decode worker behind ``serve``'s router accepted: it speculated itself."""
    return metric(workers_by_role(url)["decode"], "xlserve_spec_decode_accepted_tokens_total")
