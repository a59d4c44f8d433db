"""The fused CPU decode kernels against the eager torch code they replace."""

import shutil

import pytest
import torch

from xlserve.kernels import cpu_ops
from xlserve.layers.linear import linear
from xlserve.layers.norm import RMSNorm
from xlserve.layers.rotary import RotaryEmbedding

needs_kernels = pytest.mark.skipif(cpu_ops.kernels() is None, reason="CPU without AVX-512 or no C compiler")
DTYPES = [torch.float32, torch.bfloat16]


def _close(a, b, dtype):
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    scale = max(1.0, b.float().abs().max().item())
    assert (a.float() - b.float()).abs().max().item() <= tol * scale


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 37, 64])
@pytest.mark.parametrize("shape", [(960, 576), (49, 37), (17, 16), (130, 1536)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_reference(rows, shape, dtype):
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    residual = torch.randn(rows, n, generator=g).to(dtype)
    ref = x.double() @ w.double().T + bias.double() + residual.double()
    got = cpu_ops.linear_bf16(x, w, bias, residual)
    assert got.dtype == dtype and got.shape == (rows, n)
    _close(got, ref, dtype)


needs_amx = pytest.mark.skipif(cpu_ops.kernels() is None or not cpu_ops.amx_ready(), reason="CPU without AMX")
needs_bf16_dot = pytest.mark.skipif(cpu_ops.kernels() is None or not cpu_ops.bf16_dot_ready(),
                                    reason="CPU without AVX512-BF16")
# 5-64 decode rows multiply on AMX tiles or, without AMX, on the row kernel's vdpbf16ps blocks
needs_batched_kernel = pytest.mark.skipif(
    cpu_ops.kernels() is None or not (cpu_ops.amx_ready() or cpu_ops.batched_rows()),
    reason="CPU with neither AMX nor AVX512-BF16")


def _row_kernel_sums(x, w):
    """The row kernel's float32 sums for bf16 ``x`` of any row count (never the AMX tiles)."""
    out = torch.empty(x.shape[0], w.shape[0])
    cpu_ops.kernels().xl_linear_bf16(x.data_ptr(), w.data_ptr(), None, None, out.data_ptr(), x.shape[0],
                                     w.shape[0], w.shape[1], cpu_ops.BF16_X_F32_OUT, 2)
    return out


@needs_bf16_dot
@pytest.mark.parametrize("shape", [(960, 576), (49, 37), (3, 40), (130, 1536)])
def test_bf16_rows_are_the_same_bits_in_any_batch(shape):
    """On vdpbf16ps every output is one dot product in one order, whatever the row count and
    so the blocking (8 x 1-2 streamed, 4 x 1-4 batched, single weight rows at the tail), so
    a row's float32 sum is bit-identical alone or in a batch of up to 64 (tails of N and K
    too), and so is the rounded bf16 output."""
    n, k = shape
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(64, k, generator=g).bfloat16()
    alone = torch.cat([_row_kernel_sums(x[i:i + 1], w) for i in range(64)])
    for rows in (2, 3, 5, 8, 13, 64):
        assert torch.equal(_row_kernel_sums(x[:rows], w), alone[:rows])
    _close(alone, x.double() @ w.double().T, torch.bfloat16)
    assert torch.equal(cpu_ops.linear_bf16(x, w), alone.bfloat16())


@needs_amx
@pytest.mark.parametrize("rows", [1, 4, 5, 16, 17, 33, 64])
@pytest.mark.parametrize("shape", [(960, 576), (96, 1536), (64, 32)])
def test_amx_linear_matches_reference(rows, shape):
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
    bias, residual = torch.randn(n, generator=g).bfloat16(), torch.randn(rows, n, generator=g).bfloat16()
    assert cpu_ops.use_amx(x, w)
    _close(cpu_ops.linear_amx(x, w), x.double() @ w.double().T, torch.bfloat16)
    got = cpu_ops.linear_amx(x, w, bias, residual)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    _close(got, x.double() @ w.double().T + bias.double() + residual.double(), torch.bfloat16)
    # the row kernel's rounding: the product plus bias rounded once, then the residual added
    assert torch.equal(got, (cpu_ops.linear_amx(x, w, bias).float() + residual.float()).bfloat16())


@needs_amx
def test_amx_dispatch():
    w = torch.randn(64, 32).bfloat16()
    assert cpu_ops.use_amx(torch.randn(1, 32).bfloat16(), w)  # one decode row too: faster than the row kernel
    assert cpu_ops.use_amx(torch.randn(cpu_ops.AMX_MAX_ROWS, 32).bfloat16(), w)
    assert not cpu_ops.use_amx(torch.randn(cpu_ops.AMX_MAX_ROWS + 1, 32).bfloat16(), w)
    assert not cpu_ops.use_amx(torch.randn(8, 32).bfloat16(), torch.randn(48, 32).bfloat16())  # N % 32
    assert not cpu_ops.use_amx(torch.randn(8, 32), w.float())


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_rope_silu_match_eager(dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-5).to(dtype)
    norm.weight.data = torch.rand(64, generator=g).to(dtype) + 0.5
    for rows in (3, 70):  # 70: the threaded branch
        x = torch.randn(rows, 64, generator=g).to(dtype)
        cpu_ops.set_enabled(False)  # the module itself takes the kernel on CPU: compare with its eager path
        try:
            eager = norm(x)
        finally:
            cpu_ops.set_enabled(True)
        _close(cpu_ops.rmsnorm(x, norm.weight, norm.eps), eager, dtype)

    rotary = RotaryEmbedding(16, 64, 10000.0, {})
    cos, sin = rotary.tables(torch.tensor([0, 5, 9]), dtype)
    qkv = torch.randn(3, 16 * (4 + 2 + 2), generator=g).to(dtype)
    q, k = qkv[:, :64].reshape(3, 4, 16), qkv[:, 64:96].reshape(3, 2, 16)
    ref_q, ref_k = rotary((cos, sin), q, k)
    rotated = qkv.clone()
    cpu_ops.rope_(rotated, 4, 2, 16, cos, sin)
    _close(rotated[:, :64].reshape(3, 4, 16), ref_q, dtype)
    _close(rotated[:, 64:96].reshape(3, 2, 16), ref_k, dtype)
    assert torch.equal(rotated[:, 96:], qkv[:, 96:])  # v untouched

    gate_up = torch.randn(2, 40, generator=g).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(cpu_ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d,lens", [(6, 2, 32, [5, 17, 1]), (9, 3, 64, [40, 1, 16, 33]),
                                          (8, 2, 128, [70, 3]), (5, 5, 80, [31])])
def test_decode_attention_matches_sdpa(dtype, hq, hk, d, lens):
    g = torch.Generator().manual_seed(1)
    slots_total, rows = 128, len(lens)
    kc = (3 * torch.randn(slots_total, hk, d, generator=g)).to(dtype)  # wide scores: a peaked softmax
    vc = torch.randn(slots_total, hk, d, generator=g).to(dtype)
    lens = torch.tensor(lens)
    slots = torch.zeros(rows, int(lens.max()), dtype=torch.long)
    for b, n in enumerate(lens.tolist()):
        slots[b, :n] = torch.randperm(slots_total, generator=g)[:n]
    qkv = torch.randn(rows, (hq + 2 * hk) * d, generator=g).to(dtype)
    q = qkv[:, :hq * d].view(rows, hq, d)
    k_new = qkv[:, hq * d:(hq + hk) * d].view(rows, hk, d)
    v_new = qkv[:, (hq + hk) * d:].view(rows, hk, d)
    new_slots = torch.tensor([slots[b, n - 1].item() for b, n in enumerate(lens.tolist())])
    got = cpu_ops.decode_attention(q, k_new, v_new, new_slots, kc, vc, slots, lens, d ** -0.5)
    assert torch.equal(kc[new_slots], k_new) and torch.equal(vc[new_slots], v_new)
    for b, n in enumerate(lens.tolist()):
        k = kc[slots[b, :n]].transpose(0, 1).unsqueeze(0)
        v = vc[slots[b, :n]].transpose(0, 1).unsqueeze(0)
        ref = torch.nn.functional.scaled_dot_product_attention(q[b].unsqueeze(0).unsqueeze(2).float(), k.float(),
                                                               v.float(), enable_gqa=True)
        _close(got[b], ref[0, :, 0], dtype)


@needs_kernels
def test_dispatch_and_switch_back_to_eager():
    w = torch.randn(64, 32).bfloat16()
    assert cpu_ops.use_linear(torch.randn(1, 32).bfloat16(), w)
    batch = torch.randn(cpu_ops.LINEAR_MAX_ROWS + 1, 32)
    # more rows take the AMX tiles where they run, the row kernel's batched blocks on AVX512-BF16 without
    assert cpu_ops.use_linear(batch.bfloat16(), w) == cpu_ops.batched_rows()
    assert cpu_ops.use_linear(torch.randn(cpu_ops.BF16_DOT_MAX_ROWS, 32).bfloat16(), w) == cpu_ops.batched_rows()
    assert not cpu_ops.use_linear(torch.randn(cpu_ops.BF16_DOT_MAX_ROWS + 1, 32).bfloat16(), w)
    assert not cpu_ops.use_linear(batch, w)  # fp32 rows: widened, bandwidth-bound, 1-4 only
    assert not cpu_ops.use_linear(torch.randn(1, 32), w.float())
    cpu_ops.set_enabled(False)
    try:
        assert not cpu_ops.use_linear(torch.randn(1, 32).bfloat16(), w)
        x = torch.randn(2, 32).bfloat16()
        assert torch.equal(linear(x, w, None), torch.nn.functional.linear(x, w))
    finally:
        cpu_ops.set_enabled(True)


def _decode(llm_dir, prompts, monkeypatch=None):
    from xlserve import LLM, SamplingParams
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    return [o.outputs[0] for o in LLM(llm_dir, dtype="bfloat16").generate(prompts, params)]


@needs_kernels
def test_one_call_decode_step_matches_eager(tiny_llama_dir, monkeypatch):
    """Decode steps of 1-4 bf16 rows run every layer in one C call; the tokens equal the
    eager torch path's."""
    prompts = [list(range(5, 40)), list(range(60, 90)), list(range(100, 150))]  # no near-tie in bf16
    calls = []
    real = cpu_ops.decode_layers_
    monkeypatch.setattr(cpu_ops, "decode_layers_", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    fused = [o.token_ids for o in _decode(tiny_llama_dir, prompts)]
    assert sorted(set(calls)) == [3]
    cpu_ops.set_enabled(False)
    try:
        eager = [o.token_ids for o in _decode(tiny_llama_dir, prompts)]
    finally:
        cpu_ops.set_enabled(True)
    assert fused == eager


@needs_batched_kernel
def test_one_call_batched_decode_matches_per_layer_path(tiny_llama_dir, monkeypatch):
    """Eight decode rows in one C call (AMX projections, or without AMX the row kernel's
    vdpbf16ps blocks; vectorized SiLU) give the tokens and logprobs of the per-layer path
    that calls the same matmul from Python. (Against eager
    torch this tiny model's bf16 logits tie too often to compare tokens; the real model's
    batched check is in tests/e2e/test_optimized_equals_eager.py.)"""
    from xlserve.models import llama
    prompts = [list(range(5 + 9 * i, 40 + 9 * i)) for i in range(8)]
    calls = []
    real = cpu_ops.decode_layers_
    monkeypatch.setattr(cpu_ops, "decode_layers_", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    one_call = _decode(tiny_llama_dir, prompts)
    assert sorted(set(calls)) == [8]
    whole = llama.DecoderLayer.one_call_fits
    monkeypatch.setattr(llama.DecoderLayer, "one_call_fits",
                        lambda self, rows: rows <= cpu_ops.LINEAR_MAX_ROWS and whole(self, rows))
    per_layer = _decode(tiny_llama_dir, prompts)
    assert [o.token_ids for o in one_call] == [o.token_ids for o in per_layer]
    for a, b in zip(one_call, per_layer):
        assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a.logprobs, b.logprobs)) < 0.05


@needs_kernels
def test_build_falls_back_to_fewer_instruction_sets(monkeypatch, tmp_path):
    """A compiler that refuses the first flag set (an instruction set newer than it) still
    yields the library from the next one."""
    monkeypatch.setenv("XLSERVE_CACHE_DIR", str(tmp_path))
    cpu_ops._cache_dir.cache_clear()
    monkeypatch.setattr(cpu_ops, "_lib", None)
    good = cpu_ops._cflag_sets()[-1]
    monkeypatch.setattr(cpu_ops, "_cflag_sets", lambda: [good + ["-mno-such-instruction-set"], good])
    lib = cpu_ops._build()
    cpu_ops._cache_dir.cache_clear()
    assert lib is not None and len(list(tmp_path.rglob("*.so"))) == 1


@pytest.fixture
def kernel_cache(monkeypatch, tmp_path):
    """A kernel cache directory under test; the module's choice is recomputed around it."""
    def use(path):
        monkeypatch.setenv("XLSERVE_CACHE_DIR", str(path))
        cpu_ops._cache_dir.cache_clear()
    yield use
    cpu_ops._cache_dir.cache_clear()


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")
def test_a_library_planted_in_a_shared_cache_is_never_loaded(kernel_cache, tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    flags = cpu_ops._cflag_sets()[-1]
    shared = tmp_path / "shared"
    (shared / "kernels").mkdir(parents=True)
    for folder in (shared, shared / "kernels"):
        folder.chmod(0o777)  # anyone may write here
    planted = shared / "kernels" / cpu_ops.library_name(flags)
    planted.write_bytes(b"not ours")
    kernel_cache(shared)
    built = cpu_ops.compiled(compiler, flags)
    assert built != planted and built.read_bytes()[:4] == b"\x7fELF" and cpu_ops._private(built.parent)
    mine = tmp_path / "mine"  # a private cache with a group-writable file in it: rebuilt, not trusted
    kernel_cache(mine)
    stale = mine / "kernels" / cpu_ops.library_name(flags)
    cpu_ops._cache_dir()
    stale.write_bytes(b"not ours either")
    stale.chmod(0o666)
    assert cpu_ops.compiled(compiler, flags) == stale and stale.read_bytes()[:4] == b"\x7fELF"
    assert cpu_ops._private(stale) and (mine / "kernels").stat().st_mode & 0o777 == 0o700


@needs_kernels
def test_decode_layers_refuses_a_malformed_address_table():
    x = torch.zeros(1, 64).bfloat16()
    cos = sin = torch.zeros(1, 16).bfloat16()
    idx = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="address table"):
        cpu_ops.decode_layers_(x, torch.zeros(2, cpu_ops.LAYER_POINTERS - 1, dtype=torch.int64), 1e-6, 4, 2, 16, 128,
                               cos, sin, idx[0], idx, torch.ones(1, dtype=torch.long))


@pytest.mark.parametrize("rows", [1, 4, 5, 32, 100])  # the row kernel, the tiles, two passes of them
def test_logits_are_float32_sums(rows):
    """The head's matmul returns float32 sums never rounded to bf16 (bf16 steps are 0.125 at a
    logit of 25, which tie tokens float32 tells apart), within float32 error of float64, on
    whichever kernel serves these rows (the row kernel and torch on CPUs without AMX)."""
    from xlserve.layers.linear import linear_float32
    x, w = torch.randn(rows, 576).bfloat16(), torch.randn(256, 576).bfloat16()
    got = linear_float32(x, w)
    assert got.dtype == torch.float32
    assert (got.double() - x.double() @ w.double().T).abs().max().item() < 1e-4
