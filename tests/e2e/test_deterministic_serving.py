"""``--deterministic`` through prefill/decode disaggregation, in the default dtype (bfloat16 where
the CPU has bf16 math) on the dequantized default model: the prefill worker computes the
prompt and the first token, the decode worker pulls the KV over TCP and goes on, and the
answer is the offline engine's, alone and in a batch of mixed lengths, bit for bit (in the AMX
tiles' order on AVX-512 CPUs, elsewhere the fp32 tiles; ``invariant_linear``). And "which
worker": a decode worker without AMX continues a prefill worker with it, for that model and for
the default model as shipped."""

import httpx
import pytest

from tests.e2e.server_process import running_server
from xlserve import LLM, SamplingParams
from xlserve.kernels import cpu_isa, cpu_ops

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


def _paired(p: str, d: str) -> None:
    kv = httpx.get(f"{p}/internal/info").json()["kv"]
    assert httpx.post(f"{d}/internal/kv/peers", json={"peers": [{"host": kv["host"], "port": kv["port"]}]},
                      ).json() == {"peers": 1}


@pytest.fixture(scope="module")
def workers():
    common = ("--quantization", "none", "--deterministic", "--log-level", "warning")
    with running_server("--role", "prefill", *common) as p, running_server("--role", "decode", *common) as d:
        _paired(p, d)
        yield p, d


def _disaggregated(p: str, d: str, ids: list[int], logprobs: list[float] | None = None) -> list[int]:
    """The answer through the two workers; ``logprobs``, when given, gets each token's."""
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    first = httpx.post(f"{p}/internal/generate", json={"prompt_token_ids": ids, "sampling": sampling,
                                                      "kv_export": True}, timeout=120).json()
    second = httpx.post(f"{d}/internal/generate", json={
        "prompt_token_ids": ids, "kv_import": first["kv"], "resume_token_ids": first["token_ids"],
        "sampling": sampling}, timeout=120).json()
    httpx.post(f"{p}/internal/kv/release", json={"pin_id": first["kv"]["pin_id"]})
    assert second["kv_import"]["error"] is None and second["kv_import"]["blocks"] > 0
    if logprobs is not None:
        logprobs += [entry["logprob"] for entry in first["logprobs"] + second["logprobs"]]
    return first["token_ids"] + second["token_ids"]


def test_disaggregated_answers_are_the_offline_engines_alone_and_batched(offline, workers):
    prompts = [_chat_ids(offline, text) for text in CHATS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    batched = [list(o.outputs[0].token_ids) for o in offline.generate(prompts, params)]
    alone = [list(offline.generate([ids], params)[0].outputs[0].token_ids) for ids in prompts]
    assert batched == alone
    assert [_disaggregated(*workers, ids) for ids in prompts] == batched


SETUPS = {"dense-deterministic": ("--quantization", "none", "--deterministic"), "as-shipped": ()}


@pytest.mark.skipif(not cpu_ops.amx_ready(), reason="needs a CPU with AMX, to stand in for one without it too")
@pytest.mark.parametrize("setup", SETUPS)
def test_a_decode_worker_without_amx_continues_a_prefill_worker_with_it(setup):
    """The prefill worker on the AMX tiles, the decode worker capped at an AMD Zen 4's instruction
    sets (XLSERVE_MAX_CPU_ISA=avx512-bf16: the tiles' twins in FMAs): the offline engine's tokens
    and logprobs on this CPU as it is, bit for bit; for the dequantized model under
    --deterministic and for the default model as users get it (Q4_1 and Q8_0 kept)."""
    args = SETUPS[setup]
    options = {"quantization": "none", "deterministic": True} if args else {}
    llm = LLM("default", kv_cache_tokens=4096, **options)
    try:
        prompts = [_chat_ids(llm, text) for text in CHATS]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
        outs = llm.generate(prompts, params)
    finally:
        llm.close()
    expected = [(list(o.outputs[0].token_ids), [lp["logprob"] for lp in o.outputs[0].logprobs]) for o in outs]
    common = (*args, "--log-level", "warning")
    capped = {cpu_isa.MAX_CPU_ISA_ENV: "avx512-bf16"}
    with running_server("--role", "prefill", *common) as p, \
            running_server("--role", "decode", *common, env=capped) as d:
        _paired(p, d)
        answers = []
        for ids in prompts:
            logprobs: list[float] = []
            answers.append((_disaggregated(p, d, ids, logprobs), logprobs))
    assert answers == expected
