"""The decode path is chosen once per step, and only among paths that implement every
feature of the model. Decisions are tested without kernels; the engine records the path
each step took."""

import dataclasses

import pytest

from xlserve import LLM, SamplingParams
from xlserve.engine.decode_plan import IMPLEMENTS, DecodePath, StepShape, plan_decode
from xlserve.layers.moe import ROUTES
from xlserve.models.arch import DIMENSIONS, FEATURES, ModelArch, Router

ALL_FAST = StepShape(decode_only=True, rows=2, graph_fits=False, cpu_kernels=True, one_call_fits=True)
PORTABLE = StepShape(decode_only=True, rows=2, graph_fits=False, cpu_kernels=False, one_call_fits=False,
                     portable_fits=True)


def test_every_model_flag_is_declared_by_every_path():
    """A ModelArch field added without saying whether it is a size or a feature, and so
    without every path declaring whether it implements it, fails here."""
    fields = {f.name for f in dataclasses.fields(ModelArch)}
    assert fields == DIMENSIONS | FEATURES and not DIMENSIONS & FEATURES
    assert set(IMPLEMENTS) == set(DecodePath)
    assert set(ROUTES) == set(Router)  # every router kind a config can name has its routing
    assert all(implemented <= FEATURES for implemented in IMPLEMENTS.values())


@pytest.mark.parametrize("step,features,expected", [
    (ALL_FAST, frozenset(), DecodePath.ONE_CALL),
    (ALL_FAST, frozenset({"attention_bias", "tie_word_embeddings"}), DecodePath.ONE_CALL),  # Qwen2
    (ALL_FAST, frozenset({"qk_norm"}), DecodePath.FUSED_LAYERS),  # Qwen3: the C layer has no q/k norm
    (dataclasses.replace(ALL_FAST, one_call_fits=False), frozenset(), DecodePath.FUSED_LAYERS),
    (dataclasses.replace(ALL_FAST, decode_only=False), frozenset(), DecodePath.EAGER),  # a prefill chunk
    (dataclasses.replace(ALL_FAST, rows=65), frozenset(), DecodePath.EAGER),
    (dataclasses.replace(ALL_FAST, cpu_kernels=False), frozenset(), DecodePath.EAGER),  # no AVX-512 / library
    (dataclasses.replace(ALL_FAST, graph_fits=True, cpu_kernels=False), frozenset({"qk_norm"}),
     DecodePath.CUDA_GRAPH),
    # CPUs without the AVX-512 kernels: the portable one-call step, or eager where it does not fit
    (PORTABLE, frozenset({"attention_bias", "tie_word_embeddings", "rope_scaling"}), DecodePath.PORTABLE_ONE_CALL),
    (PORTABLE, frozenset({"qk_norm"}), DecodePath.EAGER),
    (dataclasses.replace(PORTABLE, rows=65), frozenset(), DecodePath.PORTABLE_ONE_CALL),  # its own limit
    (dataclasses.replace(PORTABLE, rows=97), frozenset(), DecodePath.EAGER),
    (dataclasses.replace(PORTABLE, decode_only=False), frozenset(), DecodePath.EAGER),
])
def test_the_fastest_path_that_takes_the_step_and_the_model(step, features, expected):
    assert plan_decode(step, features, max_fused_rows=64, max_portable_rows=96) is expected


def test_the_portable_step_takes_the_fused_limit_unless_given_its_own():
    assert plan_decode(dataclasses.replace(PORTABLE, rows=65), frozenset(), 64) is DecodePath.EAGER


def test_a_feature_no_fast_path_implements_keeps_the_model_eager():
    new_feature = frozenset({"sliding_window"})  # say a model family brings one: only eager runs it
    assert plan_decode(ALL_FAST, new_feature, max_fused_rows=64) is DecodePath.EAGER
    assert plan_decode(dataclasses.replace(ALL_FAST, graph_fits=True), new_feature, 64) is DecodePath.EAGER


def test_model_features_come_from_the_config_and_the_class(tiny_model_dirs):
    arch = ModelArch("LlamaForCausalLM", 320, 64, 128, 2, 4, 2, 16, 1e-6, 1e4, 256, True,
                     rope_scaling=(("factor", 8.0), ("rope_type", "llama3")))
    assert arch.features() == {"tie_word_embeddings", "rope_scaling"}
    assert arch.features(qkv_bias=True, qk_norm=True) >= {"attention_bias", "qk_norm"}
    qwen3 = LLM(tiny_model_dirs["qwen3"], kv_cache_tokens=512)
    assert "qk_norm" in qwen3.engine.runner.features
    moe = LLM(tiny_model_dirs["qwen3_moe"], kv_cache_tokens=512).engine.runner.features
    assert {"num_experts", "norm_topk_prob", "mlp_only_layers", "qk_norm"} <= moe
    assert plan_decode(ALL_FAST, moe, max_fused_rows=64) is DecodePath.EAGER  # no fused kernel routes experts


def test_the_engine_records_the_path_of_every_step(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_tokens=1024)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    steps = llm.engine.steps_by_path
    assert sum(steps.values()) == llm.engine.num_steps == 4  # one prefill step, three decode steps
    assert set(steps) <= set(DecodePath) and steps[DecodePath.EAGER] >= 1  # the prefill is eager
