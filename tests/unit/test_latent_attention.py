"""Multi-head latent attention keeps only the compressed latent and the rotary key per token
and layer; its blocks travel between engines like any others; decode reads them absorbed."""

import pytest
import torch

from xlserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
PROMPT = list(range(20, 90))  # 70 tokens: 4 full blocks of 16


def _config(path):
    import json
    with open(f"{path}/config.json") as f:
        return json.load(f)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_bytes_per_token_are_latent_plus_rotary_dims(tiny_model_dirs, dtype):
    cfg = _config(tiny_model_dirs["deepseek_v3"])
    llm = LLM(tiny_model_dirs["deepseek_v3"], dtype=dtype, kv_cache_tokens=1024)
    runner = llm.engine.runner
    slots = runner.kv_caches[0][0].shape[0]
    pool_bytes = sum(t.numel() * t.element_size() for layer in runner.kv_caches for t in layer)
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    expected = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * cfg["num_hidden_layers"] * itemsize
    assert pool_bytes / slots == expected  # (32 + 16) x 3 layers, not 2 x 4 heads x (48 or 24) per layer
    assert runner.kv_bytes / (llm.engine.num_blocks * llm.engine.block_size) == expected
    assert llm.engine.kv.layout.block_bytes == expected * llm.engine.block_size


def test_latent_blocks_exported_and_imported_give_the_same_output(tiny_model_dirs):
    path = tiny_model_dirs["deepseek_v3"]
    colocated = LLM(path, dtype="float32", kv_cache_tokens=1024).generate(PROMPT, GREEDY)[0]
    prefill, decode = (LLM(path, dtype="float32", kv_cache_tokens=1024) for _ in range(2))
    prefill.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0))
    payload = prefill.engine.kv.export(prefill.engine.prompt_block_hashes(PROMPT))
    assert payload.layout.parts == 1 and len(payload.block_hashes) == 4
    assert decode.engine.kv.import_blocks(payload) == 4
    out = decode.generate(PROMPT, GREEDY)[0]
    assert out.cached_tokens == 64
    assert out.outputs[0].token_ids == colocated.outputs[0].token_ids
    local = prefill.generate(PROMPT, GREEDY)[0]  # the same bits as the prefill engine's own prefix hit
    assert local.cached_tokens == 64
    assert [e["logprob"] for e in out.outputs[0].logprobs] == [e["logprob"] for e in local.outputs[0].logprobs]


def test_absorbed_decode_equals_expanded_attention(tiny_model_dirs):
    """Each decode step's logits equal a full forward over the sequence so far, which attends
    through expanded keys and values: the absorbed path computes the same attention."""
    from xlserve.layers.attention import AttentionMetadata, PrefillChunk
    llm = LLM(tiny_model_dirs["deepseek_v3"], dtype="float32", kv_cache_tokens=1024)
    out = llm.generate(PROMPT[:30], GREEDY)[0].outputs[0]
    assert llm.engine.steps_by_path  # decode steps ran
    ids = PROMPT[:30] + out.token_ids[:-1]
    model = llm.engine.runner.model
    meta = AttentionMetadata(slot_mapping=torch.arange(len(ids)), prefills=[PrefillChunk(0, len(ids))])
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), meta))
    assert logits[29:].argmax(-1).tolist() == out.token_ids
