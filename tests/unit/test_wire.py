"""Messages between processes: every message type round-trips; SamplingParams has one
wire form, generated from the class, and every field arrives intact; unknown fields and
loose types are refused."""

import dataclasses
import json

import pytest

from xlserve.engine.request import FinishReason
from xlserve.sampling_params import GuidedSpec, SamplingParams
from xlserve.worker.messages import (
    GenerateRequest,
    GenerateResult,
    KVHandle,
    KVPeers,
    KVRelease,
    LogprobEntry,
    PullReport,
    StreamEvent,
)

# One non-default value per field. A field added to SamplingParams fails
# test_every_field_travels until it is listed here, and so proven to travel.
NON_DEFAULT = {
    "max_tokens": 77, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 2**63 + 5,
    "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.3, "stop": ("END", "\n\n"),
    "stop_token_ids": (7, 9), "ignore_eos": True, "logprobs": 3, "include_stop_str_in_output": True,
    "skip_special_tokens": False, "guided": GuidedSpec("regex", "[a-z]+"), "logit_bias": ((5, 100.0), (9, -2.5)),
    "priority": -3,
}


def test_every_field_travels():
    assert set(NON_DEFAULT) == {f.name for f in dataclasses.fields(SamplingParams)}
    defaults = SamplingParams()
    for name, value in NON_DEFAULT.items():
        params = SamplingParams(**{name: value})
        assert getattr(params, name) != getattr(defaults, name), name
        body = json.dumps({"prompt_token_ids": [1, 2], "sampling": params.to_wire()})
        assert GenerateRequest.model_validate_json(body).sampling == params, name
        assert SamplingParams.from_wire(json.loads(json.dumps(params.to_wire()))) == params, name
    everything = SamplingParams(**NON_DEFAULT)
    assert SamplingParams.from_wire(everything.to_wire()) == everything


@pytest.mark.parametrize("change", [{"surprise": 1}, {"temperature": "0.5"}, {"max_tokens": True},
                                    {"top_p": 2.0}, {"stop": "END"}, {"guided": {"kind": "x", "spec": "y"}},
                                    {"logit_bias": [[5, 1000]]}])
def test_unknown_fields_and_loose_types_are_refused(change):
    wire = {**SamplingParams().to_wire(), **change}
    with pytest.raises(ValueError):
        SamplingParams.from_wire(wire)
    with pytest.raises(ValueError):
        GenerateRequest.model_validate_json(json.dumps({"prompt_token_ids": [1], "sampling": wire}))
    with pytest.raises(ValueError):
        GenerateRequest.model_validate_json(json.dumps({"prompt_token_ids": [1], "kv_handle": {}}))


HANDLE = KVHandle(transport="tcp", host="127.0.0.1", port=4242, pin_id="p" * 32, secret="s" * 32,
                  block_hashes=["00ff" * 4])
REPORT = PullReport(blocks=3, bytes=4096, seconds=0.01)
EXAMPLES = [
    HANDLE, REPORT, KVRelease(pin_id="p" * 32), KVPeers(peers=[{"host": "127.0.0.1", "port": 1}]),
    GenerateRequest(prompt_token_ids=[1, 2], sampling=SamplingParams(**NON_DEFAULT), stream=True,
                    kv_import=HANDLE, resume_token_ids=[7], on_pull_failure="fail"),
    GenerateResult(request_id="r", token_ids=[5], text="Hi", finish_reason=FinishReason.PAUSED, prompt_tokens=2,
                   cached_tokens=0, logprobs=[LogprobEntry(token_id=5, logprob=-0.1, top=[(5, -0.1)])], kv=HANDLE),
    StreamEvent(token_ids=[6], text=" there and back", finish_reason=FinishReason.STOP, prompt_tokens=2,
                cached_tokens=16, kv_import=REPORT),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_type_round_trips_and_refuses_unknown_fields(message):
    cls = type(message)
    assert cls.model_validate_json(message.model_dump_json()) == message
    with pytest.raises(ValueError):
        cls.model_validate_json(json.dumps({**message.model_dump(mode="json"), "surprise": 1}))


@pytest.mark.parametrize("message", [m for m in EXAMPLES if not isinstance(m, PullReport)],
                         ids=lambda m: type(m).__name__)
def test_parsing_keeps_no_string_value_alive(message):
    """pydantic-core caches the strings it parses unless told not to; a message's values
    (block hashes, pin ids, secrets) never repeat, so each parse must build its own."""
    body = message.model_dump_json()
    first, second = type(message).model_validate_json(body), type(message).model_validate_json(body)
    # long values only: a Literal field's value ("fail") is the schema's own string
    strings = [(a, b) for a, b in zip(_strings(first), _strings(second)) if len(a) > 8]
    assert strings and not [a for a, b in strings if a is b]


def _strings(model) -> list[str]:
    """Every string value of a parsed message, depth first."""
    out = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, str) and not isinstance(v, FinishReason):
                out.append(v)
            elif hasattr(type(v), "model_fields"):
                out += _strings(v)
    return out
