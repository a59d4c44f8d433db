"""Model architectures by name (``architectures`` in config.json / ``general.architecture``
in GGUF), imported lazily."""

from __future__ import annotations

import importlib

from xlserve.models.arch import ModelArch

MODEL_REGISTRY = {
    "DeepseekV3ForCausalLM": ("xlserve.models.deepseek", "DeepseekV3ForCausalLM"),  # also Kimi K2
    "Gemma3ForCausalLM": ("xlserve.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("xlserve.models.gemma3", "Gemma3ForConditionalGeneration"),  # text
    "GptOssForCausalLM": ("xlserve.models.gpt_oss", "GptOssForCausalLM"),
    "KimiK25ForConditionalGeneration": ("xlserve.models.deepseek", "KimiK25ForCausalLM"),  # its language model
    "LlamaForCausalLM": ("xlserve.models.llama", "LlamaForCausalLM"),
    "Llama4ForCausalLM": ("xlserve.models.llama4", "Llama4ForCausalLM"),
    "Llama4ForConditionalGeneration": ("xlserve.models.llama4", "Llama4ForCausalLM"),  # its language model
    "MistralForCausalLM": ("xlserve.models.llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("xlserve.models.llama", "LlamaForCausalLM"),  # MoE layers from the config
    "Qwen2ForCausalLM": ("xlserve.models.qwen", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("xlserve.models.qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("xlserve.models.qwen", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("xlserve.models.qwen", "Qwen3ForCausalLM"),
}

# GGUF general.architecture -> Hugging Face architecture name
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM", "gemma3": "Gemma3ForCausalLM",
                      "gpt-oss": "GptOssForCausalLM", "deepseek2": "DeepseekV3ForCausalLM",
                      "llama4": "Llama4ForCausalLM"}
# ... when the file has experts (llama.cpp writes Mixtral as "llama")
GGUF_MOE_ARCHITECTURES = {"llama": "MixtralForCausalLM"}


def model_class(architecture: str):
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}")
    module, name = MODEL_REGISTRY[architecture]
    return getattr(importlib.import_module(module), name)


def build_model(arch: ModelArch):
    return model_class(arch.architecture)(arch)
