import os
import subprocess

import pytest
import torch

TINY_COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _tiny_configs():
    from transformers import (
        DeepseekV3Config,
        Gemma3TextConfig,
        GptOssConfig,
        Llama4TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )
    return {
        "llama": LlamaConfig(**TINY_COMMON, rope_theta=10000.0),
        "llama3": LlamaConfig(**{**TINY_COMMON, "tie_word_embeddings": True}, rope_theta=500000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "mistral": MistralConfig(**TINY_COMMON, sliding_window=None),
        "qwen2": Qwen2Config(**TINY_COMMON, use_sliding_window=False),
        "qwen3": Qwen3Config(**TINY_COMMON, head_dim=32, use_sliding_window=False),
        "mixtral": MixtralConfig(**TINY_COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        "qwen2_moe": Qwen2MoeConfig(**TINY_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, use_sliding_window=False),
        "qwen3_moe": Qwen3MoeConfig(**TINY_COMMON, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=False, decoder_sparse_step=1,
                                    mlp_only_layers=[1], use_sliding_window=False),
        # MLA with a low-rank query, YaRN, 8 experts in 4 groups (2 kept), a shared expert, a dense first layer
        "deepseek_v3": DeepseekV3Config(**{**TINY_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4},
                                        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                                        num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                                        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24,
                                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 0.8,
                                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 128,
                                                      "beta_fast": 32, "beta_slow": 1}),
        # sliding windows of 8 tokens, every third layer global with its own rotary base and scaling
        "gemma3": Gemma3TextConfig(**{**TINY_COMMON, "num_hidden_layers": 3, "tie_word_embeddings": True},
                                   head_dim=32, sliding_window=8, layer_types=["sliding_attention",
                                                                                "sliding_attention", "full_attention"],
                                   query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 100000.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 10000.0}}),
        # chunks of 8 tokens on rotary layers, a global layer with query temperature, MoE every other layer
        "llama4": Llama4TextConfig(**{**TINY_COMMON, "num_hidden_layers": 4, "intermediate_size": 32},
                                   intermediate_size_mlp=128, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                                   interleave_moe_layer_step=2, attention_chunk_size=8, no_rope_layers=[1, 1, 1, 0],
                                   use_qk_norm=True, floor_scale=4, attn_scale=0.1, attn_temperature_tuning=True),
        # sinks, sliding (8) and full layers, biased router and experts, clamped SwiGLU, YaRN without truncation
        "gpt_oss": GptOssConfig(**{**TINY_COMMON, "intermediate_size": 32}, head_dim=16, num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0,
                                layer_types=["sliding_attention", "full_attention"],
                                rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "original_max_position_embeddings": 128,
                                                 "truncate": False, "rope_theta": 150000.0}),
    }


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """Tiny random models of every supported architecture, saved by transformers."""
    from transformers import AutoModelForCausalLM
    dirs = {}
    for name, cfg in _tiny_configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        # Random init is small; widen the weights so logits are far from ties.
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if name == "gpt_oss" and param_name.endswith("_bias"):  # the experts' biases: zero at init
                    p.normal_(0.0, 0.5)
                elif p.dim() == 2:
                    p.mul_(4.0)
                elif name == "gemma3" and param_name.endswith("norm.weight"):  # offsets from 1, zero at init
                    p.normal_(0.0, 0.2)
                elif name == "gpt_oss" and not param_name.endswith("norm.weight"):  # experts, biases, sinks
                    p.normal_(0.0, 0.5 if p.dim() < 3 else 0.2)
            for buffer_name, b in model.named_buffers():
                if buffer_name.endswith("e_score_correction_bias"):  # zero at init: make the bias choose
                    b.normal_(0.0, 0.3)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, safe_serialization=True)
        dirs[name] = str(path)
    return dirs


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs):
    return tiny_model_dirs["llama"]


@pytest.fixture
def full_disk(tmp_path):
    """A real file system of 64 KiB (tmpfs): writes past it fail with ENOSPC."""
    mount = tmp_path / "small"
    mount.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root and CAP_SYS_ADMIN): {e}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
