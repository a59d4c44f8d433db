"""Messages between processes: SamplingParams has one wire form, generated from the
class, and every field arrives intact; unknown fields and loose types are refused."""

import dataclasses
import json

import pytest

from xlserve.sampling_params import GuidedSpec, SamplingParams
from xlserve.worker.internal import InternalGenerateRequest

# One non-default value per field. A field added to SamplingParams fails
# test_every_field_travels until it is listed here, and so proven to travel.
NON_DEFAULT = {
    "max_tokens": 77, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 2**63 + 5,
    "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.3, "stop": ("END", "\n\n"),
    "stop_token_ids": (7, 9), "ignore_eos": True, "logprobs": 3, "include_stop_str_in_output": True,
    "skip_special_tokens": False, "guided": GuidedSpec("regex", "[a-z]+"), "logit_bias": ((5, 100.0), (9, -2.5)),
}


def test_every_field_travels():
    assert set(NON_DEFAULT) == {f.name for f in dataclasses.fields(SamplingParams)}
    defaults = SamplingParams()
    for name, value in NON_DEFAULT.items():
        params = SamplingParams(**{name: value})
        assert getattr(params, name) != getattr(defaults, name), name
        body = json.dumps({"prompt_token_ids": [1, 2], "sampling": params.to_wire()})
        assert InternalGenerateRequest.model_validate_json(body).sampling == params, name
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
        InternalGenerateRequest.model_validate_json(json.dumps({"prompt_token_ids": [1], "sampling": wire}))
    with pytest.raises(ValueError):
        InternalGenerateRequest.model_validate_json(json.dumps({"prompt_token_ids": [1], "kv_handle": {}}))
