"""gpt-oss (``GptOssForCausalLM``): the Llama decoder with, from the config, sliding-window
layers between full ones, attention sinks, biases on every projection, and experts routed
by a softmax over the top-k logits with a clamped SwiGLU and biases. This class maps the
checkpoint: router and expert biases by name, and the experts' gate/up columns, which
alternate gate, up, gate, up..., into our gate-then-up layout.

Weights must be unquantized (bf16 or float32); the MXFP4 expert blocks of the published
checkpoints need a dequantizing loader first."""

import torch

from xlserve.models.llama import LlamaForCausalLM


class GptOssForCausalLM(LlamaForCausalLM):
    renames = {".mlp.router.": ".mlp.gate.", ".mlp.experts.gate_up_proj_bias": ".mlp.b_gate_up",
               ".mlp.experts.down_proj_bias": ".mlp.b_down"}

    def adapt(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(("_blocks", "_scales")):
            raise ValueError(f"{name}: MXFP4-quantized experts are not supported yet; use a bf16 checkpoint")
        if name.endswith((".experts.gate_up_proj", ".experts.gate_up_proj_bias")):
            return torch.cat((tensor[..., ::2], tensor[..., 1::2]), dim=-1)
        return tensor
