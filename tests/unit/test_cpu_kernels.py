"""The bf16 decode kernel against a float64 reference, and the switch back to eager."""

import pytest
import torch

from xlserve.kernels import cpu_gemv
from xlserve.layers.linear import linear

needs_kernel = pytest.mark.skipif(cpu_gemv.kernel() is None, reason="CPU without AVX-512 or no C compiler")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16])
@pytest.mark.parametrize("shape", [(960, 576), (49, 37), (17, 16), (130, 1536)])
def test_gemv_matches_reference(rows, shape):
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    ref = x.double() @ w.double().T + bias.double()
    got = cpu_gemv.gemv_bf16(x, w, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert (got.double() - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


@needs_kernel
def test_dispatch_uses_kernel_only_for_few_bf16_rows():
    w = torch.randn(64, 32).bfloat16()
    assert cpu_gemv.use_gemv(torch.randn(1, 32).bfloat16(), w)
    assert not cpu_gemv.use_gemv(torch.randn(cpu_gemv.MAX_ROWS + 1, 32).bfloat16(), w)
    assert not cpu_gemv.use_gemv(torch.randn(1, 32), w.float())
    cpu_gemv.set_enabled(False)
    try:
        assert not cpu_gemv.use_gemv(torch.randn(1, 32).bfloat16(), w)
        x = torch.randn(2, 32).bfloat16()
        assert torch.equal(linear(x, w, None), torch.nn.functional.linear(x, w))
    finally:
        cpu_gemv.set_enabled(True)
