"""Every tool-call format on recorded model outputs, whole and streamed: in one delta
(several calls in it), split in two at every character, and character by character.
Streamed pieces must add up to the whole parse, the first piece of a call carries its
name, and arguments arrive before the call is over."""

import json

import pytest

from xlserve.openai.tool_parsers import TOOL_PARSERS, ToolCallStream, detect_tool_parser, get_tool_parser

WEATHER = {"city": "Paris", "days": [1, 2], "note": "say \"hi\" {ok}"}
TIME = {"tz": "CET"}
NOTE_JSON = json.dumps(WEATHER, ensure_ascii=False)
KIMI = ("I will check both.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        f"<|tool_call_argument_begin|>{NOTE_JSON}<|tool_call_end|><|tool_call_begin|>functions.get_time:1"
        '<|tool_call_argument_begin|>{"tz": "CET"}<|tool_call_end|><|tool_calls_section_end|>')
DEEPSEEK_V3 = ("I will check both.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
               f"```json\n{NOTE_JSON}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
               '```json\n{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DEEPSEEK_V31 = ("I will check both.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                f'{NOTE_JSON}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{{"tz": "CET"}}'
                "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
HERMES = (f'I will check both.\n<tool_call>\n{{"name": "get_weather", "arguments": {NOTE_JSON}}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
MISTRAL = (f'I will check both.[TOOL_CALLS][{{"name": "get_weather", "arguments": {NOTE_JSON}}}, '
           '{"name": "get_time", "arguments": {"tz": "CET"}}]')
LLAMA3 = (f'<|python_tag|>{{"name": "get_weather", "parameters": {NOTE_JSON}}}; '
          '{"name": "get_time", "parameters": {"tz": "CET"}}')
PYTHONIC = ("[get_weather(city='Paris', days=[1, 2], note='say \"hi\" {ok}'), get_time(tz=\"CET\")]")
RECORDED = {"kimi_k2": (KIMI, "I will check both."), "deepseek_v3": (DEEPSEEK_V3, "I will check both."),
            "deepseek_v31": (DEEPSEEK_V31, "I will check both."), "hermes": (HERMES, "I will check both."),
            "mistral": (MISTRAL, "I will check both."), "llama3_json": (LLAMA3, None), "pythonic": (PYTHONIC, None)}
EXPECTED_CALLS = [("get_weather", WEATHER), ("get_time", TIME)]


def _stream(name, pieces):
    """Feed ``pieces``; return (content, calls as (name, arguments text), per-call delta lists)."""
    stream = ToolCallStream(get_tool_parser(name))
    content, calls, deltas = "", {}, {}
    for i, piece in enumerate(pieces):
        out = stream.feed(piece, final=i == len(pieces) - 1)
        content += out.content
        for d in out.calls:
            wire = d.to_openai()
            if d.index not in calls:
                assert wire["function"]["name"] and wire["id"], "a call's first delta names it"
                calls[d.index] = [wire["function"]["name"], ""]
            else:
                assert "name" not in wire["function"]
            calls[d.index][1] += wire["function"]["arguments"]
            deltas.setdefault(d.index, []).append((i, wire["function"]["arguments"]))
    return content, [tuple(c) for _, c in sorted(calls.items())], deltas


def _check(name, content, calls, expected_content):
    assert (content.strip() or None) == expected_content
    assert [(n, json.loads(args)) for n, args in calls] == EXPECTED_CALLS


def test_every_registered_format_has_a_recording():
    assert set(RECORDED) == set(TOOL_PARSERS)


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_whole_output_and_one_delta_with_several_calls(name):
    text, expected_content = RECORDED[name]
    content, parsed = get_tool_parser(name).parse(text)
    assert content == expected_content
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == EXPECTED_CALLS
    assert len({c.id for c in parsed}) == 2
    streamed, calls, _ = _stream(name, [text])
    _check(name, streamed, calls, expected_content)
    assert calls == [(c.name, c.arguments) for c in parsed]  # streamed == whole, to the character


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_split_in_two_at_every_character(name):
    text, expected_content = RECORDED[name]
    for cut in range(1, len(text)):
        content, calls, _ = _stream(name, [text[:cut], text[cut:]])
        _check(name, content, calls, expected_content)


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_character_by_character_arguments_arrive_before_the_call_ends(name):
    text, expected_content = RECORDED[name]
    content, calls, deltas = _stream(name, list(text))
    _check(name, content, calls, expected_content)
    first_call = [i for i, piece in deltas[0] if piece]
    assert len(first_call) > 1  # the arguments came in several pieces, not at the end
    assert min(i for i, _ in deltas[0]) < max(i for i, _ in deltas[0])


def test_kimi_k2_keeps_the_models_call_ids():
    _, calls = get_tool_parser("kimi_k2").parse(KIMI)
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]


@pytest.mark.parametrize("name,text", [
    ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{broken"}\n</tool_call>'),
    ("hermes", "plain answer with a < sign and <tool_c but no call"),
    ("llama3_json", '{"answer": 42}'),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[not a call"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>no id here<|tool_call_argument_begin|>{}"),
    ("mistral", "no calls [TOOL_CALLS"),
])
def test_text_that_is_no_call_is_content(name, text):
    content, calls = get_tool_parser(name).parse(text)
    assert calls == [] and content == text.strip()
    for size in (1, 3):
        streamed, scalls, _ = _stream(name, [text[i:i + size] for i in range(0, len(text), size)])
        assert scalls == [] and streamed.strip() == text.strip()


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_a_call_cut_short_leaks_no_markup_into_content(name):
    text, expected_content = RECORDED[name]
    cut = text.index("Paris") + 3  # max_tokens ends the output inside the first call's arguments
    content, calls = get_tool_parser(name).parse(text[:cut])
    assert content == expected_content and [c.name for c in calls] == ["get_weather"]
    assert calls[0].arguments.startswith("{")
    assert "Par" in calls[0].arguments or name == "pythonic"  # pythonic sends a keyword once it is whole


@pytest.mark.parametrize("name", ["hermes", "kimi_k2", "deepseek_v3", "deepseek_v31", "mistral"])
def test_a_call_cut_before_its_name_is_whole_is_dropped_not_content(name):
    text, expected_content = RECORDED[name]
    cut = text.index("get_weather") + 3
    content, calls = get_tool_parser(name).parse(text[:cut])
    assert content == expected_content and calls == []


def test_the_format_is_detected_from_the_chat_template():
    assert detect_tool_parser("{{ '<|tool_calls_section_begin|><|tool_call_begin|>' }}") == "kimi_k2"
    assert detect_tool_parser("<｜tool▁call▁begin｜>{{ name }}\n```json\n") == "deepseek_v3"
    assert detect_tool_parser("<｜tool▁call▁begin｜>{{ name }}<｜tool▁sep｜>") == "deepseek_v31"
    assert detect_tool_parser("[TOOL_CALLS]") == "mistral"
    assert detect_tool_parser("{{- '<|python_tag|>' }}") == "llama3_json"
    assert detect_tool_parser("[func_name1(params_name1=params_value1)]") == "pythonic"
    assert detect_tool_parser("<|im_start|>") == "hermes"


def test_forced_grammar_names_only_the_chosen_tool():
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "b"}}]
    for name in ("hermes", "mistral", "llama3_json", "kimi_k2", "deepseek_v3", "deepseek_v31"):
        spec = get_tool_parser(name).forced_call_grammar(tools, "b", parallel=True)
        assert spec.kind == "lark" and '\\"b\\"' in spec.spec or "b" in spec.spec
        assert "\\\"a\\\"" not in spec.spec and "functions.a:" not in spec.spec
    with pytest.raises(ValueError, match="not among the tools"):
        get_tool_parser("hermes").forced_call_grammar(tools, "zzz", parallel=False)
    with pytest.raises(ValueError, match="not available with the pythonic"):
        get_tool_parser("pythonic").forced_call_grammar(tools, None, parallel=False)
    with pytest.raises(ValueError, match="unknown"):
        get_tool_parser("nope")


@pytest.mark.parametrize("name", ["kimi_k2", "deepseek_v31"])
def test_a_forced_call_names_the_special_markers_by_token_id(name):
    """The model emits Kimi's and DeepSeek's markers as single special tokens; the grammar
    of a forced call must allow exactly those tokens, not the marker spelled out."""
    from xlserve.engine.guided import GuidedDecoding
    from xlserve.loader.tokenizer import load_model_tokenizer
    tokenizer = load_model_tokenizer("default")
    plain = get_tool_parser(name)
    tokenizer.backend.add_special_tokens([plain.section, plain.call, plain.args, plain.end, plain.section_end])
    ids = tokenizer.special_token_ids
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    spec = get_tool_parser(name, ids).forced_call_grammar(tools, "get_weather", parallel=True)
    assert f"<[{ids[plain.call]}]>" in spec.spec and plain.call not in spec.spec
    guided = GuidedDecoding(tokenizer, tokenizer.backend.get_vocab_size(with_added_tokens=True))
    guided.validate(spec)
    first = guided.allowed(guided.matcher(spec)).nonzero().flatten().tolist()
    assert first == [ids[plain.section]]


def test_forced_arguments_are_laid_out_as_the_prompt_shows_calls():
    """A forced call's arguments take json.dumps' separators, the layout the conversation
    renders earlier calls in (``openai/conversation.py``), and no other whitespace."""
    from xlserve.engine.guided import GuidedDecoding
    from xlserve.loader.tokenizer import load_model_tokenizer
    tokenizer = load_model_tokenizer("default")
    guided = GuidedDecoding(tokenizer, tokenizer.vocab_size)
    tools = [{"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"src": {"type": "string"}, "dst": {"type": "string"}}}}}]
    spec = get_tool_parser("hermes").forced_call_grammar(tools, None, parallel=False)
    arguments = {"src": "a.txt", "dst": "b.txt"}
    for layout, admitted in ((json.dumps(arguments), True), (json.dumps(arguments, separators=(",", ":")), False),
                             (json.dumps(arguments, indent=1), False)):
        call = '<tool_call>\n{"name": "move", "arguments": ' + layout + '}\n</tool_call>'
        ids = tokenizer.encode(call)
        assert (guided.matcher(spec).try_consume_tokens(ids) == len(ids)) is admitted, layout
