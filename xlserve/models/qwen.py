"""Qwen2 (bias on the QKV projection) and Qwen3 (RMSNorm on each query/key head)."""

from xlserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
