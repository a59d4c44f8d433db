"""The batch-invariant CPU attention (``kernels/attention_paged.c``) against attention written
out in torch, and its promise: a row's bits do not depend on the other rows of the step, on
how the kernel groups rows and heads into work items, or on the thread count."""

import pytest
import torch

from xlserve.kernels import attention_ops, portable_library
from xlserve.layers.window import Window

BUILDS = [isa for isa in portable_library.available_isas() if portable_library.library(isa) is not None]
pytestmark = pytest.mark.skipif(not BUILDS, reason="no C compiler or not an x86-64 CPU with AVX2")
# (query heads, KV heads, head dim): the default model's 9/3/64, no grouping, a 16-head group
# (4 rows a work item instead of 16), and a head dim that is not a whole number of 64-lane blocks
SHAPES = [(9, 3, 64), (4, 4, 32), (16, 1, 128), (6, 2, 80)]


# the last row of the 50-token chunk; rows of the 40-token chunk that ends a 1,050-token sequence
# (keys in chunks 0-2 of 512 positions, the chunk crossing the 1,024 cut), and the decode row of a
# 1,300-token one
LONG_ROWS = (91, 92, 105, 106, 131, 132)


def _step(dtype, hq, hk, d, g):
    """Two decode rows, a 40-token prompt whole and a 50-token chunk after a 300-token prefix;
    then a 40-token chunk after 1,010 tokens and a decode row at 1,300, whose keys span the
    kernel's chunks."""
    lens, chunks = [70, 1, 40, 350, 1050, 1300], [1, 1, 40, 50, 40, 1]
    total = sum(lens) + 16
    k_cache = (3 * torch.randn(total, hk, d, generator=g)).to(dtype)  # wide scores: a peaked softmax
    v_cache = torch.randn(total, hk, d, generator=g).to(dtype)
    perm, at, tables, row_seq, row_len = torch.randperm(total, generator=g), 0, [], [], []
    for s, (n, rows) in enumerate(zip(lens, chunks)):
        tables.append(perm[at:at + n])
        at += n
        row_seq += [s] * rows
        row_len += range(n - rows + 1, n + 1)
    table = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).contiguous()
    q = torch.randn(len(row_seq), hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(row_seq), torch.tensor(row_len)


def _reference(q, k_cache, v_cache, table, row_seq, row_len):
    out = []
    for t in range(q.shape[0]):
        slots = table[row_seq[t], :row_len[t]]
        k, v = (c[slots].transpose(0, 1).unsqueeze(0).float() for c in (k_cache, v_cache))
        out.append(torch.nn.functional.scaled_dot_product_attention(q[t, :, None].unsqueeze(0).float(), k, v,
                                                                    enable_gqa=True)[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("isa", BUILDS, ids=lambda isa: isa.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rows_match_torch_and_keep_their_bits_alone_and_on_any_thread_count(isa, dtype, shape):
    lib, (hq, hk, d) = portable_library.library(isa), shape
    step = _step(dtype, hq, hk, d, torch.Generator().manual_seed(hq * d))
    q, scale = step[0], d ** -0.5
    got = attention_ops.paged_attention(lib, *step[:3], *step[3:], scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), _reference(*step), atol=tol, rtol=tol)
    for t in (0, 1, 2, 30, 41, 42, *LONG_ROWS):  # decode rows; first, middle of a prompt; chunks' edges
        alone = attention_ops.paged_attention(lib, q[t:t + 1], *step[1:4], step[4][t:t + 1], step[5][t:t + 1], scale)
        assert torch.equal(alone[0], got[t]), t
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(attention_ops.paged_attention(lib, *step, scale), got)
    finally:
        torch.set_num_threads(threads)


def _windowed_reference(q, k_cache, v_cache, table, row_seq, row_first, row_len, scale, sinks):
    out = []
    for t in range(q.shape[0]):
        slots = table[row_seq[t], row_first[t]:row_len[t]]
        group = q.shape[1] // k_cache.shape[1]
        k, v = (c[slots].float().repeat_interleave(group, 1).transpose(0, 1) for c in (k_cache, v_cache))
        logits = (q[t].float().unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) * scale  # [Hq, keys]
        if sinks is not None:
            logits = torch.cat((logits, sinks.float()[:, None]), dim=1)
        weights = logits.softmax(-1)[:, :k.shape[1]]
        out.append((weights.unsqueeze(1) @ v).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("isa", BUILDS, ids=lambda isa: isa.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("window", [Window(24), Window(24, chunked=True)], ids=["sliding", "chunked"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_windows_and_sinks_match_torch_and_cut_tiles_by_position(isa, dtype, window, with_sinks):
    """Each row sees only its window (Gemma 3 / gpt-oss sliding, Llama 4 chunks), a sink joins
    its softmax (gpt-oss); its bits are the same alone, and when its table starts later (a
    window's layer group frees the blocks before the window)."""
    lib, (hq, hk, d) = portable_library.library(isa), (9, 3, 64)
    q, k_cache, v_cache, table, row_seq, row_len = _step(dtype, hq, hk, d, torch.Generator().manual_seed(7))
    row_first = window.first_keys(row_len - 1)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(8)) if with_sinks else None
    scale = d ** -0.5
    got = attention_ops.paged_attention(lib, q, k_cache, v_cache, table, row_seq, row_len, scale, row_first, None,
                                        sinks)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), _windowed_reference(q, k_cache, v_cache, table, row_seq, row_first,
                                                                row_len, scale, sinks), atol=tol, rtol=tol)
    for t in (0, 1, 2, 30, 41, 42, *LONG_ROWS):
        alone = attention_ops.paged_attention(lib, q[t:t + 1], k_cache, v_cache, table, row_seq[t:t + 1],
                                              row_len[t:t + 1], scale, row_first[t:t + 1], None, sinks)
        assert torch.equal(alone[0], got[t]), t
    # every table cut at its rows' earliest first key (not a multiple of the tile: 16)
    starts = torch.stack([row_first[row_seq == s].min() for s in range(table.shape[0])])
    cut = torch.nn.utils.rnn.pad_sequence([table[s, starts[s]:] for s in range(table.shape[0])], batch_first=True)
    later = attention_ops.paged_attention(lib, q, k_cache, v_cache, cut.contiguous(), row_seq,
                                          row_len - starts[row_seq], scale, row_first - starts[row_seq], starts, sinks)
    assert torch.equal(later, got)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_rows_get_the_same_bits_on_every_build_with_keys_in_place_or_copied(shape):
    """bf16 scores are summed in the AMX tile product's order on every build (the tiles where the
    CPU has them, FMAs in that order elsewhere), so a prompt computed on an AMX Xeon decodes on an
    AMD Zen 4 as on one machine. On the tiles a key tile is read in place when its 16 keys are one
    aligned block's slots, else copied: both give the same bits (the same keys laid out both ways)."""
    hq, hk, d = shape
    q, k_cache, v_cache, table, row_seq, row_len = _step(torch.bfloat16, hq, hk, d, torch.Generator().manual_seed(d))
    scattered = [attention_ops.paged_attention(portable_library.library(isa), q, k_cache, v_cache, table, row_seq,
                                               row_len, d ** -0.5) for isa in BUILDS]
    for isa, out in zip(BUILDS, scattered):
        assert torch.equal(out, scattered[0]), isa.value
    # every table's entries moved to consecutive slots from a multiple of 16: whole blocks
    width = (table.shape[1] + 15) // 16 * 16
    aligned = torch.arange(table.shape[0] * width).reshape(table.shape[0], width)[:, :table.shape[1]].contiguous()
    k_aligned, v_aligned = (torch.zeros(table.shape[0] * width, hk, d, dtype=torch.bfloat16) for _ in range(2))
    k_aligned[aligned.flatten()], v_aligned[aligned.flatten()] = k_cache[table.flatten()], v_cache[table.flatten()]
    for isa in BUILDS:
        in_place = attention_ops.paged_attention(portable_library.library(isa), q, k_aligned, v_aligned, aligned,
                                                 row_seq, row_len, d ** -0.5)
        assert torch.equal(in_place, scattered[0]), isa.value
