"""How a checkpoint's tensors land in a decoder's modules: fused projections filled shard by
shard, stacked expert weights, renamed wrappers, tensors another pipeline stage holds
skipped, a weight kept in its block format only where the layer can hold one, and a check
that nothing the model needs is missing."""

from __future__ import annotations

import re
from typing import Iterable

import torch

from xlserve.layers.linear import MergedLinear, copy_checked
from xlserve.layers.moe import EXPERT_PARTS, SparseMoE
from xlserve.layers.quantized import HoldsQuantized, QuantizedExperts, QuantizedWeight

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(\w+)\.weight")
# every expert's projection in one tensor: Llama 4's input-major gate_up / down, GGUF's
# output-major gate / up / down ("_exps")
_ALL_EXPERTS = re.compile(
    r"(.*\.mlp)\.experts\.(gate_up_proj|down_proj|gate_exps|up_exps|down_exps)(_bias|\.bias|\.weight)?")
# checkpoint projection name -> (fused module name, shard id)
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class CheckpointLoading:
    """``load_weights`` for a decoder ``nn.Module`` with ``arch``, ``model.stage``,
    ``stacked_params`` (checkpoint projection -> fused module and shard) and ``renames``."""
    stacked_params: dict = STACKED_PARAMS
    renames: dict[str, str] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in weights:
            if self.skips(name):
                continue
            ours = name
            for theirs, renamed in self.renames.items():
                ours = ours.replace(theirs, renamed)
            if self._elsewhere(ours):  # another pipeline stage's: never read here
                continue
            tensor, name = self.adapt(name, tensor), ours
            target, shard = _param_name(name, self.stacked_params)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.arch.architecture}")
            module = self.get_submodule(target.rsplit(".", 1)[0])
            if isinstance(tensor, (QuantizedWeight, QuantizedExperts)) and not (
                    isinstance(module, (HoldsQuantized, SparseMoE)) and module.keeps_quantized()):
                tensor = tensor.dequantize(param.dtype)  # a layer that reads its weight as a tensor
            if shard is None:
                load_whole = getattr(module, "load_whole", None)  # a tensor-parallel slice of it
                load_whole(param, tensor, name) if load_whole else copy_checked(param, tensor, name)
            elif isinstance(module, SparseMoE):
                loaded |= {(target, filled) for filled in module.load(shard, tensor)}
                continue
            else:
                module.load_shard(param, tensor, shard)
            loaded.add((target, shard))
        expected = self._expected_loads(params)
        missing = sorted(f"{t}[{s}]" if s else t for t, s in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def _elsewhere(self, name: str) -> bool:
        """A checkpoint tensor (by our name) of a module another pipeline stage holds."""
        stage = self.model.stage
        if stage.count == 1:
            return False
        layer = _LAYER.match(name)
        if layer:
            return not stage.holds(int(layer.group(1)))
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is None
        return name.startswith(("model.norm.", "lm_head.")) and not stage.last

    def adapt(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor in our layout (identity unless the family stores it otherwise)."""
        return tensor

    def skips(self, name: str) -> bool:
        """Checkpoint tensors that are not weights of this model (precomputed rotary tables)."""
        return "rotary_emb" in name or (name == "lm_head.weight" and self.arch.tie_word_embeddings)

    def _expected_loads(self, params: dict) -> set:
        expected = set()
        for name in params:
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            prefix = name.rsplit(".", 1)[0]
            module = self.get_submodule(prefix)
            if isinstance(module, SparseMoE) and name.rsplit(".", 1)[1] in ("w_gate_up", "w_down", "b_gate_up",
                                                                           "b_down"):
                expected |= {load for load in module.expected_loads(prefix) if load[0] == name}
                continue
            shards = module.shard_offsets if isinstance(module, MergedLinear) else {None: None}
            expected |= {(name, s) for s in shards}
        return expected


def _param_name(name: str, stacked_params: dict) -> tuple[str, object]:
    """Our parameter for a checkpoint tensor, and the shard of it the tensor fills: a part
    of a fused projection, (expert, part) of a stacked expert weight, or None (all of it)."""
    m = _EXPERT.fullmatch(name)
    if m:
        stacked, part = EXPERT_PARTS[m.group(3)]
        return f"{m.group(1)}.{stacked}", (int(m.group(2)), part)
    m = _ALL_EXPERTS.fullmatch(name)
    if m:
        bias = m.group(3) in ("_bias", ".bias")
        stacked = ("b_" if bias else "w_") + ("down" if m.group(2).startswith("down") else "gate_up")
        return f"{m.group(1)}.{stacked}", (None, m.group(2) + ("_bias" if bias else ""))
    for proj, (fused, shard_id) in stacked_params.items():
        if f".{proj}." in name:
            return name.replace(f".{proj}.", f".{fused}."), shard_id
    return name, None
