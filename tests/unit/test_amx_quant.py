"""Q4_0, Q4_1 and Q8_0 weights against bfloat16 activations on AMX tiles (``gemm_amx_quant.c``)
and, on CPUs without AMX, their twin in FMAs (``gemm_tile_order.c``): a bfloat16 model kept in
those formats takes one or the other on every AVX-512 CPU with AVX512BW (each build this CPU
runs is tested; ``test_tile_order.py`` holds the twin to the tiles' bits). Where neither
builds, the fp32-activation kernel runs instead (test_quantized_weights.py)."""

import numpy as np
import pytest
import torch

from tests.unit.test_quantized_weights import PARAMS, PROMPTS, mixed_gguf, random_rows, reference  # noqa: F401 - a fixture
from xlserve.kernels import gguf_blocks, portable_library, quant_ops
from xlserve.kernels.gguf_blocks import INTERLEAVABLE, LAYOUTS, BlockType

LIB = portable_library.kernels()
TILE_BUILDS = [isa for isa in portable_library.available_isas()
               if portable_library.library(isa) is not None and portable_library.library(isa).xl_tile_order_ready()]
pytestmark = pytest.mark.skipif(not TILE_BUILDS, reason="no AVX-512 build with AVX512BW: the fp32-activation kernel")


def scale_sizes(qtype: BlockType, data: torch.Tensor) -> torch.Tensor:
    """Per weight value, 32 |d| + |m| of its block: what the kernel's terms 16 d (1 + q / 16) and
    m - 16 d can reach, so the bound on its rounding (Q8_0: 128 |d|, its d q)."""
    blocks = data.numpy().reshape(data.shape[0], -1, LAYOUTS[qtype].bytes)
    def half(at: int) -> np.ndarray:
        return np.abs(blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float64))
    d = half(0)
    if qtype is BlockType.Q8_0:
        return torch.from_numpy(np.repeat(128 * d, 32, axis=-1))
    m = half(2) if qtype is BlockType.Q4_1 else 8 * d
    return torch.from_numpy(np.repeat(32 * d + m, 32, axis=-1))


@pytest.mark.parametrize("isa", TILE_BUILDS, ids=lambda isa: isa.value)
@pytest.mark.parametrize("qtype", [BlockType.Q4_0, BlockType.Q4_1, BlockType.Q8_0])
def test_tile_kernel_multiplies_bf16_rows_within_fp32_rounding_and_alone_as_batched(qtype, isa):
    """1 to 70 rows (one tile of rows, several, a last one part-filled): within fp32 rounding of
    the bfloat16 rows' exact product with the dequantized weights; a row the same bits alone,
    batched and on one thread or two. The AMX build on the tiles, the others on the twin."""
    lib = portable_library.library(isa)
    n, k = 48, 1536
    data = random_rows(qtype, n, k, seed=int(qtype))
    ref = reference(qtype, data, k).double()
    packed = gguf_blocks.interleave16(qtype, data)
    x = torch.randn(70, k).bfloat16().float()
    expected = x.double() @ ref.T
    bound = 2 ** -18 * (x.double().abs() @ scale_sizes(qtype, data).T)
    alone = None
    for m in (1, 2, 5, 16, 17, 40, 70):
        out = torch.full((m, n + 3), float("nan"))
        quant_ops.linear(lib, INTERLEAVABLE[qtype], x[:m], packed, out, 2, False)
        assert torch.isnan(out[:, :2]).all() and torch.isnan(out[:, -1]).all()  # only its columns written
        got = out[:, 2:2 + n]
        assert ((got.double() - expected[:m]).abs() <= bound[:m]).all()
        alone = got[:1].clone() if alone is None else alone
        assert torch.equal(got[:1], alone), "row 0 depends on the batch it is in"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = torch.empty(40, n)
        quant_ops.linear(lib, INTERLEAVABLE[qtype], x[:40], packed, one_thread, 0, False)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one_thread, out[:40, 2:2 + n])


@pytest.mark.skipif(LIB is None or not LIB.xl_tile_order_ready(), reason="this CPU's build has no tile kernel")
def test_a_bf16_model_kept_in_these_formats_takes_the_tiles_and_is_batch_invariant(mixed_gguf):  # noqa: F811
    """The mixed file's Q4_0 / Q4_1 / Q8_0 parts (its gate and up projections, its v projection,
    its tied embedding and head) interleaved for the tiles (or their twin) as a bfloat16 model
    loads, the tied ones still one copy; its output the same bits alone, batched, chunked and
    after a prefix hit."""
    from xlserve import LLM, SamplingParams
    path, _ = mixed_gguf
    kept = LLM(path, dtype="bfloat16", kv_cache_tokens=1024)
    model = kept.engine.runner.model
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    assert [p.qtype for p in gate_up.parts] == [BlockType.Q4_0_X16, BlockType.Q4_1_X16]
    assert model.model.layers[0].self_attn.qkv_proj.weight.parts[-1].qtype is BlockType.Q8_0_X16
    head, embedding = model.lm_head.weight.parts[0], model.model.embed_tokens.weight.parts[0]
    assert head.qtype is BlockType.Q8_0_X16 and head.data is embedding.data
    params = SamplingParams(**PARAMS)
    batched = [o.outputs[0] for o in kept.generate(PROMPTS, params)]
    alone = [kept.generate(p, params)[0].outputs[0] for p in PROMPTS]
    chunked = LLM(path, dtype="bfloat16", kv_cache_tokens=1024, max_num_batched_tokens=16, enable_prefix_caching=False)
    for other in (alone, [o.outputs[0] for o in chunked.generate(PROMPTS, params)]):
        assert [o.token_ids for o in other] == [o.token_ids for o in batched]
        assert [[lp["logprob"] for lp in o.logprobs] for o in other] == [[lp["logprob"] for lp in o.logprobs]
                                                                          for o in batched]
