"""Speed work changes no output: greedy tokens with every CPU kernel on equal the plain
eager torch path on the real default model. Exactly in float32. In bfloat16 a different
summation order can flip a near-tie after a while, as it does in eager torch itself
between a request alone and batched, so there the runs must agree on the first 16 tokens."""

import pytest

from xlserve import LLM, SamplingParams
from xlserve.kernels import cpu_ops

CHATS = [[{"role": "user", "content": q}] for q in (
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain recursion in two sentences.", "List three fruits and their colors.")]


@pytest.mark.skipif(cpu_ops.kernels() is None, reason="CPU kernels unavailable here")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_with_kernels_equals_eager(dtype):
    llm = LLM("default", dtype=dtype)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    fast = [llm.chat(chat, params)[0].outputs[0].token_ids for chat in CHATS]  # batch 1: fused decode layer
    cpu_ops.set_enabled(False)
    try:
        eager = [llm.chat(chat, params)[0].outputs[0].token_ids for chat in CHATS]
    finally:
        cpu_ops.set_enabled(True)
    if dtype == "float32":
        assert fast == eager
    else:
        assert [t[:16] for t in fast] == [t[:16] for t in eager]
