"""DeepSeek-V3 and Kimi K2 (``DeepseekV3ForCausalLM``): the Llama decoder with multi-head
latent attention (``layers/mla.py``) and, after ``first_k_dense_replace`` dense layers,
sigmoid-routed experts plus shared experts (``layers/moe.py``) — all chosen from the
config, so this class only maps the checkpoint's names."""

import re

from xlserve.models.llama import LANGUAGE_MODEL_RENAMES, STACKED_PARAMS, TOWERS, LlamaForCausalLM

_LAYER = re.compile(r"(?:language_model\.)?model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    # q, k and v are not fused here: MLA's projections keep their checkpoint names
    stacked_params = {k: v for k, v in STACKED_PARAMS.items() if k in ("gate_proj", "up_proj")}
    renames = {".mlp.shared_experts.": ".mlp.shared_expert."}

    def skips(self, name: str) -> bool:
        """Also the multi-token-prediction layers stored after the last decoder layer (layer
        61 of DeepSeek-V3's 61): a draft head, not part of the model's forward."""
        layer = _LAYER.match(name)
        return super().skips(name) or (layer is not None and int(layer.group(1)) >= self.arch.num_layers)


class KimiK25ForCausalLM(DeepseekV3ForCausalLM):
    """The language model of Kimi K2.5 (``KimiK25ForConditionalGeneration``): DeepSeek-V3 under
    ``language_model.``, its vision tower and projector skipped."""
    renames = {**LANGUAGE_MODEL_RENAMES, **DeepseekV3ForCausalLM.renames}

    def skips(self, name: str) -> bool:
        return super().skips(name) or name.startswith((*TOWERS, "mm_projector."))
