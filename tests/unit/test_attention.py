"""A chunk after a cached prefix: both attention paths (the CPU split-flash one and the single
fused call used on CUDA) against attention written out by hand."""

import pytest
import torch

from xlserve.layers import attention
from xlserve.layers.attention import PrefillChunk


def _reference(q, k_ctx, v_ctx):
    n, hq, d = q.shape
    ctx, hk, _ = k_ctx.shape
    k = k_ctx.repeat_interleave(hq // hk, 1).transpose(0, 1)  # [Hq, C, D]
    v = v_ctx.repeat_interleave(hq // hk, 1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / d ** 0.5  # [Hq, n, C]
    allowed = torch.arange(ctx) <= torch.arange(ctx - n, ctx).unsqueeze(1)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (weights @ v).transpose(0, 1)  # [n, Hq, D]


@pytest.mark.parametrize("fused_call", [False, True])
@pytest.mark.parametrize("consecutive", [False, True])
def test_chunk_after_prefix_matches_reference(monkeypatch, fused_call, consecutive):
    if fused_call:
        monkeypatch.setattr(attention, "_CPU_FLASH", None)
    torch.manual_seed(0)
    block, hq, hk, d, prefix, n = 16, 6, 2, 32, 70, 13
    cache_k, cache_v = torch.randn(40 * block, hk, d), torch.randn(40 * block, hk, d)
    blocks = list(range(3, 9)) if consecutive else [9, 2, 30, 5, 17, 11]
    pos = torch.arange(prefix + n)
    slots = torch.tensor(blocks)[pos // block] * block + pos % block
    q, k, v = torch.randn(n, hq, d), torch.randn(n, hk, d), torch.randn(n, hk, d)
    cache_k[slots[prefix:]], cache_v[slots[prefix:]] = k, v  # the backend writes the chunk first
    chunk = PrefillChunk(0, n, slots, blocks[0] * block if consecutive else None)
    out = attention._attend_context(q, k, v, cache_k, cache_v, chunk)
    torch.testing.assert_close(out, _reference(q, cache_k[slots], cache_v[slots]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("windowed", [False, True])
def test_host_decode_context_matches_the_device_one(windowed):
    """The runner's host-side decode metadata (numpy) is the CUDA graphs' ``decode_context``:
    the same slots, real positions and new slots, padding pointing at each row's new token."""
    gen = torch.Generator().manual_seed(0)
    block = 16
    lens = [1, 17, 40, 16, 33]
    blocks = [torch.randperm(64, generator=gen)[:-(-n // block) + int(i % 2)].tolist() for i, n in enumerate(lens)]
    firsts = [0, 5, 23, 0, 32] if windowed else None
    width = -(-max(lens) // block)
    table = attention.block_table(blocks, len(lens), width, 0)
    counts = [n - f for n, f in zip(lens, firsts or [0] * len(lens))]
    want = attention.decode_context(table, torch.tensor(lens), max(counts), block,
                                    torch.tensor(firsts) if windowed else None)
    got = attention.host_decode_context(blocks, lens, block, firsts)
    for g, w in zip(got, want):
        assert torch.equal(torch.from_numpy(g), w)
