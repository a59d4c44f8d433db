"""KV layer groups: windowed layers (Gemma 3 sliding, Llama 4 chunked) keep one window per
sequence and free the rest while the request runs; prefix hits and the hand-off carry
every group; tokens still equal transformers'."""

import pytest
import torch

from xlserve import LLM, SamplingParams
from xlserve.engine.kv_groups import plan_groups
from xlserve.layers.window import Window
from xlserve.models.arch import ModelArch
from xlserve.planner.report import load_config

GREEDY = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)


def _hf_greedy(path, prompt, n):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():  # plain argmax: generate() would suppress EOS, which ignore_eos does not
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_groups_are_as_wide_as_the_full_layers():
    scout = plan_groups(ModelArch.from_hf_config(load_config("llama-4-scout")[1]))
    assert scout.width == 12 and len(scout.groups) == 4  # 12 global layers; 36 chunked in 3 groups
    assert scout.groups[0].window is None and {g.window for g in scout.groups[1:]} == {Window(8192, True)}
    oss = plan_groups(ModelArch.from_hf_config(load_config("gpt-oss-120b")[1]))
    assert oss.width == 18 and [len(g.layers) for g in oss.groups] == [18, 18]
    gemma_1b = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
                "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
                "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512, "sliding_window_pattern": 6}
    gemma = plan_groups(ModelArch.from_hf_config(gemma_1b))
    assert gemma.width == 4 and [len(g.layers) for g in gemma.groups] == [4, 4, 4, 4, 4, 4, 2]  # the last padded
    llama = plan_groups(ModelArch.from_hf_config(load_config("llama-3.1-70b")[1]))
    assert llama.width == 80 and len(llama.groups) == 1 and not llama.windowed


@pytest.mark.parametrize("arch", ["gemma3", "llama4", "gpt_oss"])
def test_a_generation_many_windows_long_keeps_pool_use_bounded_and_equals_transformers(tiny_model_dirs, arch):
    """Windows of 8 tokens, blocks of 4: each windowed group holds at most 3 blocks (4 while a
    step writes), while its full group grows. The pool (64 blocks) could not hold every layer's
    160 tokens (40 blocks per group, 2 to 4 groups) without freeing."""
    path = tiny_model_dirs[arch]
    prompt = list(range(20, 30))
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    request = engine.add_request("long", prompt, GREEDY)
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        tables = engine.kv.req_blocks.get("long")
        if tables:
            held.append([sum(b is not None for b in t) for t in tables[1:]])
    assert max(max(h) for h in held) <= 4
    assert engine.scheduler.num_preemptions == 0
    assert request.output_token_ids == _hf_greedy(path, prompt, 150)
    assert engine.kv.num_used_blocks == 0  # every group's blocks back in the pool


def test_windowed_blocks_hand_off_and_give_a_prefix_hit(tiny_model_dirs):
    path = tiny_model_dirs["gemma3"]
    prompt = list(range(20, 90))  # 70 tokens: 17 full blocks of 4
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    colocated = LLM(path, dtype="float32", block_size=4, kv_cache_tokens=1024).generate(prompt, params)[0]
    prefill, decode = (LLM(path, dtype="float32", block_size=4, kv_cache_tokens=1024) for _ in range(2))
    prefill.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
    hashes = prefill.engine.prompt_block_hashes(prompt)
    payload = prefill.engine.kv.export(hashes)
    layout = payload.layout
    assert layout.windows == ((8, False), (8, False)) and len(payload.block_hashes) == 17
    # group 0's 17 blocks, and each sliding group's blocks from position 68 - 7 = 61 on (blocks 15, 16)
    assert len(payload.data) == (17 + 2 + 2) * layout.block_bytes
    assert decode.engine.kv.import_blocks(payload) == 17
    out = decode.generate(prompt, params)[0]
    assert out.cached_tokens == 68
    assert out.outputs[0].token_ids == colocated.outputs[0].token_ids
    local = prefill.generate(prompt, params)[0]  # the same bits as the prefill engine's own prefix hit
    assert local.cached_tokens == 68
    assert [e["logprob"] for e in out.outputs[0].logprobs] == [e["logprob"] for e in local.outputs[0].logprobs]
    grant = prefill.engine.kv.pin(hashes, seconds=60)
    assert prefill.engine.kv.export_pinned(grant.pin_id, grant.secret, hashes[:17]).data == payload.data
    with pytest.raises(PermissionError, match="window"):  # the window at block 10 was not pinned
        prefill.engine.kv.export_pinned(grant.pin_id, grant.secret, hashes[:10])
    assert prefill.engine.kv.unpin(grant.pin_id)


def test_a_windowed_payload_that_does_not_fit_whole_is_not_imported_in_part(tiny_model_dirs):
    path = tiny_model_dirs["gemma3"]
    prompt = list(range(20, 90))
    prefill = LLM(path, dtype="float32", block_size=4, kv_cache_tokens=1024)
    prefill.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
    payload = prefill.engine.kv.export(prefill.engine.prompt_block_hashes(prompt))
    small = LLM(path, dtype="float32", block_size=4, num_kv_blocks=20)  # 21 blocks needed
    assert small.engine.kv.import_blocks(payload) == 0
    assert small.engine.kv.num_used_blocks == 0 and not small.engine.kv.pool.cached


def test_a_request_the_pool_cannot_hold_with_its_windows_is_refused_up_front(tiny_model_dirs):
    """A 200-token request in 64 blocks of 4: group 0 needs 50; each sliding group up to the
    window (8) plus a step's tokens. With 16-token steps that is 7 blocks each (64 in all: it
    runs); with 1,024-token steps a (re)computed prefill spans everything (150: refused)."""
    path = tiny_model_dirs["gemma3"]
    params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    small_steps = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    assert len(small_steps.generate(list(range(20, 60)), params)[0].outputs[0].token_ids) == 160
    large_steps = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4)
    with pytest.raises(ValueError, match="150 blocks"):
        large_steps.generate(list(range(20, 60)), params)
