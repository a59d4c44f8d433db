"""Experts kept in the block format their checkpoint stores: a GGUF file's stacked
``ffn_*_exps`` tensors and compressed-tensors' packed INT4 / INT8 weights become
``QuantizedWeight``s per expert, with the values the dequantizing path computes."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

from tests.unit.test_gguf_families import _write_deepseek, tiny_deepseek
from xlserve import LLM, SamplingParams
from xlserve.kernels import gguf_blocks
from xlserve.kernels.gguf_blocks import BlockType, blocks_from_symmetric
from xlserve.layers.moe import SparseMoE
from xlserve.loader.checkpoint_quantization import PackedInt4

INT_CONFIG = {"format": "pack-quantized", "config_groups": {"g": {"weights": {
    "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}


def _packed(values: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' packing: 32 / bits values per int32, lowest bits first, offset by 2^(bits-1)."""
    codes = (values + (1 << (bits - 1))).to(torch.int64).reshape(values.shape[0], -1, 32 // bits)
    words = (codes << (torch.arange(32 // bits) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 64)])
def test_packed_integers_are_kept_as_blocks_holding_the_same_values(bits, group):
    torch.manual_seed(0)
    rows, cols = 6, 256
    values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (rows, cols))
    scale = (torch.rand(rows, cols // group) * 0.02 + 1e-3).to(torch.bfloat16)
    tensors = {"w.weight_scale": scale, "w.weight_shape": torch.tensor([rows, cols])}
    config = {**INT_CONFIG, "config_groups": {"g": {"weights": {**INT_CONFIG["config_groups"]["g"]["weights"],
                                                                "num_bits": bits, "group_size": group}}}}
    fmt = PackedInt4(config)
    name, kept = fmt.keep("w.weight_packed", _packed(values, bits), tensors.__getitem__)
    plain = fmt.dequantize("w.weight_packed", _packed(values, bits), tensors.__getitem__)[1]
    assert name == "w.weight" and [p.qtype for p in kept.parts] == [{4: BlockType.Q4_0, 8: BlockType.Q8_0}[bits]]
    assert torch.equal(kept.dequantize(torch.float32), plain)
    assert torch.equal(plain, values.float() * scale.float().repeat_interleave(group, 1))


def test_values_no_block_holds_exactly_are_left_to_the_dequantizer():
    values = torch.zeros(2, 64, dtype=torch.int64)
    assert blocks_from_symmetric(values, torch.full((2, 2), 1e-30), 4) is None  # below float16's range
    assert blocks_from_symmetric(values, torch.full((2, 2), 1 / 3), 4) is None  # more bits than float16's
    assert blocks_from_symmetric(values, torch.ones(2, 4), 4) is None  # groups of 16: not whole blocks
    assert blocks_from_symmetric(values, torch.ones(2, 2), 2) is None  # no 2-bit block type
    assert blocks_from_symmetric(values, torch.ones(2, 2), 4) is not None


# gate experts in Q8_0, up left float32 (a dense part beside kept ones), down in Q4_1
EXPERT_TYPES = {"gate": int(GT.Q8_0), "up": None, "down": int(GT.Q4_1)}


@pytest.fixture(scope="module")
def experts_gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kept_experts")
    out = str(tmp / "deepseek-quantized-experts.gguf")
    _write_deepseek(tiny_deepseek(tmp), out, split_kv_b=True, expert_types=EXPERT_TYPES)
    return out


def test_gguf_experts_are_kept_as_stored_and_compute_what_dequantized_ones_do(experts_gguf):
    """Each expert shares the file's blocks (one copy of the stacked tensor's bytes); tokens and
    log-probabilities equal the dequantized model's (``quantization="none"``)."""
    from gguf import GGUFReader
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [list(range(10, 40)), list(range(100, 107))]
    kept, plain = (LLM(experts_gguf, dtype="float32", kv_cache_tokens=1024, quantization=q) for q in ("auto", "none"))
    moes = [m for m in kept.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    assert len(moes) == 2 and all(m.kept_experts is not None for m in moes)
    gate_up, down = moes[0].kept_experts[0]
    assert [p.qtype for p in gate_up.parts] == [BlockType.Q8_0, None] and down.parts[0].qtype is BlockType.Q4_1
    stored = sum(int(t.n_bytes) for t in GGUFReader(experts_gguf).tensors
                 if t.name.endswith(("gate_exps.weight", "down_exps.weight")))
    assert sum(sum(p.data.nbytes for p in w.parts if p.qtype is not None)
               for m in moes for pair in m.kept_experts for w in pair) == stored
    assert all(m.kept_experts is None for m in plain.engine.runner.model.modules() if isinstance(m, SparseMoE))
    for x, y in zip(kept.generate(prompts, params), plain.generate(prompts, params)):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        np.testing.assert_allclose([s["logprob"] for s in x.outputs[0].logprobs],
                                   [s["logprob"] for s in y.outputs[0].logprobs], atol=1e-4)


def test_stacked_experts_dequantize_as_gguf_does():
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize

    from xlserve.layers.quantized import QuantizedExperts
    weights = np.random.default_rng(0).standard_normal((3, 4, 64)).astype(np.float32)
    raw = quantize(weights, GT.Q4_0)  # [3, 4, 36]: each row's two blocks
    experts = QuantizedExperts(int(GT.Q4_0), torch.from_numpy(raw.copy()), (3, 4, 64))
    want = torch.from_numpy(gguf_dequantize(raw, GT.Q4_0).copy())
    assert torch.equal(experts.dequantize(torch.float32), want)
    assert torch.equal(experts.expert(1).dequantize(torch.float32), want[1])
    assert experts.expert(2).parts[0].data.data_ptr() == experts.data[2].data_ptr()  # a view, not a copy
    with pytest.raises(ValueError, match="not a"):
        QuantizedExperts(int(GT.Q4_0), torch.from_numpy(raw.copy()), (3, 4, 32))
    assert gguf_blocks.row_bytes(BlockType.Q4_0, 64) == raw.shape[-1]


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["whole-experts-kept", "expert-columns-dequantized"])
def test_two_ranks_keep_whole_experts_and_equal_one(experts_gguf, expert_parallel):
    """With expert parallelism each rank keeps its half of the experts as stored; split by
    columns (a slice of a block is refused) they are dequantized. Either way rank 0's tokens
    are one process's."""
    from tests.unit.test_tensor_parallel import _run
    single, split = _run(experts_gguf), _run(experts_gguf, tensor_parallel_size=2, expert_parallel=expert_parallel)
    for a, b in zip(single, split):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(x["logprob"] - y["logprob"]) <= 1e-4
