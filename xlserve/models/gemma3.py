"""Gemma 3 (text, ``Gemma3ForCausalLM``): the Llama decoder with Gemma's layer — four norms
(the attention and MLP outputs are normed before the residual adds them), per-head q/k
norms, GeGLU — and, from the config, sliding-window layers between global ones (each with
its own rotary base), embeddings scaled by sqrt(hidden), the query scale and logit
soft-capping (``ModelArch.gemma_norms`` and friends)."""

from torch import nn

from xlserve.layers.mlp import MLP
from xlserve.layers.norm import GemmaRMSNorm
from xlserve.layers.rotary import PositionEncoding
from xlserve.models.arch import ModelArch
from xlserve.models.llama import LANGUAGE_MODEL_RENAMES, TOWERS, Attention, LlamaForCausalLM


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, positional: PositionEncoding, qkv_bias: bool, qk_norm: bool, index: int):
        super().__init__()
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)  # on the attention output, before the residual
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = Attention(arch, positional, qkv_bias, qk_norm, index)
        self.mlp = MLP(size, arch.intermediate_size, arch.hidden_act)

    def forward(self, tables, x, meta):
        x = x + self.post_attention_layernorm(self.self_attn(tables, self.input_layernorm(x), meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def one_call_fits(self, rows: int) -> bool:
        return False  # the C decode layer is Llama's

    def step_entry(self) -> None:
        return None  # so is the portable decode step's


class Gemma3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    layer_class = Gemma3DecoderLayer


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint (4B and up), served for text."""
    renames = LANGUAGE_MODEL_RENAMES

    def skips(self, name: str) -> bool:
        return super().skips(name) or name.startswith(TOWERS)
