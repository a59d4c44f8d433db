"""The shipped Q4_1 default model kept as stored, against llama.cpp's llama-server on the same
file: greedy tokens agree, and where they part, llama.cpp itself was nearly undecided: our
token is one of its top choices, within NEAR_TIE of its first.

llama.cpp multiplies 8-bit activations (as ``--int8-activations`` does) and keeps its KV cache
in float16; any last-bit difference upstream moves an 8-bit rounding, a step of up to 1/254 of
a block's largest value, so two implementations part wherever two tokens are almost tied on
this 135M model. llama.cpp parts from itself the same way between its own settings (float16
or float32 KV cache, flash attention on or off: on these prompts, after 0 to 31 tokens). Needs the ``peers``
extra: importing the llama-server helpers skips this module without it."""

import httpx
import pytest

from tests.e2e.test_default_model import CHATS
from tests.e2e.test_llama_server_backend import llama_server
from xlserve import LLM, SamplingParams

PROMPTS = CHATS + [[{"role": "user", "content": "Write a Python function that reverses a string."}],
                   [{"role": "user", "content": "What is 17 times 23?"}]]
TOKENS = 32
# nats between llama.cpp's first choice and ours. llama.cpp's own settings move such a gap
# by this much: on a 2-core AMD EPYC Zen 5, the first token of "What is the capital of
# France?" leads its runner-up by 0.24 with flash attention on (its default) and by 0.09 with
# it off (fp32 KV cache: 0.24); xlserve, fp32 and bf16 alike, puts that runner-up 0.08 ahead.
NEAR_TIE = 0.3


def _llama_cpp_greedy(url: str, ids: list[int]) -> dict:
    return httpx.post(f"{url}/completion", json={
        "prompt": ids, "n_predict": TOKENS, "temperature": 0, "top_k": 1, "ignore_eos": True, "return_tokens": True,
        "cache_prompt": False, "n_probs": 5}, timeout=300).json()


@pytest.mark.parametrize("int8", [False, True], ids=["fp32-activations", "int8-activations"])
def test_greedy_follows_llama_cpp_on_the_same_quantized_file_until_a_near_tie(int8):
    llm = LLM("default", int8_activations=int8)  # --quantization auto: Q4_1 and Q8_0 weights as stored
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    agreed = []
    with llama_server() as (url, _):
        for chat in PROMPTS:
            ids = llm.tokenizer.encode_chat(chat)
            ours = llm.generate(ids, params)[0].outputs[0].token_ids
            theirs = _llama_cpp_greedy(url, ids)
            same = next((i for i, (a, b) in enumerate(zip(ours, theirs["tokens"])) if a != b), TOKENS)
            agreed.append(same)
            if same < TOKENS:
                top = theirs["completion_probabilities"][same]["top_logprobs"]
                mine = {t["id"]: t["logprob"] for t in top}
                assert ours[same] in mine, (chat, same, top)  # our token is among llama.cpp's top 5
                assert top[0]["logprob"] - mine[ours[same]] < NEAR_TIE, (chat, same, top)
    print("tokens agreed per prompt:", agreed)
    assert sum(n >= 24 for n in agreed) >= 2, agreed

