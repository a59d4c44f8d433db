"""Llama 4 (text; ``Llama4ForCausalLM``, and the language model of
``Llama4ForConditionalGeneration`` checkpoints): the Llama decoder with, from the config,
chunked-attention rotary layers (interleaved pairs, q/k L2-normed), global layers without
rotary whose queries get a temperature, and MoE layers whose one routed expert sees its
input scaled by the router's sigmoid beside an ungated shared expert. This class maps the
checkpoint's names (``feed_forward``, all experts stacked in one tensor) and skips the
vision tower."""

from xlserve.models.llama import LlamaForCausalLM

_VISION = ("vision_model.", "multi_modal_projector.", "model.vision_model.", "model.multi_modal_projector.")


class Llama4ForCausalLM(LlamaForCausalLM):
    renames = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
               "model.language_model.": "model.", ".feed_forward.router.": ".mlp.gate.", ".feed_forward.": ".mlp."}

    def skips(self, name: str) -> bool:
        return super().skips(name) or name.startswith(_VISION)
