"""``--deterministic`` through prefill/decode disaggregation, in the default dtype (bfloat16 where
the CPU has bf16 math) on the dequantized default model: the prefill worker computes the
prompt and the first token, the decode worker pulls the KV over TCP and goes on, and the
answer is the offline engine's, alone and in a batch of mixed lengths, bit for bit (on AMX CPUs
the tiles, elsewhere the fp32 tiles; ``invariant_linear``)."""

import httpx
import pytest

from tests.e2e.server_process import running_server
from xlserve import LLM, SamplingParams

CHATS = ["Name three rivers in Europe.", "Write a haiku about the sea.", "What is 17 times 23?",
         "Give two tips for writing tests."]
MAX_TOKENS = 20


def _chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "system", "content": "You are a careful assistant. " * 8},
                                      {"role": "user", "content": text}])


@pytest.fixture(scope="module")
def offline():
    llm = LLM("default", quantization="none", deterministic=True, kv_cache_tokens=4096)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def workers():
    common = ("--quantization", "none", "--deterministic", "--log-level", "warning")
    with running_server("--role", "prefill", *common) as p, running_server("--role", "decode", *common) as d:
        kv = httpx.get(f"{p}/internal/info").json()["kv"]
        assert httpx.post(f"{d}/internal/kv/peers", json={"peers": [{"host": kv["host"], "port": kv["port"]}]},
                          ).json() == {"peers": 1}
        yield p, d


def _disaggregated(p: str, d: str, ids: list[int]) -> list[int]:
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    first = httpx.post(f"{p}/internal/generate", json={"prompt_token_ids": ids, "sampling": sampling,
                                                      "kv_export": True}, timeout=120).json()
    second = httpx.post(f"{d}/internal/generate", json={
        "prompt_token_ids": ids, "kv_import": first["kv"], "resume_token_ids": first["token_ids"],
        "sampling": sampling}, timeout=120).json()
    httpx.post(f"{p}/internal/kv/release", json={"pin_id": first["kv"]["pin_id"]})
    assert second["kv_import"]["error"] is None and second["kv_import"]["blocks"] > 0
    return first["token_ids"] + second["token_ids"]


def test_disaggregated_answers_are_the_offline_engines_alone_and_batched(offline, workers):
    prompts = [_chat_ids(offline, text) for text in CHATS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    batched = [list(o.outputs[0].token_ids) for o in offline.generate(prompts, params)]
    alone = [list(offline.generate([ids], params)[0].outputs[0].token_ids) for ids in prompts]
    assert batched == alone
    assert [_disaggregated(*workers, ids) for ids in prompts] == batched
