"""xlserve logits and greedy tokens match transformers on tiny random models of every architecture."""

import pytest
import torch

from xlserve import LLM, SamplingParams

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gemma3",
         "llama4", "gpt_oss"]


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


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3", "gemma3", "llama4", "gpt_oss"])
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


def _multimodal(kind):
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Llama4Config,
        Llama4ForConditionalGeneration,
        Llama4VisionConfig,
        SiglipVisionConfig,
    )

    from tests.conftest import _tiny_configs
    text = _tiny_configs()[kind].to_dict()
    if kind == "gemma3":  # transformers' multimodal Gemma 3 never soft-caps; its checkpoints set no cap
        text["final_logit_softcapping"] = None
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14)
        return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision.to_dict(),
                                                           mm_tokens_per_image=4, image_token_index=300))
    vision = Llama4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                                projector_output_dim=64)
    return Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision.to_dict(),
                                                       image_token_index=300))


@pytest.mark.parametrize("kind", ["gemma3", "llama4"])
def test_the_language_model_of_a_multimodal_checkpoint_matches(tmp_path, kind):
    """Gemma 3 (4B and up) and Llama 4 ship as image+text checkpoints: xlserve serves their
    language model, skipping the vision tower, with transformers' text logits."""
    torch.manual_seed(0)
    model = _multimodal(kind).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, 290, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    # transformers' Llama 4 wrapper fails on text-only input (it reads image outputs it has
    # not made), so its language model answers for it
    reference = model.language_model if kind == "llama4" else model
    with torch.no_grad():
        ref = reference(input_ids=torch.tensor([ids])).logits[0]
    ours = _xl_logits(LLM(str(tmp_path), dtype="float32", kv_cache_tokens=1024), ids)
    assert (ours - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
