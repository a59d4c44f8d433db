"""Which path a step's forward takes, decided once per step by the model runner and
recorded in the step's metadata (``AttentionMetadata.decode_path``) and its output.

Each fast path states the model features it implements (``models/arch.py:FEATURES``); a
model with a feature a path lacks never takes that path. Every ``ModelArch`` field is
either a size (fast paths check shapes themselves) or a feature — a test fails when a
field is added that is neither, so a new model flag cannot silently ride a kernel that
ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass

from xlserve.layers.attention import DecodePath
from xlserve.models.arch import FEATURES

__all__ = ["IMPLEMENTS", "DecodePath", "StepShape", "plan_decode"]

IMPLEMENTS: dict[DecodePath, frozenset[str]] = {
    DecodePath.CUDA_GRAPH: FEATURES,  # it replays the eager model, whatever that computes
    # the C layer adds the QKV bias and takes rotary tables computed (scaled) in Python; the
    # LM head runs after it; it has no q/k RMSNorm
    DecodePath.ONE_CALL: frozenset({"attention_bias", "tie_word_embeddings", "rope_scaling"}),
    # the same layer (both biases), on the portable kernels
    DecodePath.PORTABLE_ONE_CALL: frozenset({"attention_bias", "tie_word_embeddings", "rope_scaling"}),
    # per layer from Python: q/k norms run in torch between the fused kernels
    DecodePath.FUSED_LAYERS: frozenset({"attention_bias", "qk_norm", "tie_word_embeddings", "rope_scaling"}),
    DecodePath.EAGER: FEATURES,
}


@dataclass(frozen=True)
class StepShape:
    """What the decision needs to know about one step."""
    decode_only: bool  # every scheduled request computes exactly one token
    rows: int
    graph_fits: bool  # a captured CUDA graph covers this batch and context
    cpu_kernels: bool  # the CPU kernels apply (device, dtype, head shapes, library loaded)
    one_call_fits: bool  # the weights and row count suit the one-call C layer
    # the portable kernels run this model's decode step as the eager path computes it (CPU
    # without the AVX-512 kernels, one rank, weights the step takes: models/llama.py:step_entry)
    portable_fits: bool = False


def plan_decode(step: StepShape, features: frozenset[str], max_fused_rows: int,
                max_portable_rows: int | None = None) -> DecodePath:
    """The fastest path that takes this step and implements every feature of the model; the
    portable one-call step takes up to ``max_portable_rows`` rows (default: as the fused)."""
    fused = step.cpu_kernels and step.decode_only and step.rows <= max_fused_rows
    portable = step.portable_fits and step.decode_only and step.rows <= (max_portable_rows or max_fused_rows)
    for path, applies in ((DecodePath.CUDA_GRAPH, step.graph_fits), (DecodePath.ONE_CALL, fused and step.one_call_fits),
                          (DecodePath.PORTABLE_ONE_CALL, portable), (DecodePath.FUSED_LAYERS, fused)):
        if applies and features <= IMPLEMENTS[path]:
            return path
    return DecodePath.EAGER
