"""The dense matmuls of ``--deterministic`` (``kernels/invariant_linear.py``): each kernel gives a
row the same bits alone, in any batch and on one thread or two, within a rounding of the exact
product; and the choice of kernel, made once per weight as the model loads."""

import pytest
import torch
from torch import nn

from xlserve.kernels import cpu_ops, invariant_linear, portable_library
from xlserve.kernels.invariant_linear import Kernel

TILE_ORDER = cpu_ops.kernels() is not None  # the AMX tiles' order: on the tiles, or their twin without AMX
KERNELS = [Kernel.TILES] + ([Kernel.AMX] if TILE_ORDER else [])  # the fp32 kernel runs on every CPU
needs_portable = pytest.mark.skipif(portable_library.kernels() is None, reason="the portable kernels do not build")
needs_tile_order = pytest.mark.skipif(not TILE_ORDER, reason="no AVX-512 kernels here")


def _marked(w: torch.Tensor, kernel: Kernel) -> torch.Tensor:
    setattr(w, invariant_linear.MARK, kernel)
    return w


def _rows(x: torch.Tensor, w: torch.Tensor, threads: int) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return invariant_linear.linear(x.float(), w, None, None)
    finally:
        torch.set_num_threads(before)


@needs_portable
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.value)
@pytest.mark.parametrize("shape", [(960, 576), (64, 1536), (32, 32)])
def test_a_row_has_the_same_bits_alone_in_any_batch_and_on_any_thread_count(kernel, shape):
    """Alone, among 2-200 rows (one tile of rows, several, a part-filled last one; K 1,536: the
    portable kernel's passes over 84 rows at a time), on 1 or 2 threads; within a bf16 product's
    rounding of the exact sums."""
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    w = _marked(torch.randn(n, k, generator=g).bfloat16(), kernel)
    x = torch.randn(200, k, generator=g).bfloat16()
    batched = _rows(x, w, 2)
    exact = x.double() @ w.double().T
    assert (batched.double() - exact).abs().max().item() <= 1e-5 * max(1.0, exact.abs().max().item())
    for i in (0, 15, 16, 33, 69, 100, 199):
        assert torch.equal(_rows(x[i:i + 1], w, 2), batched[i:i + 1])
    for rows in (2, 17, 32, 48, 70):
        assert torch.equal(_rows(x[:rows], w, 2), batched[:rows])
    assert torch.equal(_rows(x, w, 1), batched)


@needs_tile_order
def test_the_tiles_round_float32_activations_to_bf16_and_write_only_their_columns():
    """What the C decode step relies on: float32 rows in (a bf16 model's activations are bf16
    values already; others are rounded to nearest even), and a part written into its columns of
    a wider output (``ldo``), the rest untouched."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=g).bfloat16()
    x = torch.randn(5, 96, generator=g)
    out = torch.full((5, 100), 7.0)
    cpu_ops.kernels().xl_linear_amx_dense(x.data_ptr(), w.data_ptr(), out[:, 20:].data_ptr(), 5, 64, 96, 100, 2)
    assert torch.equal(out[:, :20], torch.full((5, 20), 7.0)) and torch.equal(out[:, 84:], torch.full((5, 16), 7.0))
    rounded = _rows(x.bfloat16(), _marked(w, Kernel.AMX), 2)
    assert torch.equal(out[:, 20:84], rounded)
    assert not torch.equal(x, x.bfloat16().float())  # so the rounding was there to see


def test_the_kernel_is_chosen_per_weight_from_its_dtype_shape_and_the_cpu():
    bf16 = torch.zeros(64, 96, dtype=torch.bfloat16)
    assert invariant_linear.kernel_for(bf16, torch.bfloat16, tile_order=True) is Kernel.AMX
    assert invariant_linear.kernel_for(bf16, torch.bfloat16, tile_order=False) is Kernel.TILES  # no AVX-512
    assert invariant_linear.kernel_for(bf16, torch.float32, tile_order=True) is Kernel.TILES  # fp32 stays fp32
    assert invariant_linear.kernel_for(bf16.float(), torch.bfloat16, tile_order=True) is Kernel.TILES
    assert invariant_linear.kernel_for(torch.zeros(48, 96, dtype=torch.bfloat16), torch.bfloat16,
                                       tile_order=True) is Kernel.TILES  # N % 32: the tiles would not take it whole
    assert invariant_linear.kernel_for(torch.zeros(2, 64, 96, dtype=torch.bfloat16), torch.bfloat16,
                                       tile_order=True) is Kernel.TILES  # stacked experts


@needs_portable
def test_mark_records_each_weights_kernel_and_the_fp32_kernel_where_the_tile_order_is_not_computed():
    model = nn.Sequential(nn.Linear(96, 64, bias=False), nn.Linear(64, 48, bias=False)).bfloat16()
    counts = invariant_linear.mark(model, torch.bfloat16)
    first, second = model[0].weight, model[1].weight
    assert invariant_linear.kernel_of(first) is (Kernel.AMX if TILE_ORDER else Kernel.TILES)
    assert invariant_linear.kernel_of(second) is Kernel.TILES
    assert counts == ({Kernel.TILES: 1, Kernel.AMX: 1} if TILE_ORDER else {Kernel.TILES: 2, Kernel.AMX: 0})
    assert invariant_linear.mark(model, torch.bfloat16, tile_order=False) == {Kernel.TILES: 2, Kernel.AMX: 0}
    assert invariant_linear.kernel_of(first) is Kernel.TILES
