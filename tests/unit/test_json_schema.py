"""Object schemas are closed unless they say otherwise (``xlserve/json_schema.py``), as llama.cpp,
XGrammar and Outlines read them; and a grammar built from one admits no other key."""

import json

from xlserve.json_schema import closed_objects

PATH = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


def test_objects_that_list_properties_are_closed_where_they_say_nothing_of_others():
    schema = {"type": "object", "properties": {
        "file": PATH,  # nested: closed too
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},  # a property so named
        "tags": {"type": "array", "items": PATH},
        "extra": {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}},
        "free": {"type": "object"},  # no properties listed: any object
        "either": {"anyOf": [PATH, {"type": "string"}]},
        "both": {"allOf": [PATH, {"properties": {"mode": {"type": "string"}}}]},
        "more": {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]},  # requires an unlisted key
    }, "$defs": {"p": PATH}}
    closed = closed_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False and closed["$defs"]["p"]["additionalProperties"] is False
    assert props["file"]["additionalProperties"] is False and props["tags"]["items"]["additionalProperties"] is False
    assert props["properties"]["additionalProperties"] is False and "additionalProperties" not in props["properties"][
        "properties"]  # the name "properties" is a property, not a schema word
    assert props["extra"]["additionalProperties"] == {"type": "string"}  # said: kept
    assert "additionalProperties" not in props["free"]
    assert props["either"]["anyOf"][0]["additionalProperties"] is False  # an alternative is a whole object
    assert all("additionalProperties" not in part for part in props["both"]["allOf"])  # parts add up: left open
    assert "additionalProperties" not in props["more"]  # closed, it would admit nothing
    assert schema["properties"]["file"] == PATH and "additionalProperties" not in schema  # a copy; the input unchanged
    assert closed_objects(True) is True and closed_objects({"type": "string"}) == {"type": "string"}


def test_the_grammar_of_a_closed_object_ends_it_after_its_only_property():
    from llguidance import LLMatcher

    from xlserve.engine.guided import GuidedDecoding
    from xlserve.loader.tokenizer import load_model_tokenizer
    from xlserve.sampling_params import GuidedSpec
    tokenizer = load_model_tokenizer("default")
    guided = GuidedDecoding(tokenizer, tokenizer.vocab_size)
    for schema, other_key in ((PATH, False), ({**PATH, "additionalProperties": True}, True)):
        matcher = LLMatcher(guided._ll_tokenizer(), guided.grammar(GuidedSpec("json_schema", json.dumps(schema))))
        assert matcher.consume_tokens(tokenizer.encode('{"path": "a.txt"')), matcher.get_error()
        allowed = guided.allowed(matcher)
        assert allowed[tokenizer.encode("}")[0]]
        assert bool(allowed[tokenizer.encode(",")[0]]) is other_key
