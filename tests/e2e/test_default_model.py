"""The real default model (SmolLM2-135M-Instruct GGUF) against transformers loading the same file."""

import os

import pytest
import torch

from xlserve import LLM, SamplingParams
from xlserve.loader.model_source import default_model_path

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Explain photosynthesis in one sentence."}],
]
TEXTS = ["Hello world 12345  foo", "  leading spaces\tand tabs\n\nnewlines", "naïve café — 東京 🙂",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x**2  # comment"]


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = default_model_path()
    d, f = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def llm():
    return LLM("default", dtype="float32")


def test_tokenizer_and_chat_template_identical(hf, llm):
    hf_tok, _ = hf
    for text in TEXTS:
        assert llm.tokenizer.encode(text) == hf_tok.encode(text), text
    for chat in CHATS:
        ours = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        theirs = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert ours == theirs
        assert llm.tokenizer.encode_chat(chat) == hf_tok(theirs, add_special_tokens=False)["input_ids"]


def _hf_greedy(model, ids, n):
    """Plain greedy with the KV cache, running past EOS like ignore_eos does: the tokens and
    each one's logprob."""
    tokens, logprobs = [], []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            logprobs.append(float(torch.log_softmax(out.logits[0, -1].float(), -1)[tokens[-1]]))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs


def test_greedy_chat_continuations_match_transformers(hf, llm):
    """transformers dequantizes the file's weights; the default keeps them as stored and
    computes the same values with fp32 activations: the same tokens, and each one's logprob
    within float32 summation order of transformers'."""
    hf_tok, model = hf
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.chat(CHATS, params)
    for chat, out in zip(CHATS, outs):
        tokens, logprobs = _hf_greedy(model, llm.tokenizer.encode_chat(chat), 32)
        assert out.outputs[0].token_ids == tokens
        # the same values up to the summation order (1.2e-5 at most measured)
        assert max(abs(a["logprob"] - b) for a, b in zip(out.outputs[0].logprobs, logprobs)) < 1e-4


def test_greedy_identical_batched_chunked_cached_preempted(llm):
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": f"Tell me fact number {i} about "
                                                                      + "space " * (i * 7)}]) for i in range(16)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts[:4]]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert batched[:4] == alone
    # every prompt shares the template's system prompt: cached now
    again = llm.generate(prompts[:4], params)
    assert all(o.cached_tokens >= 16 for o in again)
    assert [o.outputs[0].token_ids for o in again] == alone
    small = LLM("default", dtype="float32", max_num_batched_tokens=16, num_kv_blocks=24,
                enable_prefix_caching=False)
    outs = small.generate(prompts[:4] + prompts[8:12], params)
    assert [o.outputs[0].token_ids for o in outs[:4]] == alone
    assert [o.outputs[0].token_ids for o in outs[4:]] == batched[8:12]
    assert small.engine.stats()["num_preemptions"] > 0


def test_stop_strings_never_leak_and_utf8_is_whole(llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    full = llm.chat(chat, SamplingParams(max_tokens=20, temperature=0))[0].outputs[0].text
    word = next(w for w in full.split()[2:] if len(w) >= 4)  # a stop string in the middle of the answer
    cut = llm.chat(chat, SamplingParams(max_tokens=20, temperature=0, stop=[word]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(word)]
    kept = llm.chat(chat, SamplingParams(max_tokens=20, temperature=0, stop=[word],
                                         include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full[: full.index(word) + len(word)]
    # streamed pieces: each is valid text and their sum is the final text
    engine = llm.engine
    engine.add_request("emoji", llm.tokenizer.encode_chat(
        [{"role": "user", "content": "Reply with five emoji and Japanese words: 🙂 東京"}]),
        SamplingParams(max_tokens=40, temperature=0.8, seed=7, stop=["Tokyo"]))
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.new_text)
            final = out
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == final.outputs[0].text
    assert "Tokyo" not in final.outputs[0].text
