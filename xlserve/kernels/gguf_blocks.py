"""GGUF block formats kept in memory as stored, and their dequantization in torch.

The torch path is the one every device runs (CUDA, and CPUs where the C kernel cannot be
built); on x86 CPUs ``gemm_quant.c`` computes the same values. Both follow the formats'
reference (ggml, gguf-py) operation for operation, so dequantized values are bit-exact with
``gguf.quants.dequantize`` (tested per type).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class BlockType(enum.IntEnum):
    """The block-quantized types kept quantized, by ggml's type number."""
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30  # plain bfloat16, kept as stored only where the model computes in float32 (model_loader.keeps_bf16)
    # xlserve's own, never in a file: Q4_0, Q4_1, Q8_0 interleaved 16 rows at a time for the
    # 8-bit kernel (interleave16; kernels/dot_q8_x16.c) or the bfloat16 AMX tile kernel
    # (kernels/gemm_amx_quant.c; without AMX its twin, kernels/gemm_tile_order.c), X16 | the format's number
    Q4_0_X16 = 256 | 2
    Q4_1_X16 = 256 | 3
    Q8_0_X16 = 256 | 8


X16 = 256


@dataclass(frozen=True)
class BlockLayout:
    values: int  # weights per block
    bytes: int  # bytes per block


LAYOUTS = {
    BlockType.Q4_0: BlockLayout(32, 18), BlockType.Q4_1: BlockLayout(32, 20), BlockType.Q8_0: BlockLayout(32, 34),
    BlockType.Q4_K: BlockLayout(256, 144), BlockType.Q5_K: BlockLayout(256, 176), BlockType.Q6_K: BlockLayout(256, 210),
    BlockType.BF16: BlockLayout(32, 64),  # no scale: "blocks" of 32 values so every kernel path takes it
    BlockType.Q4_0_X16: BlockLayout(32, 18), BlockType.Q4_1_X16: BlockLayout(32, 20),
    BlockType.Q8_0_X16: BlockLayout(32, 34),  # per row on average: 16 rows' blocks take 16 times the bytes
}


def row_bytes(qtype: BlockType, k: int) -> int:
    layout = LAYOUTS[qtype]
    if k % layout.values:
        raise ValueError(f"a row of {k} values is not whole {qtype.name} blocks of {layout.values}")
    return k // layout.values * layout.bytes


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of every block, as float32 [blocks, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """[blocks, groups*W] bytes -> [blocks, groups, 2, W]: each group's low nibbles, then its high."""
    q = qs.reshape(qs.shape[0], groups, 1, -1)
    return torch.cat((q & 15, q >> 4), dim=2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _half(b, 0) * b[:, 2:].view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _half(b, 0) * (_nibbles(b[:, 2:], 1).reshape(b.shape[0], 32).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _half(b, 0) * _nibbles(b[:, 4:], 1).reshape(b.shape[0], 32).float() + _half(b, 2)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in a K-quant's 12 bytes [blocks, 12]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat((d & 63, (md & 15) | ((d >> 6) << 4)), dim=1)
    mins = torch.cat((m & 63, (md >> 4) | ((m >> 6) << 4)), dim=1)
    return scales.float(), mins.float()


def _k_quant(b: torch.Tensor, fifth_bit: bool) -> torch.Tensor:
    """Q4_K and Q5_K: 8 sub-blocks of 32 values, each ``d*scale*q - dmin*min``."""
    n = b.shape[0]
    scales, mins = _scale_min_k4(b[:, 4:16])
    ds, dm = (_half(b, 0) * scales).unsqueeze(-1), (_half(b, 2) * mins).unsqueeze(-1)
    qs = b[:, 48:] if fifth_bit else b[:, 16:]
    q = _nibbles(qs, 4).reshape(n, 8, 32)
    if fifth_bit:
        shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
        q = q | (((b[:, 16:48].reshape(n, 1, 32) >> shifts) & 1) << 4)
    return (ds * q.float() - dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    low = _nibbles(b[:, :128], 2).reshape(n, 2, 4, 32)  # per half: 64 low nibbles, then 64 high
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    d = _half(b, 208) * b[:, 192:208].view(torch.int8).float()
    return (d.unsqueeze(-1) * q).reshape(n, 256)


DEQUANTIZERS = {BlockType.Q8_0: _q8_0, BlockType.Q4_0: _q4_0, BlockType.Q4_1: _q4_1,
                BlockType.Q4_K: lambda b: _k_quant(b, False), BlockType.Q5_K: lambda b: _k_quant(b, True),
                BlockType.Q6_K: _q6_k, BlockType.BF16: lambda b: b.contiguous().view(torch.bfloat16).float()}


def dequantize(qtype: BlockType, data: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of ``qtype`` blocks, [N, row bytes] uint8 on any device -> [N, k] float32."""
    if qtype & X16:
        qtype, data = BlockType(qtype & ~X16), deinterleave16(qtype, data)
    layout = LAYOUTS[qtype]
    blocks = data.reshape(-1, layout.bytes)
    return DEQUANTIZERS[qtype](blocks).reshape(data.shape[0], k)


# symmetric integer weights of this many bits map onto a block format of scale * value
SYMMETRIC_BLOCKS = {4: BlockType.Q4_0, 8: BlockType.Q8_0}


def blocks_from_symmetric(values: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor | None:
    """Integer weights ``values`` [N, K] (in [-2^(bits-1), 2^(bits-1))) times one scale per group
    of ``K / scales.shape[1]`` inputs, as rows of Q4_0 (4 bits) or Q8_0 (8 bits) blocks: the
    same values exactly, or None where they cannot be (groups that are not whole blocks of 32,
    or scales that float16, the blocks' scale type, does not hold exactly)."""
    qtype = SYMMETRIC_BLOCKS.get(bits)
    n, k = values.shape
    if qtype is None or k % 32 or k % scales.shape[1] or (k // scales.shape[1]) % 32:
        return None
    per_block = scales.repeat_interleave(k // scales.shape[1] // 32, dim=1)  # [N, K / 32]
    half = per_block.to(torch.float16)
    if not torch.equal(half.float(), per_block.float()):
        return None
    codes = values.reshape(n, k // 32, 32)
    if qtype is BlockType.Q4_0:  # byte j: value j's code (value + 8) low, value j + 16's high
        codes = (codes + 8).to(torch.uint8)
        qs = codes[..., :16] | (codes[..., 16:] << 4)
    else:
        qs = codes.to(torch.int8).view(torch.uint8)
    blocks = torch.cat((half.unsqueeze(-1).view(torch.uint8), qs), dim=-1)  # float16 little-endian, then codes
    return blocks.reshape(n, -1).contiguous()


def _exact_half(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as float16 when every value survives the conversion, else None."""
    half = x.to(torch.float16)
    return half if torch.equal(half.float(), x.float()) else None


def blocks_from_zero_point(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                           ) -> tuple[BlockType, torch.Tensor] | None:
    """Unsigned integer codes [N, K] with one scale and one integer zero point per block of 32
    inputs ([N, K / 32] each), the weight ``scale * (code - zero)`` (GPTQ, AWQ), as the
    smallest block format that holds every value exactly: Q4_0 where ``code - zero`` fits 4
    signed bits (symmetric checkpoints: the zero point is 8), Q4_1 (``d * code + m``) where the
    codes fit 4 bits and ``-scale * zero`` is a float16 value, Q8_0 where ``code - zero`` fits
    8 signed bits; None where none does."""
    n, k = codes.shape
    if k % 32 or tuple(scales.shape) != (n, k // 32) or tuple(zeros.shape) != (n, k // 32):
        return None
    values = codes.to(torch.int32) - zeros.to(torch.int32).repeat_interleave(32, dim=1)
    if values.min() >= -8 and values.max() <= 7:
        blocks = blocks_from_symmetric(values, scales, 4)
        if blocks is not None:
            return BlockType.Q4_0, blocks
    d, m = _exact_half(scales), _exact_half(-scales.double() * zeros.double())  # s * z: exact in float64
    if d is not None and m is not None and codes.min() >= 0 and codes.max() <= 15:
        c = codes.reshape(n, k // 32, 32).to(torch.uint8)
        qs = c[..., :16] | (c[..., 16:] << 4)  # as Q4_0: byte j holds value j low, value j + 16 high
        halves = torch.stack((d, m), dim=-1).view(torch.uint8)  # [N, K / 32, 4]: d then m, little-endian
        return BlockType.Q4_1, torch.cat((halves, qs), dim=-1).reshape(n, -1).contiguous()
    if values.min() >= -128 and values.max() <= 127:
        blocks = blocks_from_symmetric(values, scales, 8)
        if blocks is not None:
            return BlockType.Q8_0, blocks
    return None


INTERLEAVABLE = {BlockType.Q4_0: BlockType.Q4_0_X16, BlockType.Q4_1: BlockType.Q4_1_X16,
                 BlockType.Q8_0: BlockType.Q8_0_X16}


def _x16_codes(base: BlockType, values: torch.Tensor) -> torch.Tensor:
    """A block's 32 values [..., 16 rows, 32] as the interleaved registers' bytes [..., 16 x 32
    or 16 x 16 nibble pairs]: Q8_0 register j, lane r, byte t = value 4j + t; Q4 register j,
    lane r, byte t = value 8j + t | value 8j + 4 + t << 4."""
    *lead, rows, _ = values.shape
    if base is BlockType.Q8_0:  # [.., r, j, t] -> [.., j, r, t]
        return values.reshape(*lead, rows, 8, 4).transpose(-3, -2).reshape(*lead, 512)
    v = values.reshape(*lead, rows, 4, 2, 4)  # [.., r, j, half, t]
    packed = v[..., 0, :] | (v[..., 1, :] << 4)  # [.., r, j, t]
    return packed.transpose(-3, -2).reshape(*lead, 256)


def interleave16(qtype: BlockType, data: torch.Tensor) -> torch.Tensor:
    """Rows of Q4_0, Q4_1 or Q8_0 blocks [N, row bytes] (N a multiple of 16) in the interleaved
    layout of ``dot_q8_x16.c``: per group of 16 rows and block, the values' registers, the 16
    rows' d, then (Q4_1) their m. The same bytes, rearranged; ``deinterleave16`` undoes it."""
    n, row = data.shape
    if n % 16:
        raise ValueError(f"{n} rows do not interleave 16 at a time")
    block, scales = LAYOUTS[qtype].bytes, 4 if qtype is BlockType.Q4_1 else 2
    blocks = data.reshape(n // 16, 16, row // block, block).transpose(1, 2)  # [G, blocks, r, bytes]
    values = blocks[..., scales:]
    if qtype is not BlockType.Q8_0:  # GGUF: byte i holds value i low, value i + 16 high
        values = torch.cat((values & 15, values >> 4), dim=-1)
    parts = [_x16_codes(qtype, values), blocks[..., 0:2].reshape(*blocks.shape[:2], 32)]
    if qtype is BlockType.Q4_1:
        parts.append(blocks[..., 2:4].reshape(*blocks.shape[:2], 32))
    return torch.cat(parts, dim=-1).reshape(n, row).contiguous()


def deinterleave16(qtype: BlockType, data: torch.Tensor) -> torch.Tensor:
    """``interleave16`` undone: rows of ``qtype & ~X16`` blocks as a file stores them."""
    base = BlockType(qtype & ~X16)
    n, row = data.shape
    block = LAYOUTS[base].bytes
    g = data.reshape(n // 16, row // block, 16 * block)  # [G, blocks, group bytes]
    codes = 512 if base is BlockType.Q8_0 else 256
    d = g[..., codes:codes + 32].reshape(*g.shape[:2], 16, 2)
    scales = [d] if base is not BlockType.Q4_1 else [d, g[..., codes + 32:codes + 64].reshape(*g.shape[:2], 16, 2)]
    if base is BlockType.Q8_0:
        values = g[..., :512].reshape(*g.shape[:2], 8, 16, 4).transpose(-3, -2).reshape(*g.shape[:2], 16, 32)
    else:
        nib = g[..., :256].reshape(*g.shape[:2], 4, 16, 4).transpose(-3, -2)  # [G, blocks, r, j, t]
        v = torch.stack((nib & 15, nib >> 4), dim=-2).reshape(*g.shape[:2], 16, 32)  # value 8j + 4 half + t
        values = v[..., :16] | (v[..., 16:] << 4)
    blocks = torch.cat((*scales, values), dim=-1)  # [G, blocks, r, block]
    return blocks.transpose(1, 2).reshape(n, row).contiguous()
