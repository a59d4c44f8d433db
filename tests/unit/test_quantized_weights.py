"""GGUF block-quantized weights kept as stored: the torch dequantizer and the C kernel (each
instruction-set build this CPU runs) against gguf-py's reference dequantization."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from xlserve.kernels import gguf_blocks, portable_library, quant_ops
from xlserve.kernels.gguf_blocks import INTERLEAVABLE, LAYOUTS, X16, BlockType

HALF_FIELDS = {BlockType.Q8_0: [0], BlockType.Q4_0: [0], BlockType.Q4_1: [0, 2], BlockType.Q4_K: [0, 2],
               BlockType.Q5_K: [0, 2], BlockType.Q6_K: [208]}
EIGHT_BIT_ACTIVATIONS = {BlockType.Q4_0, BlockType.Q4_1, BlockType.Q8_0}
BUILDS = [isa for isa in portable_library.available_isas() if portable_library.library(isa) is not None]
FILE_TYPES = [t for t in BlockType if not t & X16]  # xlserve's interleaved types are never in a file


def eight_bit_reference(qtype: BlockType, data: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ w.T with x rounded to 8 bits per 32 values as llama.cpp rounds it (d = max|x| / 127
    and d * sum(q) as float16), computed in float64; and the sum of the terms' magnitudes."""
    blocks = data.numpy().reshape(data.shape[0], -1, LAYOUTS[qtype].bytes)
    d_w = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    if qtype is BlockType.Q8_0:
        q_w = blocks[..., 2:34].view(np.int8).astype(np.float64)
    else:
        nibbles = blocks[..., 4:20] if qtype is BlockType.Q4_1 else blocks[..., 2:18]
        q_w = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.float64)
        q_w -= 8 if qtype is BlockType.Q4_0 else 0
    xb = x.numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    q_x = np.rint(xb * inverse).astype(np.float64)  # float32 product, rounded half to even
    d_x = (amax[..., 0] / np.float32(127)).astype(np.float16).astype(np.float64)
    dots = np.einsum("mbj,nbj->mnb", q_x, q_w)
    scale = d_x[:, None, :] * d_w[None, :, :]
    terms, sizes = dots * scale, np.einsum("mbj,nbj->mnb", np.abs(q_x), np.abs(q_w)) * np.abs(scale)
    if qtype is BlockType.Q4_1:
        m_w = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        s_x = (amax[..., 0] / np.float32(127) * q_x.sum(-1).astype(np.float32)).astype(np.float16).astype(np.float64)
        terms, sizes = terms + m_w[None] * s_x[:, None], sizes + np.abs(m_w[None] * s_x[:, None])
    return torch.from_numpy(terms.sum(-1)), torch.from_numpy(sizes.sum(-1))


def random_rows(qtype: BlockType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, row bytes] of random blocks whose float16 fields are finite scales (BF16: finite values)."""
    layout = LAYOUTS[qtype]
    rng = np.random.default_rng(seed)
    if qtype is BlockType.BF16:
        values = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
        return values.to(torch.bfloat16).view(torch.uint8)
    blocks = rng.integers(0, 256, size=(n * k // layout.values, layout.bytes), dtype=np.uint8)
    for at in HALF_FIELDS[qtype]:
        blocks[:, at:at + 2] = (rng.standard_normal((blocks.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


def reference(qtype: BlockType, data: torch.Tensor, k: int) -> torch.Tensor:
    values = gguf_dequantize(data.numpy(), GGMLQuantizationType(int(qtype)))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(data.shape[0], k)


@pytest.mark.parametrize("qtype", FILE_TYPES)
def test_torch_dequantization_is_exact(qtype):
    data = random_rows(qtype, 6, 512)
    assert torch.equal(gguf_blocks.dequantize(qtype, data, 512), reference(qtype, data, 512))


def test_a_row_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        gguf_blocks.row_bytes(BlockType.Q4_K, 288)


@pytest.mark.skipif(not BUILDS, reason="no C compiler or not an x86-64 CPU with AVX2")
@pytest.mark.parametrize("isa", BUILDS, ids=lambda isa: isa.value)
@pytest.mark.parametrize("qtype", FILE_TYPES)
@pytest.mark.parametrize("eight_bit", [False, True], ids=["fp32-activations", "int8-activations"])
def test_kernel_dequantizes_exactly_and_multiplies_within_tolerance(isa, qtype, eight_bit):
    """Exact dequantized values; products within fp32 rounding of the exact product, or, with
    8-bit activations (Q4_0, Q4_1, Q8_0, as llama.cpp computes them), of the scheme's own
    product, itself within bf16's error of the exact one; for 1 to 64 rows (register, tile
    and integer paths); a row's result the same bits whatever else is in the batch."""
    lib = portable_library.library(isa)
    # a last tile of one row; for the 32-value formats 49 blocks (the VNNI path's groups of 4
    # end in a group of one, and the Q4_1 register path's scales come in two chunks of blocks:
    # 32, then 17), 7 (a group of 4, then 3) and 3 (one group of 3)
    for k in (512,) if LAYOUTS[qtype].values == 256 else (1568, 224, 96):
        check_kernel_rows(lib, qtype, eight_bit, 37, k)


def check_kernel_rows(lib, qtype: BlockType, eight_bit: bool, n: int, k: int, interleaved: bool = False) -> None:
    """``interleaved``: the kernel for 16 interleaved rows (always 8-bit) on the same rows."""
    data = random_rows(qtype, n, k, seed=int(qtype))
    ref = reference(qtype, data, k)
    if interleaved:
        qtype, data = INTERLEAVABLE[qtype], gguf_blocks.interleave16(qtype, data)
        assert torch.equal(gguf_blocks.dequantize(qtype, data, k), ref)  # the torch path of other devices
    ids = torch.tensor([5, 0, n - 1, 5])
    assert torch.equal(quant_ops.dequantize_rows(lib, qtype, data, ids, k), ref[ids])
    x = torch.randn(200, k)
    expected, magnitude, tolerance = x.double() @ ref.double().T, x.double().abs() @ ref.double().abs().T, 1e-6
    if interleaved or (eight_bit and qtype in EIGHT_BIT_ACTIVATIONS):
        scheme, sizes = eight_bit_reference(BlockType(qtype & ~X16), gguf_blocks.deinterleave16(qtype, data)
                                            if interleaved else data, x)
        if k >= 1024:  # the rounding errors of many blocks average out
            assert ((scheme - expected).abs() <= 2 ** -8 * magnitude).all()
        expected, magnitude, tolerance = scheme, sizes, 2 ** -20
    alone = None
    # every register kernel (1-8 rows), the tile path; 200 rows: passes over the rows (K 1,568: of 80)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 17, 64, 200):
        out = torch.full((m, n + 3), float("nan"))
        quant_ops.linear(lib, qtype, x[:m], data, out, 2, eight_bit)
        assert torch.isnan(out[:, :2]).all() and torch.isnan(out[:, -1]).all()  # only its columns written
        got = out[:, 2:2 + n]
        assert ((got.double() - expected[:m]).abs() <= tolerance * magnitude[:m]).all()
        alone = got[:1].clone() if alone is None else alone
        assert torch.equal(got[:1], alone), "row 0 depends on the batch it is in"


@pytest.mark.parametrize("qtype", sorted(INTERLEAVABLE))
def test_interleaving_16_rows_keeps_the_size_and_is_undone_exactly(qtype):
    data = random_rows(qtype, 48, 224)
    packed = gguf_blocks.interleave16(qtype, data)
    assert packed.shape == data.shape and not torch.equal(packed, data)
    assert torch.equal(gguf_blocks.deinterleave16(INTERLEAVABLE[qtype], packed), data)
    with pytest.raises(ValueError, match="interleave 16"):
        gguf_blocks.interleave16(qtype, data[:40])


@pytest.mark.parametrize("qtype", list(INTERLEAVABLE))
def test_rows_of_an_interleaved_weight_are_looked_up_by_torch_as_by_the_kernel(qtype):
    """An embedding lookup with the kernels off (or no compiler) on a weight interleaved 16 rows
    at a time (a tied Q8_0 embedding on the tiles, or with 8-bit activations): the groups
    holding the rows are dequantized whole, so each row is the file's row."""
    from xlserve.kernels import cpu_ops
    from xlserve.layers.quantized import Part, QuantizedWeight
    data = random_rows(qtype, 48, 64, seed=5)
    weight = QuantizedWeight((48, 64), [Part(0, INTERLEAVABLE[qtype], gguf_blocks.interleave16(qtype, data))])
    ids = torch.tensor([[47, 0, 17], [16, 3, 47]])
    expected = reference(qtype, data, 64)[ids]
    cpu_ops.set_enabled(False)
    try:
        by_torch = weight.embedding(ids)
    finally:
        cpu_ops.set_enabled(True)
    assert torch.equal(by_torch, expected)
    if portable_library.kernels() is not None:
        assert torch.equal(weight.embedding(ids), expected)


@pytest.mark.parametrize("isa", BUILDS, ids=lambda isa: isa.value)
@pytest.mark.parametrize("qtype", sorted(INTERLEAVABLE))
def test_kernel_of_16_interleaved_rows_computes_the_8_bit_scheme(qtype, isa):
    """The same bounds as the row-major 8-bit kernel: within 2^-20 of the scheme in float64,
    1 to 64 rows, a row the same bits alone or batched, the rows read back exactly. Every
    build: the VNNI builds' kernel reads a group's 16 rows at once, the others' 8 at a time."""
    for k in (1568, 224, 96):
        check_kernel_rows(portable_library.library(isa), qtype, True, 48, k, interleaved=True)


@pytest.mark.skipif(not BUILDS, reason="no C compiler or not an x86-64 CPU with AVX2")
@pytest.mark.parametrize("qtype,eight_bit", [(BlockType.Q4_1, False), (BlockType.Q4_1, True), (BlockType.Q6_K, False),
                                             (BlockType.Q4_1_X16, True)])
def test_kernel_result_does_not_depend_on_the_thread_count(qtype, eight_bit):
    lib = portable_library.library(BUILDS[0])
    data, x = random_rows(BlockType(qtype & ~X16), 64, 1024), torch.randn(6, 1024)
    data = gguf_blocks.interleave16(BlockType(qtype & ~X16), data) if qtype & X16 else data
    results, before = [], torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.empty(6, 64)
            quant_ops.linear(lib, qtype, x, data, out, 0, eight_bit)
            results.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(*results)


# A tiny Llama stored the way a llama.cpp quantization mix stores it: every kept format, a
# fused q/k/v whose pieces differ in format, F32 norms, rows of 256 values (K-quants).
MIX = {"attn_q": BlockType.Q4_K, "attn_k": BlockType.Q6_K, "attn_v": BlockType.Q8_0, "attn_output": BlockType.Q5_K,
       "ffn_gate": BlockType.Q4_0, "ffn_up": BlockType.Q4_1, "ffn_down": BlockType.Q6_K}
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "vocab_size": 384}


def write_mixed_gguf(out: str, mix: dict, embedding_type: BlockType) -> int:
    """The file, and the bytes of its quantized tensors."""
    import gguf

    from tests.unit.gguf_writing import add_header, finish, gguf_writer
    w = gguf_writer(out, "llama", TINY["vocab_size"])
    add_header(w, TINY, rope_freq_base=10000.0, eos_token_id=2)
    h, i, kv = TINY["hidden_size"], TINY["intermediate_size"], 2 * 64
    shapes = {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h),
              "ffn_gate": (i, h), "ffn_up": (i, h), "ffn_down": (h, i)}
    stored = 0
    for layer in range(TINY["num_hidden_layers"]):
        w.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(h, dtype=np.float32))
        for part, qtype in mix.items():
            rows = random_rows(qtype, *shapes[part], seed=layer * 10 + int(qtype)).numpy()
            w.add_tensor(f"blk.{layer}.{part}.weight", rows, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
            stored += rows.nbytes
    embedding = random_rows(embedding_type, TINY["vocab_size"], h, seed=99).numpy()
    w.add_tensor("token_embd.weight", embedding, raw_dtype=gguf.GGMLQuantizationType(int(embedding_type)))  # tied
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    finish(w)
    return stored + embedding.nbytes


PARAMS = dict(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
PROMPTS = [list(range(3, 3 + n)) for n in (5, 40, 17)]


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("quantized") / "mixed.gguf")
    return path, write_mixed_gguf(path, MIX, BlockType.Q8_0)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32-activations", "int8-activations"])
def test_a_file_kept_as_stored_holds_its_bytes_and_is_batch_invariant(mixed_gguf, int8):
    """Bit for bit: alone or batched, chunked or not, after a prefix hit (the engine's
    attention and these matmuls reduce each row in one order)."""
    from xlserve import LLM, SamplingParams
    from xlserve.layers.quantized import QuantizedWeight
    path, stored = mixed_gguf
    kept = LLM(path, dtype="float32", kv_cache_tokens=1024, int8_activations=int8)
    model = kept.engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    interleaved = int8 and portable_library.kernels() is not None  # 8-bit activations: Q8_0 rows 16 at a time
    v_type = BlockType.Q8_0_X16 if interleaved else BlockType.Q8_0
    assert isinstance(qkv, QuantizedWeight) and [p.qtype for p in qkv.parts] == [BlockType.Q4_K, BlockType.Q6_K, v_type]
    assert model.lm_head.weight.parts[0].data is model.model.embed_tokens.weight.parts[0].data  # tied, one copy
    held = {id(m.weight.parts[0].data): m.weight.nbytes for m in model.modules()
            if isinstance(getattr(m, "weight", None), QuantizedWeight)}
    assert sum(held.values()) == stored  # resident weights are the file's bytes, not a dequantized copy
    params = SamplingParams(**PARAMS)
    batched = [o.outputs[0] for o in kept.generate(PROMPTS, params)]
    alone = [kept.generate(p, params)[0].outputs[0] for p in PROMPTS]  # prefix hits now
    chunked = LLM(path, dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=16, enable_prefix_caching=False,
                  int8_activations=int8)
    for other in (alone, [o.outputs[0] for o in chunked.generate(PROMPTS, params)]):
        assert [o.token_ids for o in other] == [o.token_ids for o in batched]
        assert [[lp["logprob"] for lp in o.logprobs] for o in other] == [[lp["logprob"] for lp in o.logprobs]
                                                                          for o in batched]


def test_kept_as_stored_computes_what_the_dequantized_weights_do(mixed_gguf):
    from xlserve import LLM, SamplingParams
    kept, plain = (LLM(mixed_gguf[0], dtype="float32", quantization=q, kv_cache_tokens=1024) for q in ("auto", "none"))
    a, b = kept.generate(PROMPTS, SamplingParams(**PARAMS)), plain.generate(PROMPTS, SamplingParams(**PARAMS))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert abs(lx["logprob"] - ly["logprob"]) < 1e-4


def test_the_torch_path_of_cuda_and_compilerless_cpus_computes_the_same(mixed_gguf):
    """With the C kernels off, every part is dequantized by torch before its matmul (what
    CUDA runs): the same tokens, logprobs within fp32 rounding."""
    from xlserve import LLM, SamplingParams
    from xlserve.kernels import cpu_ops
    kept = LLM(mixed_gguf[0], dtype="float32", kv_cache_tokens=1024)
    expected = kept.generate(PROMPTS, SamplingParams(**PARAMS))
    cpu_ops.set_enabled(False)
    try:
        got = kept.generate(PROMPTS, SamplingParams(**PARAMS))
    finally:
        cpu_ops.set_enabled(True)
    for x, y in zip(got, expected):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert abs(lx["logprob"] - ly["logprob"]) < 1e-4


@pytest.mark.skipif(not BUILDS, reason="no C compiler or not an x86-64 CPU with AVX2")
def test_bf16_weights_stay_bf16_where_the_model_computes_in_float32(tmp_path):
    """A BF16 file on a CPU computing in float32 (no bf16 math, or ``--dtype float32``) keeps
    its matmul weights as stored, half the bytes of a float32 copy, widened exactly in the
    kernels: the dequantized model's tokens and logprobs. In bfloat16 they are plain tensors."""
    from xlserve import LLM, SamplingParams
    from xlserve.layers.quantized import QuantizedWeight
    path = str(tmp_path / "bf16.gguf")
    stored = write_mixed_gguf(path, {part: BlockType.BF16 for part in MIX}, BlockType.BF16)
    kept, plain = (LLM(path, dtype="float32", quantization=q, kv_cache_tokens=1024) for q in ("auto", "none"))
    weights = {m.weight.parts[0].data.data_ptr(): m.weight for m in kept.engine.runner.model.modules()
               if isinstance(getattr(m, "weight", None), QuantizedWeight)}
    assert {p.qtype for w in weights.values() for p in w.parts} == {BlockType.BF16}
    assert sum(w.nbytes for w in weights.values()) == stored  # the file's bytes; the tied head shares them
    assert not any(isinstance(getattr(m, "weight", None), QuantizedWeight) for m in plain.engine.runner.model.modules())
    a, b = kept.generate(PROMPTS, SamplingParams(**PARAMS)), plain.generate(PROMPTS, SamplingParams(**PARAMS))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert abs(lx["logprob"] - ly["logprob"]) < 1e-4
    in_bf16 = LLM(path, dtype="bfloat16", kv_cache_tokens=1024).engine.runner.model
    assert not any(isinstance(getattr(m, "weight", None), QuantizedWeight) for m in in_bf16.modules())


@pytest.mark.skipif(not BUILDS, reason="no C compiler or not an x86-64 CPU with AVX2")
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_bf16_checkpoint_computing_in_float32_keeps_its_matrices(tiny_model_dirs, tmp_path, arch):
    """The same for a Hugging Face checkpoint saved in bfloat16 (experts too)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from xlserve import LLM, SamplingParams
    from xlserve.layers.quantized import kept_weights
    src, dst = tiny_model_dirs[arch], tmp_path / "bf16"
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    save_file({name: t.to(torch.bfloat16) for name, t in state.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    kept, plain = (LLM(str(dst), dtype="float32", quantization=q, kv_cache_tokens=1024) for q in ("auto", "none"))
    held = kept_weights(kept.engine.runner.model)
    assert held and {p.qtype for w in held for p in w.parts} == {BlockType.BF16}
    assert not kept_weights(plain.engine.runner.model)
    a, b = kept.generate(PROMPTS, SamplingParams(**PARAMS)), plain.generate(PROMPTS, SamplingParams(**PARAMS))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert abs(lx["logprob"] - ly["logprob"]) < 1e-4


@pytest.mark.skipif(not BUILDS, reason="no C compiler or not an x86-64 CPU with AVX2")
def test_every_build_this_cpu_runs_compiles():
    """A build that fails to compile is left out quietly at run time (the next one serves), so
    the tests above would pass on fewer builds than the CPU has: every one must build here."""
    assert BUILDS == portable_library.available_isas()
