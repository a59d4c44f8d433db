"""The Responses API with the official openai client, as the Agents SDK uses it: text,
streamed events, a function tool round trip over previous_response_id, on a worker and
through the router."""

import json

import httpx
import openai
import pytest

from tests.e2e.server_process import running_server

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def stack():
    with running_server("--log-level", "warning") as worker, \
            running_server("--both", worker, "--log-level", "warning", command="router") as router:
        yield {"worker": worker, "router": router}


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("target", ["worker", "router"])
def test_text_response_streamed_and_not(stack, target):
    client = _client(stack[target])
    kw = dict(model="SmolLM2-135M-Instruct", input="What is the capital of France?", instructions="Answer briefly.",
              max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.input_tokens > 10 and 0 < whole.usage.output_tokens <= 12
    kinds, text = [], ""
    with client.responses.create(stream=True, **kw) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds.count("response.output_text.delta") > 1 and kinds[-1] in ("response.completed", "response.incomplete")
    assert text == whole.output_text == final.output_text  # greedy: the same answer both ways
    assert client.responses.retrieve(whole.id).output_text == whole.output_text


@pytest.mark.parametrize("target", ["worker", "router"])
def test_function_tool_round_trip_over_previous_response_id(stack, target):
    client = _client(stack[target])
    first = client.responses.create(model="SmolLM2-135M-Instruct", input="What is the weather in Paris?",
                                    tools=[WEATHER], tool_choice="required", max_output_tokens=60, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    second = client.responses.create(
        model="SmolLM2-135M-Instruct", previous_response_id=first.id, tools=[WEATHER], max_output_tokens=20,
        temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                               "output": "18 degrees and sunny"}])
    assert second.status in ("completed", "incomplete") and (second.output_text or second.output)
    assert second.usage.input_tokens > first.usage.input_tokens  # the history came along
    assert second.usage.input_tokens_details.cached_tokens > 0  # and its prefix was cached
    args, names = "", []
    with client.responses.create(model="SmolLM2-135M-Instruct", input="What is the weather in Paris?",
                                 tools=[WEATHER], tool_choice="required", max_output_tokens=60, temperature=0,
                                 stream=True) as stream:
        for event in stream:
            if event.type == "response.output_item.added" and event.item.type == "function_call":
                names.append(event.item.name)
            if event.type == "response.function_call_arguments.delta":
                args += event.delta
    assert names == ["get_weather"] and args == calls[0].arguments


def test_bad_responses_requests(stack):
    url = stack["router"]
    for body in ({"input": "hi", "previous_response_id": "resp_missing"},
                 {"input": "hi", "tools": [{"type": "web_search"}]},
                 {"input": [{"type": "input_image", "image_url": "x"}]},
                 {"input": "hi", "background": True},
                 {"input": "hi", "tool_choice": "required"}):
        r = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"], (body, r.text)
    assert httpx.get(f"{url}/v1/responses/resp_missing").status_code == 404
    done = httpx.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 2}, timeout=60).json()
    assert httpx.delete(f"{url}/v1/responses/{done['id']}").json()["deleted"] is True
    assert httpx.get(f"{url}/v1/responses/{done['id']}").status_code == 404
    unstored = httpx.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 2, "store": False},
                          timeout=60).json()
    assert httpx.get(f"{url}/v1/responses/{unstored['id']}").status_code == 404
