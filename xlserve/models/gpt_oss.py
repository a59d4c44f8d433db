"""gpt-oss (``GptOssForCausalLM``): the Llama decoder with, from the config, sliding-window
layers between full ones, attention sinks, biases on every projection, and experts routed
by a softmax over the top-k logits with a clamped SwiGLU and biases. This class maps the
checkpoint: the router's name, and the experts' gate/up columns (and biases), which
alternate gate, up, gate, up..., into our gate-then-up layout.

The published checkpoints keep the experts in MXFP4: the loader dequantizes them
(``loader/checkpoint_quantization.py``), as it does their GGUF conversion (with ``gguf``)."""

import torch

from xlserve.loader.lazy_tensor import whole
from xlserve.models.llama import LlamaForCausalLM


class GptOssForCausalLM(LlamaForCausalLM):
    renames = {".mlp.router.": ".mlp.gate.", ".self_attn.sinks.weight": ".self_attn.sinks"}  # HF, GGUF

    def adapt(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(("_blocks", "_scales")):
            raise ValueError(f"{name}: an MXFP4 tensor in a checkpoint whose config has no mxfp4 quantization_config")
        if name.endswith((".experts.gate_up_proj", ".experts.gate_up_proj_bias")):
            tensor = whole(tensor)
            return torch.cat((tensor[..., ::2], tensor[..., 1::2]), dim=-1)
        return tensor
