"""Compiled grammars kept across requests (``engine/guided.py``): each request's matcher is a
copy that starts at the grammar's start whatever earlier requests did, a grammar that failed
validation fails again, and the store keeps the most recently used grammars, a bounded number."""

import pytest
from llguidance import LLMatcher

from xlserve.engine import guided as guided_module
from xlserve.engine.guided import GuidedDecoding
from xlserve.loader.tokenizer import load_model_tokenizer
from xlserve.sampling_params import GuidedSpec

REGEX = GuidedSpec("regex", "(cat|dog) says hello[0-9]+")


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_tokenizer("default")


@pytest.fixture
def guided(tokenizer):
    return GuidedDecoding(tokenizer, tokenizer.vocab_size)


def test_each_request_starts_at_the_grammar_start_whatever_the_last_one_consumed(guided, tokenizer):
    fresh = LLMatcher(guided._ll_tokenizer(), guided.grammar(REGEX)).compute_bitmask()
    guided.validate(REGEX)
    first = guided.matcher(REGEX)
    assert first.compute_bitmask() == fresh
    assert first.consume_tokens(tokenizer.encode("dog says"))
    assert first.compute_bitmask() != fresh
    second = guided.matcher(REGEX)  # the kept compiled grammar, copied again
    assert second.compute_bitmask() == fresh
    assert second.consume_tokens(tokenizer.encode("cat"))
    assert first.compute_bitmask() != second.compute_bitmask()  # two requests, two states


def test_a_grammar_that_fails_validation_fails_every_time(guided):
    bad = GuidedSpec("regex", "(unclosed")
    empty = GuidedSpec("json_schema", '{"$ref": "#"}')  # compiles, admits no value
    guided.matcher(empty)  # compiled and kept without validation: that must not pass it
    for _ in range(2):
        with pytest.raises(ValueError, match="does not compile"):
            guided.validate(bad)
        with pytest.raises(ValueError, match="admits no JSON value"):
            guided.validate(empty)


def test_the_store_keeps_the_most_recently_used_grammars_up_to_its_bound(guided, monkeypatch):
    monkeypatch.setattr(guided_module, "COMPILED_GRAMMARS", 3)
    specs = [GuidedSpec("regex", f"item {i}[a-z]+") for i in range(5)]
    for spec in specs[:3]:
        guided.validate(spec)
    guided.matcher(specs[0])  # used again: the most recent
    for spec in specs[3:]:
        guided.validate(spec)
    kept = set(guided._compiled)
    assert len(kept) == 3
    assert {guided.grammar(s) for s in (specs[0], specs[3], specs[4])} == kept
