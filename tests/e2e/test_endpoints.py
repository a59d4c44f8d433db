"""The endpoints besides chat and completions that agents and tools call: /tokenize,
/detokenize, /v1/models/{id}, and --chat-template, on a worker and through the router."""

import httpx
import pytest

from tests.e2e.server_process import running_server

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\nTEMPLATE-FROM-FILE {{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def stack():
    with running_server("--log-level", "warning") as worker, \
            running_server("--both", worker, "--log-level", "warning", command="router") as router:
        yield {"worker": worker, "router": router}


@pytest.mark.parametrize("target", ["worker", "router"])
def test_tokenize_counts_what_a_chat_request_is_charged(stack, target):
    url = stack[target]
    tokens = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}, timeout=60).json()
    assert tokens["count"] == len(tokens["tokens"]) == chat["usage"]["prompt_tokens"]
    assert tokens["max_model_len"] > 0
    text = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert text["count"] == 2 and text["token_strs"] == ["Hello", "Ġworld"]
    back = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "What is the capital of France?" in back and "<|im_start|>" in back


@pytest.mark.parametrize("target", ["worker", "router"])
def test_bad_token_requests_and_model_cards(stack, target):
    url = stack[target]
    for path, body in (("/detokenize", {"tokens": [1, 10**9]}), ("/tokenize", {}),
                       ("/tokenize", {"prompt": "a", "messages": MESSAGES}), ("/tokenize", {"prompt": 5}),
                       ("/tokenize", {"prompt": "a", "model": "other-model"})):
        r = httpx.post(f"{url}{path}", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["message"], (path, body)
    card = httpx.get(f"{url}/v1/models/{MODEL}")
    assert card.status_code == 200 and card.json()["id"] == MODEL and card.json()["object"] == "model"
    missing = httpx.get(f"{url}/v1/models/gpt-4o")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_chat_template_from_a_file(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    with running_server("--log-level", "warning", "--chat-template", str(path)) as url:
        ids = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        text = httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"]
        assert "TEMPLATE-FROM-FILE What is the capital" in text
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}, timeout=60)
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
