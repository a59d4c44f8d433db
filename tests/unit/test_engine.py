"""Engine behaviour on a tiny random model: batching, chunking, prefix hits, preemption,
seeded sampling, abort and bad input. Greedy output must not depend on any of them."""

import pytest
import torch

from xlserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(n, seed=0, lo=5, hi=90):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 320, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Each prompt run alone, big budget, no prefix caching."""
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=4096, enable_prefix_caching=False)
    return {tuple(p): llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in _prompts(16)}


def _check(llm, reference):
    prompts = [list(p) for p in reference]
    outs = llm.generate(prompts, GREEDY)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference[tuple(p)]
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_batch_of_16_mixed_lengths_equals_alone(tiny_llama_dir, reference):
    _check(LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=4096), reference)


def test_chunked_prefill_small_budget_equals_alone(tiny_llama_dir, reference):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=4096, max_num_batched_tokens=7)
    _check(llm, reference)


def test_preemption_equals_alone(tiny_llama_dir, reference):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=160, block_size=4)
    _check(llm, reference)
    assert llm.engine.stats()["num_preemptions"] > 0


def test_prefix_hit_reported_and_identical(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=4096)
    shared = _prompts(1, seed=5, lo=70, hi=71)[0]
    first = llm.generate(shared + [7, 8, 9], GREEDY)[0]
    second = llm.generate(shared + [10, 11], GREEDY)[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == 64  # 70 shared tokens = 4 whole blocks of 16
    fresh = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=4096, enable_prefix_caching=False)
    assert fresh.generate(shared + [10, 11], GREEDY)[0].outputs[0].token_ids == second.outputs[0].token_ids
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_tokens"] == 64 and stats["prefix_cache_queried_tokens"] == 73 + 72


def test_seeded_sampling_same_alone_and_batched(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=4096)
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    prompt = _prompts(1, seed=9)[0]
    alone = llm.generate(prompt, p)[0].outputs[0].token_ids
    batch = llm.generate(_prompts(6, seed=3) + [prompt], [SamplingParams(max_tokens=20, seed=i)
                                                         for i in range(6)] + [p])
    assert batch[-1].outputs[0].token_ids == alone
    other = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_penalties_min_p_and_logprobs(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=4096)
    prompt = _prompts(1, seed=11)[0]
    p = SamplingParams(max_tokens=12, temperature=0, repetition_penalty=5.0, ignore_eos=True, logprobs=3)
    out = llm.generate(prompt, p)[0].outputs[0]
    assert len(set(out.token_ids)) == len(out.token_ids)  # a strong penalty forbids repeats here
    assert len(out.logprobs) == 12
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert entry["token_id"] == tok and len(entry["top"]) == 3 and entry["logprob"] <= 0
    greedy = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1))
    first = greedy[0].outputs[0].logprobs[0]
    assert first["top"][0][0] == first["token_id"]  # greedy picks the top logprob
    mp = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, min_p=1.0, seed=3,
                                             ignore_eos=True))[0].outputs[0].token_ids
    assert mp == greedy[0].outputs[0].token_ids  # min_p=1 keeps only the argmax


def test_abort_frees_blocks_and_others_continue(tiny_llama_dir, reference):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=4096)
    engine = llm.engine
    prompts = [list(p) for p in reference][:3]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    engine.step()
    assert engine.abort_request("r1").outputs[0].finish_reason == "abort"
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"r0", "r2"}
    assert done["r0"].outputs[0].token_ids == reference[tuple(prompts[0])]
    assert done["r2"].outputs[0].token_ids == reference[tuple(prompts[2])]
    assert engine.stats()["kv_blocks_used"] == 0


def test_bad_input_is_refused_and_engine_keeps_serving(tiny_llama_dir, reference):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_tokens=4096)
    engine = llm.engine
    good = list(reference)[0]
    engine.add_request("good", list(good), GREEDY)
    engine.step()
    with pytest.raises(ValueError, match="context is 512 tokens"):
        engine.add_request("long", [5] * 600, GREEDY)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 320\)"):
        engine.add_request("vocab", [5, 999], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", [5], GREEDY)
    with pytest.raises(ValueError, match="has no tokenizer"):
        engine.add_request("text", "hello", GREEDY)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    assert out.request_id == "good" and out.outputs[0].token_ids == reference[good]
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=-1), "max_tokens must be a positive integer"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_k=-3), "top_k"),
    (dict(logprobs=50), "logprobs"),
    (dict(stop=[""]), "stop"),
])
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("llama", "bfloat16"), ("qwen2", "bfloat16")])
def test_prepacked_weights_change_no_output(tiny_model_dirs, arch, dtype):
    """oneDNN-prepacked weights serve every matmul of more than 4 rows (prefill, the batch
    of 16) but the head's, whose float32 logits come from the row kernel and need no twin;
    tokens equal the plain weights' exactly."""
    from xlserve.layers.linear import prepack_unsupported
    if prepack_unsupported(getattr(torch, dtype)):  # this CPU: the option is refused, clearly
        with pytest.raises(ValueError, match="prepacked"):
            LLM(tiny_model_dirs[arch], dtype=dtype, kv_cache_tokens=4096, prepack_weights=True)
        return
    prompts = _prompts(16, seed=3)
    plain = LLM(tiny_model_dirs[arch], dtype=dtype, kv_cache_tokens=4096).generate(prompts, GREEDY)
    packed_llm = LLM(tiny_model_dirs[arch], dtype=dtype, kv_cache_tokens=4096, prepack_weights=True)
    model = packed_llm.engine.runner.model
    assert hasattr(model.model.layers[0].mlp.down_proj.weight, "_xlserve_prepacked")
    assert not hasattr(model.lm_head.weight, "_xlserve_prepacked")
    packed = packed_llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in packed] == [o.outputs[0].token_ids for o in plain]


def test_top_logprobs_list_tied_tokens_in_greedy_order():
    from xlserve.engine.sampler import Sampler
    row = torch.zeros(1000)
    row[[700, 30, 500]] = 4.0
    entry = Sampler.logprobs(row, int(row.max(-1).indices), 3)
    assert entry["token_id"] == 30 and [t for t, _ in entry["top"]] == [30, 500, 700]


def test_decode_padding_never_reads_unwritten_slots(tiny_llama_dir):
    """Batched decode on the SDPA path pads shorter contexts to the longest. Padding is
    masked, but a masked value still meets a zero weight and 0 x NaN is NaN: with the whole
    pool poisoned, the tokens must still equal a clean pool's."""
    from xlserve.kernels import cpu_ops
    prompts = [list(range(5, 60)), list(range(70, 80)), list(range(100, 130))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    cpu_ops.set_enabled(False)  # the fused kernel reads lengths and has no padding
    try:
        want = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, dtype="float32").generate(prompts, params)]
        poisoned = LLM(tiny_llama_dir, dtype="float32")
        poisoned.generate([1] * 40, params)  # the first blocks now sit in the prefix cache, unused
        for k, v in poisoned.engine.runner.kv_caches:
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        assert [o.outputs[0].token_ids for o in poisoned.generate(prompts, params)] == want
    finally:
        cpu_ops.set_enabled(True)


def test_logit_bias_forces_and_bans_tokens(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_tokens=4096)
    prompt = _prompts(1, seed=9)[0]
    plain = llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    forced = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                 logit_bias={123: 100}))[0].outputs[0].token_ids
    assert forced == [123] * 8
    banned = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                 logit_bias={plain[0]: -100}))[0].outputs[0].token_ids
    assert plain[0] not in banned and banned != plain
    with pytest.raises(ValueError, match="logit_bias names token ids outside"):
        llm.generate(prompt, SamplingParams(logit_bias={10**6: 1}))
    with pytest.raises(ValueError, match="logit_bias must map"):
        SamplingParams(logit_bias={5: 101})
