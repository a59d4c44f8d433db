"""The portable one-call decode step (``kernels/decode_step.c``): its row kernels against torch,
and the whole step against the eager path it replaces, bit for bit, for weights kept in their
block formats (fp32 and 8-bit activations) and dense weights under ``--deterministic``, in
float32 and bfloat16, with q/k/v and output biases, alone and batched."""

import functools

import pytest
import torch

from tests.unit.test_quantized_weights import MIX, write_mixed_gguf
from xlserve import LLM, SamplingParams
from xlserve.engine.decode_plan import DecodePath
from xlserve.engine.model_runner import ModelRunner
from xlserve.kernels import cpu_ops, decode_step, invariant_linear, portable_library
from xlserve.kernels.gguf_blocks import BlockType
from xlserve.models.llama import LlamaForCausalLM

BUILDS = [isa for isa in portable_library.available_isas() if portable_library.library(isa) is not None]
TAKEN = bool(BUILDS)  # on AVX-512 CPUs too: its steps come after the AVX-512 one-call layer (bf16 dense only)
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
PROMPTS = [list(range(3, 3 + n)) for n in (5, 40, 17, 2, 9)]  # 5 rows: the threads share them 3 + 2


def _reference_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    y = x.float()
    return w * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.skipif(not BUILDS, reason="no C compiler or not an x86-64 CPU with AVX2")
@pytest.mark.parametrize("isa", BUILDS, ids=lambda isa: isa.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_row_kernels_compute_what_torch_does_one_way_per_row(isa, dtype):
    """Within a rounding of torch's RMSNorm and SiLU * up (widths with and without a tail of
    fewer than a vector's lanes), and a row's bits the same alone or among others."""
    lib = portable_library.library(isa)
    torch.manual_seed(0)
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -20
    for width in (576, 100):
        x, w = torch.randn(9, width).to(dtype) * 3, torch.randn(width).to(dtype)
        got, want = decode_step.rmsnorm(lib, x, w, 1e-5), _reference_rmsnorm(x, w, 1e-5)
        assert ((got.float() - want.float()).abs() <= 2 * ulp * want.float().abs() + 1e-6).all()
        assert torch.equal(decode_step.rmsnorm(lib, x[3:4], w, 1e-5), got[3:4])
        gate_up = torch.cat((torch.randn(9, width) * 40, torch.randn(9, width)), -1).to(dtype)  # far into both tails
        gate, up = gate_up.float().chunk(2, -1)
        got, want = decode_step.silu_mul(lib, gate_up), torch.nn.functional.silu(gate) * up
        assert ((got.float() - want).abs() <= 4 * ulp * want.abs() + 1e-6).all()
        assert torch.equal(decode_step.silu_mul(lib, gate_up[5:6]), got[5:6])


def _generate(llm: LLM, prompts) -> list[tuple]:
    llm.engine.steps_by_path.clear()
    outs = llm.generate(prompts, PARAMS)
    return [(o.outputs[0].token_ids, [lp["logprob"] for lp in o.outputs[0].logprobs]) for o in outs]


def _on_both_paths(llm: LLM, monkeypatch) -> None:
    """The step's tokens and logprobs, batched and alone, are the eager path's bits. The
    AVX-512 kernels stay off in both runs (so they take none of the eager run's decode steps):
    they also compute the prompts, and the two runs must differ in their decode steps only. (Off
    in one run only, the prompts' cached K differed from torch's in its last bits; 8-bit
    activations hid that until a rounding flipped one logprob.)"""
    monkeypatch.setattr(ModelRunner, "_kernels_apply", lambda self: False)
    batched = _generate(llm, PROMPTS)
    assert llm.engine.steps_by_path[DecodePath.PORTABLE_ONE_CALL] > 0
    alone = [_generate(llm, [p])[0] for p in PROMPTS]
    with monkeypatch.context() as patched:
        patched.setattr(LlamaForCausalLM, "step_fits", lambda self: False)
        eager = _generate(llm, PROMPTS)
        assert set(llm.engine.steps_by_path) == {DecodePath.EAGER}
    assert batched == alone == eager


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("decode-step") / "mixed.gguf")
    write_mixed_gguf(path, MIX, BlockType.Q8_0)
    return path


@pytest.mark.skipif(not TAKEN, reason="the portable kernels do not build")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("int8", [False, True], ids=["fp32-activations", "int8-activations"])
def test_kept_quantized_weights_decode_in_one_call_with_the_eager_bits(mixed_gguf, dtype, int8, monkeypatch):
    """Every kept format, a q/k/v projection of three formats (three parts in one entry)."""
    _on_both_paths(LLM(mixed_gguf, dtype=dtype, kv_cache_tokens=1024, int8_activations=int8), monkeypatch)


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory):
    """A tiny Llama with q/k/v and output biases (``attention_bias``), widened off ties."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attention_bias=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.dim() == 1 else p.mul_(4.0)
    path = tmp_path_factory.mktemp("biased-llama")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.mark.skipif(not TAKEN, reason="the portable kernels do not build")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tile_order", [True, False], ids=["tile-order", "fp32-kernel"])
def test_dense_weights_under_deterministic_decode_in_one_call_with_the_eager_bits(biased_llama, dtype, tile_order,
                                                                                  monkeypatch):
    """bf16 weights in the AMX tiles' order (on the tiles where the CPU has them, their twin on
    every other AVX-512 CPU: the step calls the AVX-512 library's kernel through the table) or
    on the fp32 tiles of every CPU."""
    if not tile_order:
        monkeypatch.setattr(invariant_linear, "mark", functools.partial(invariant_linear.mark, tile_order=False))
    llm = LLM(biased_llama, dtype=dtype, kv_cache_tokens=1024, deterministic=True)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.weight
    in_tile_order = tile_order and dtype == "bfloat16" and cpu_ops.kernels() is not None
    assert (decode_step.projection_entry(qkv, qkv.dtype)[2] == decode_step.DENSE_CALL) == in_tile_order
    _on_both_paths(llm, monkeypatch)


@pytest.mark.skipif(not TAKEN, reason="the portable kernels do not build")
def test_dense_weights_without_deterministic_stay_on_the_eager_path(biased_llama):
    """torch multiplies them in the eager path, with a blocking the C step cannot reproduce
    (where the AVX-512 kernels load, their per-layer decode path takes the step)."""
    llm = LLM(biased_llama, dtype="float32", kv_cache_tokens=1024)
    _generate(llm, PROMPTS[:1])
    expected = {DecodePath.EAGER, DecodePath.FUSED_LAYERS} if cpu_ops.kernels() else {DecodePath.EAGER}
    assert set(llm.engine.steps_by_path) == expected


@pytest.mark.skipif(not BUILDS, reason="no C compiler or not an x86-64 CPU with AVX2")
def test_a_table_of_the_wrong_shape_is_refused_before_the_c_step_reads_it():
    lib = portable_library.library(BUILDS[0])
    x, cos = torch.zeros(1, 64), torch.zeros(1, 16)
    slots = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="int64 \\[layers"):
        decode_step.decode_step_(lib, x, torch.zeros(2, 9, dtype=torch.int64), 1e-5, 4, 2, 16, 128, cos, cos,
                                 slots[0], slots, slots[0], 0.25)


@pytest.mark.skipif(not TAKEN, reason="the portable kernels do not build")
def test_a_first_call_with_the_kernels_off_does_not_keep_them_off(monkeypatch):
    """The build is chosen at the first call with the kernels on: an eager comparison first
    (``set_enabled(False)``) once left every later run on torch's paths, and a deterministic
    run lost its batch invariance."""
    monkeypatch.setattr(portable_library, "_chosen", False)
    cpu_ops.set_enabled(False)
    try:
        assert portable_library.kernels() is None
    finally:
        cpu_ops.set_enabled(True)
    assert portable_library.kernels() is not None
