"""xlserve logits and greedy tokens match transformers on tiny random models of every architecture."""

import pytest
import torch

from xlserve import LLM, SamplingParams

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gemma3",
         "llama4"]


def _hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _xl_logits(llm, ids):
    from xlserve.layers.attention import AttentionMetadata, PrefillChunk
    runner = llm.engine.runner
    n = len(ids)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillChunk(0, n)])
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids), torch.arange(n), meta)
        return runner.model.compute_logits(hidden)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    ids = torch.randint(3, 320, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = _hf_model(path)(torch.tensor([ids])).logits[0]
    llm = LLM(path, dtype="float32", kv_cache_tokens=1024)
    ours = _xl_logits(llm, ids)
    scale = ref.abs().max().item()
    assert scale > 1.0
    assert (ours - ref).abs().max().item() <= 1e-4 * scale


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_32_tokens_match_transformers(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    prompt = torch.randint(3, 320, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    hf = _hf_model(path)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(32):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    llm = LLM(path, dtype="float32", kv_cache_tokens=1024)
    out = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ids[len(prompt):]


def test_experts_run_once_per_step_over_all_their_tokens(tiny_model_dirs, monkeypatch):
    """Tokens are grouped by expert: a 40-token prefill on 4 experts (top 2) runs each
    active expert once per sparse layer over all its tokens, not once per token."""
    from xlserve.layers.moe import SparseMoE
    llm = LLM(tiny_model_dirs["mixtral"], dtype="float32", kv_cache_tokens=1024)
    calls = []
    real = SparseMoE.expert
    monkeypatch.setattr(SparseMoE, "expert", lambda self, i, x: calls.append((i, x.shape[0])) or real(self, i, x))
    _xl_logits(llm, list(range(3, 43)))
    assert len(calls) <= 2 * 4  # two sparse layers, four experts
    assert sum(rows for _, rows in calls) == 2 * 40 * 2  # every token reaches its two experts, in each layer


def _hf_greedy(hf, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3", "gemma3", "llama4"])
def test_greedy_matches_with_prefix_hits_chunked_prefill_and_mixed_batches(tiny_model_dirs, arch):
    """Prompts of mixed lengths sharing a 40-token prefix, batched, prefilled in chunks of at
    most 24 tokens, then asked again (prefix-cache hits): every answer equals transformers'."""
    path = tiny_model_dirs[arch]
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 320, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 320, (n,), generator=gen).tolist() for n in (1, 9, 30)] + [shared[:7]]
    hf = _hf_model(path)
    expected = [_hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(path, dtype="float32", kv_cache_tokens=1024, block_size=8, max_num_batched_tokens=24)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    hits_before = llm.engine.kv.stats.hit_tokens
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.kv.stats.hit_tokens - hits_before >= 3 * 40  # the shared prefix came from the cache
    assert first == expected
    assert again == expected
