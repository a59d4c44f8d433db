"""Llama 4 (text; ``Llama4ForCausalLM``, and the language model of
``Llama4ForConditionalGeneration`` checkpoints): the Llama decoder with, from the config,
chunked-attention rotary layers (interleaved pairs, q/k L2-normed), global layers without
rotary whose queries get a temperature, and MoE layers whose one routed expert sees its
input scaled by the router's sigmoid beside an ungated shared expert. This class maps the
checkpoint's names (``feed_forward``, all experts stacked in one tensor) and skips the
vision tower."""

from xlserve.models.llama import LANGUAGE_MODEL_RENAMES, TOWERS, LlamaForCausalLM


class Llama4ForCausalLM(LlamaForCausalLM):
    renames = {**LANGUAGE_MODEL_RENAMES, ".feed_forward.router.": ".mlp.gate.", ".feed_forward.": ".mlp."}

    def skips(self, name: str) -> bool:
        return super().skips(name) or name.startswith(TOWERS)
