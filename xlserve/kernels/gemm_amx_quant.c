/* Q4_0, Q4_1 and Q8_0 weights interleaved 16 rows at a time (dot_q8_x16.c's layout) against
 * bfloat16 activations on AMX tiles: a bfloat16 model kept in those formats, on CPUs with
 * AMX-BF16 (Intel Sapphire Rapids and later). Its activations are bfloat16 values already, so
 * the rounding below changes nothing there.
 *
 * A Q4 block's weight is d * q + m (Q4_0: m = -8 d) with q an integer 0..15, so its dot with x is
 *   d * sum(x q) + m * sum(x) = 16 d * sum(x (1 + q / 16)) + (m - 16 d) * sum(x).
 * 1 + q / 16 is a bfloat16 (bits 0x3F80 | q << 3: vpmultishiftqb moves each nibble to bits 3-6
 * of its word, vpternlogd masks it and sets the rest, two instructions for 16 rows' pair), and
 * every product x (1 + q / 16) is exact. A Q8_0 block's weight is d * q with q an integer
 * -128..127, itself a bfloat16 (8 bits; converted through fp32, about 8 instructions a pair),
 * so its dot is d * sum(x q), every product exact too. One tile product (tdpbf16ps) takes a
 * block of 16 weight rows (B: 16 value pairs x 16 rows) against up to 16 activation rows (A:
 * their pairs of the block), and each row's 16 sums are then scaled and added in fp32, block
 * after block.
 *
 * Why: the fp32 kernel (gemm_quant.c) spends a permute and a widening per 16 values and an FMA
 * per 16 products per activation row; here the tile unit takes the products of up to 16 rows
 * at once. 30 layers of the default model's Q4_1 shapes, 2-core AMX Xeon (Emerald Rapids),
 * minimum of 3 interleaved in one process, tiles against the fp32 kernel: 1 row 3.15 / 3.10 ms
 * (the tile unit, which the two vCPUs share, takes one product a block whatever the rows),
 * 2 rows 3.33 / 3.78, 4 rows 3.52 / 4.77, 8 rows 4.22 / 7.98, 16 rows 5.32 / 13.3, 32 rows
 * 9.68 / 22.0, 128 rows 37.9 / 76.5, 512 rows 177 / 295 in one pass (137 / 291 in passes of
 * PASS_ROWS). Tried and slower: the group's B tiles made once for every tile of rows, the
 * rows' sums in registers (17-128 rows 8-23% slower, 512 rows 15% faster, in one pass); each
 * block pair's tiles made and loaded once for every tile of rows, the products kept and
 * scaled per row after (17 rows 10.5 against 7.6 ms); each block's product issued before the
 * previous one is stored and scaled (1 row 3.21 against 3.05, 16 rows 5.69 against 5.22).
 * vdpbf16ps in place of the tiles was 2.14 against 2.80 ms at 1 row but 148 against 72 at
 * 128: on this Xeon it retires one every two cycles.
 * One accumulator a row (below) against two, same process, minimum of 9 interleaved, another
 * day (the machine slower): 1 row 4.89 / 5.06 ms, 8 rows 5.79 / 6.26, 17 rows 11.5 / 12.6, 32
 * rows 14.7 / 16.4, 64 rows 27.3 / 32.1, 512 rows 181 / 200. The default model's Q8_0 head
 * (49152 x 576), tiles against the fp32 kernel, the same way: 1 row 1.63 / 1.58 ms, 2 rows
 * 1.65 / 1.66, 4 rows 1.78 / 2.35, 8 rows 1.84 / 4.28, 16 rows 2.21 / 6.12, 32 rows 4.03 /
 * 11.8, 64 rows 8.38 / 22.6.
 * One row without the tiles, the tile product's arithmetic in vector FMAs (the twin,
 * gemm_tile_order.c, the same bits): kept for Q8_0 up to 3 rows (gemm_quant.c: tiles_take),
 * where making its B tiles through fp32 costs the most; for Q4 level with the tiles or slower.
 * Up to 16 rows Q4 runs as a software pipeline over block pairs (group_rows); past 16 rows the
 * same (the next pair's B tiles made while this pair's products run, stored after them) was
 * level at 17-64 rows (30 layers' Q4_1 shapes, minimum of 13 interleaved).
 *
 * Batch invariance: a row's sums in a tile product depend on its own pairs and the block alone,
 * not on the tile's other rows or how many it has (tested alone against batched); the fp32
 * scaling runs in block order per row, one accumulator: acc = fma(16 d, sums, acc), then
 * fma(m - 16 d, sum(x), acc) (two accumulators added at the end: above). CPUs without
 * AMX compute other bits (gemm_quant.c), as they do for dense bfloat16 weights.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"
#include "scratch.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include "amx_tiles.h"
#include "tile_blocks.h"

/* 1 when the process may use AMX tiles (asks the kernel on first call). */
int xl_amx_quant_ready(void) { return amx_permitted(); }

/* tile registers (literal numbers: the intrinsics paste them into the instruction) */
#define TILE_A0 0
#define TILE_A1 1
#define TILE_B0 2
#define TILE_B1 3
#define TILE_C0 4
#define TILE_C1 5
#define TILE_C2 6
#define TILE_C3 7

/* Activation rows a pass over the weights takes (past 16 rows): their pairs, 64 x 64 bytes a
 * block (192 KiB at K 1,536), stay in L2 while every group reads them. 30 layers of the default
 * model's Q4_1 shapes, one pass against passes of 64 / 128 / 256 rows: 512 rows 159 against
 * 137 / 148 / 144 ms, 1,024 rows 364 against 282 / 310 / 295; 17-256 rows within 6%. */
#define PASS_ROWS 64

/* A and C tiles of ``rows`` activation rows, B tiles of 16 pairs; every row 64 bytes. */
static void configure(int rows) {
  const uint8_t r = (uint8_t)rows, per_tile[8] = {[TILE_A0] = r, [TILE_A1] = r, [TILE_B0] = 16, [TILE_B1] = 16,
                                                  [TILE_C0] = r, [TILE_C1] = r, [TILE_C2] = r, [TILE_C3] = r};
  load_tiles(8, per_tile);
}

/* vpmultishiftqb's control for pair t: each dword's byte 0 takes the 8 bits from 3 below its
 * byte t's low nibble (the nibble lands at bits 3-6), byte 2 from 3 below the high nibble. */
static inline __m512i pair_control(int t) {
  const uint64_t dword = (uint64_t)((8 * t - 3) & 63) | (uint64_t)(8 * t + 1) << 16;
  return _mm512_set1_epi64((long long)(dword | (dword + (32 | 32 << 16)) << 32));
}

/* Q8_0's block of a 16-row group as a B tile: row k, lane r = row r's values 2k and 2k + 1 as
 * bfloat16 (exact: 8 bits). */
static inline void block_tile_q8(const uint8_t* g, uint32_t* tile) {
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000);
  for (int k = 0; k < 16; ++k) { /* 0xF8: (first >> 16) | (second & high) */
    const __m512i v = _mm512_loadu_si512(g + 64 * (k / 2));
    const __m512i first = _mm512_castps_si512(q8_values(v, 2 * (k % 2)));
    const __m512i second = _mm512_castps_si512(q8_values(v, 2 * (k % 2) + 1));
    _mm512_store_si512(tile + 16 * k, _mm512_ternarylogic_epi32(_mm512_srli_epi32(first, 16), second, high, 0xF8));
  }
}

/* One block of a 16-row group as a B tile; Q4: row 4j + t, lane r = row r's pair 4j + t as two
 * bfloat16 1 + q / 16. */
static inline void block_tile(int base, const uint8_t* g, uint32_t* tile) {
  if (base == Q8_0) return block_tile_q8(g, tile);
  const __m512i one = _mm512_set1_epi32(0x3F803F80), nibble = _mm512_set1_epi32(0x00780078);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(g + 64 * j);
    for (int t = 0; t < 4; ++t) { /* 0xEC: (selected & nibble) | one */
      const __m512i selected = _mm512_multishift_epi64_epi8(pair_control(t), v);
      _mm512_store_si512(tile + 16 * (4 * j + t), _mm512_ternarylogic_epi32(selected, one, nibble, 0xEC));
    }
  }
}

/* A group's blocks b and b + 1 against ``rows`` activation rows (pairs ``a``, rows ``blocks``
 * apart): the tile products into C0 and C1, B tiles from ``bt``; pair_sums stores them. This is
 * row_tile_pairs with two = 0 but for the B tiles, loaded here after the A tiles: loaded before
 * it, as group_tiles does, was 7-8% slower at 1 and 8 rows (30 layers' Q4_1 shapes). */
static inline void pair_products(const uint32_t* a, int64_t blocks, int64_t b, const uint32_t* bt) {
  _tile_zero(TILE_C0);
  _tile_zero(TILE_C1);
  _tile_loadd(TILE_A0, a + 16 * b, blocks * 64);
  _tile_loadd(TILE_A1, a + 16 * (b + 1), blocks * 64);
  _tile_loadd(TILE_B0, bt, 64);
  _tile_loadd(TILE_B1, bt + 256, 64);
  _tile_dpbf16ps(TILE_C0, TILE_A0, TILE_B0);
  _tile_dpbf16ps(TILE_C1, TILE_A1, TILE_B1);
}

/* pair_products' sums into ``cb`` (two [rows, 16]). */
static inline void pair_sums(float* cb) {
  _tile_stored(TILE_C0, cb, 64);
  _tile_stored(TILE_C1, cb + 256, 64);
}

/* Block pair b, b + 1's products for ``rows`` activation rows, scaled into ``acc``: its sums in
 * ``cb`` (two [rows, 16]), its scales from the weights at ``p``. */
static inline void scale_pair(int base, const uint8_t* p, int gb, int rows, __m512* acc, const float* cb,
                              const float* s, int64_t blocks, int64_t b) {
  __m512 d16[2], c[2];
  block_scales(base, p, &d16[0], &c[0]);
  block_scales(base, p + gb, &d16[1], &c[1]);
  for (int i = 0; i < rows; ++i) {
    acc[i] = scale_sums(base, acc[i], d16[0], c[0], _mm512_load_ps(cb + 16 * i), s[i * blocks + b]);
    acc[i] = scale_sums(base, acc[i], d16[1], c[1], _mm512_load_ps(cb + 256 + 16 * i), s[i * blocks + b + 1]);
  }
}

/* Block pair b, b + 1's B tiles at ``bt`` (512 words), prefetching ahead. */
static inline void pair_tiles(int base, const uint8_t* p, int gb, uint32_t* bt) {
  for (int o = 0; o < 2 * gb; o += 64) prefetch_ahead(p + o);
  block_tile(base, p, bt);
  block_tile(base, p + gb, bt + 256);
}

/* One group of 16 weight rows (``blocks`` even) against ``rows`` <= 16 activation rows: their
 * 16 outputs each at out + i * ldo, sums per row in registers. Q8_0's pairs one at a time. */
static void group_rows_serial(int base, const uint8_t* g, const uint32_t* a, const float* s, int rows,
                              int64_t blocks, float* out, int64_t ldo, uint32_t* bt, float* cb) {
  const int gb = 16 * block_bytes(base);
  __m512 acc[16];
  for (int i = 0; i < rows; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b += 2) {
    pair_tiles(base, g + b * gb, gb, bt);
    pair_products(a, blocks, b, bt);
    pair_sums(cb);
    scale_pair(base, g + b * gb, gb, rows, acc, cb, s, blocks, b);
  }
  for (int i = 0; i < rows; ++i) _mm512_storeu_ps(out + i * ldo, acc[i]);
}

/* The same for Q4_0 / Q4_1 as a software pipeline over block pairs (tile registers are not
 * renamed): while pair p's products run, pair p + 1's B tiles are made into the other of two
 * buffers and pair p - 1's sums scaled from the other of two sum buffers, and only then are
 * pair p's sums stored, so neither the vector work nor the tiles wait for the other: the same
 * operations per row in the same order. 30 layers of the default model's Q4_1 shapes, 2-core
 * AMX Xeon, minimum of 15 interleaved in one process: 1 row 3.60 -> 2.87 ms, 4 rows 3.82 ->
 * 3.19, 8 rows 4.39 -> 4.15, 16 rows 6.06 -> 5.95; the one-call decode step at 1 row 3.37 ->
 * 2.69 ms (median of 16 alternating rounds). Where the sums are stored decides it: right after
 * the products, before the vector work, the pipeline measured level with pairs one at a time
 * (one thread, one layer in L2, 1 row: 26.6 against 24.7 ns a block; stored last, 16.3). Q8_0's
 * B tiles are vector-bound to make (about 9 instructions a tile row against Q4's 2): its head
 * (49,152 x 576) pipelined was 0.94x at 4-16 rows (median of 41 alternating), so it keeps
 * pairs one at a time. */
static void group_rows(int base, const uint8_t* g, const uint32_t* a, const float* s, int rows, int64_t blocks,
                       float* out, int64_t ldo, uint32_t* bt, float* cb) {
  if (base == Q8_0) return group_rows_serial(base, g, a, s, rows, blocks, out, ldo, bt, cb);
  const int gb = 16 * block_bytes(base);
  __m512 acc[16];
  for (int i = 0; i < rows; ++i) acc[i] = _mm512_setzero_ps();
  pair_tiles(base, g, gb, bt);
  for (int64_t b = 0; b < blocks; b += 2) {
    const int odd = (b / 2) & 1;
    pair_products(a, blocks, b, bt + 512 * odd);
    if (b + 2 < blocks) pair_tiles(base, g + (b + 2) * gb, gb, bt + 512 * !odd);
    if (b > 0) scale_pair(base, g + (b - 2) * gb, gb, rows, acc, cb + 512 * !odd, s, blocks, b - 2);
    pair_sums(cb + 512 * odd);
  }
  const int odd = ((blocks - 2) / 2) & 1;
  scale_pair(base, g + (blocks - 2) * gb, gb, rows, acc, cb + 512 * odd, s, blocks, blocks - 2);
  for (int i = 0; i < rows; ++i) _mm512_storeu_ps(out + i * ldo, acc[i]);
}

/* Blocks b and b + 1 of the loaded B tiles against activation rows [0, 16) and (``two``)
 * [16, 32) of ``a``: their sums into cb (rows j < 16) and cb + 512 (the rest), block b + 1's
 * 256 floats after block b's. The second tile of rows has C tiles of its own, so its products
 * need not wait for the first's to be stored. */
static inline void row_tile_pairs(const uint32_t* a, int64_t blocks, int64_t b, int two, float* cb) {
  _tile_zero(TILE_C0);
  _tile_zero(TILE_C1);
  _tile_loadd(TILE_A0, a + 16 * b, blocks * 64);
  _tile_loadd(TILE_A1, a + 16 * (b + 1), blocks * 64);
  _tile_dpbf16ps(TILE_C0, TILE_A0, TILE_B0);
  _tile_dpbf16ps(TILE_C1, TILE_A1, TILE_B1);
  if (two) {
    _tile_zero(TILE_C2);
    _tile_zero(TILE_C3);
    _tile_loadd(TILE_A0, a + 256 * blocks + 16 * b, blocks * 64);
    _tile_loadd(TILE_A1, a + 256 * blocks + 16 * (b + 1), blocks * 64);
    _tile_dpbf16ps(TILE_C2, TILE_A0, TILE_B0);
    _tile_dpbf16ps(TILE_C3, TILE_A1, TILE_B1);
  }
  _tile_stored(TILE_C0, cb, 64);
  _tile_stored(TILE_C1, cb + 256, 64);
  if (two) {
    _tile_stored(TILE_C2, cb + 512, 64);
    _tile_stored(TILE_C3, cb + 768, 64);
  }
}

/* The same for M > 16 rows (padded to whole tiles of 16): each block's B tiles made and loaded
 * once for every tile of rows, two tiles of rows at a time, the sums in ``sums`` ([M, 16]), the
 * same operations per row. Two tiles of rows with C tiles each against one tile of rows at a
 * time (its products waiting for the last one's C tiles to be stored): 30 layers of the default
 * model's Q4_1 shapes, minimum of 13-21 interleaved in one process, 24 rows 10.5 -> 9.7 ms, 32
 * rows 12.1 -> 10.3, 40 rows 15.2 -> 14.2, 48 rows 17.3 -> 15.6; 17 rows and 64 or more level;
 * the Q8_0 head at 32 rows 2.70 -> 2.29. */
static void group_tiles(int base, const uint8_t* g, const uint32_t* a, const float* s, int64_t M, int64_t blocks,
                        float* out, int64_t ldo, uint32_t* bt, float* cb, float* sums) {
  const int gb = 16 * block_bytes(base);
  memset(sums, 0, sizeof(float) * 16 * (size_t)M);
  for (int64_t b = 0; b < blocks; b += 2) {
    const uint8_t* p = g + b * gb;
    pair_tiles(base, p, gb, bt);
    __m512 d16[2], c[2];
    block_scales(base, p, &d16[0], &c[0]);
    block_scales(base, p + gb, &d16[1], &c[1]);
    _tile_loadd(TILE_B0, bt, 64);
    _tile_loadd(TILE_B1, bt + 256, 64);
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      row_tile_pairs(a + m0 * blocks * 16, blocks, b, m0 + 16 < M, cb);
      for (int64_t i = m0; i < M && i < m0 + 32; ++i) {
        const int64_t j = i - m0;
        const float *ci = cb + 16 * j + (j / 16) * 256, *si = s + i * blocks + b;
        __m512 acc = scale_sums(base, _mm512_load_ps(sums + 16 * i), d16[0], c[0], _mm512_load_ps(ci), si[0]);
        _mm512_store_ps(sums + 16 * i, scale_sums(base, acc, d16[1], c[1], _mm512_load_ps(ci + 256), si[1]));
      }
    }
  }
  for (int64_t i = 0; i < M; ++i) _mm512_storeu_ps(out + i * ldo, _mm512_load_ps(sums + 16 * i));
}

/* x: [M, K] fp32 (rounded to bfloat16 here); w: N / 16 interleaved groups of Q4_0, Q4_1 or Q8_0 (K a
 * multiple of 64); out: [M, ldo], columns 0..N-1. */
void xl_linear_amx_quant(int base, const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K,
                         int64_t ldo, int threads) {
  if (!xl_amx_quant_ready()) abort(); /* never: the layout is chosen for this kernel where it says 1 */
  const int64_t blocks = K / 32, groups = N / 16, padded = (M + 15) / 16 * 16;
  const int64_t group_bytes = blocks * 16 * block_bytes(base);
  /* Up to 4 rows each thread pairs them itself (a few hundred instructions a row) and the groups
   * start without a barrier: the one-call decode step's C part at 1 row, one process, 12
   * alternating rounds (2-core AMX Xeon), median 1.046x faster; pairing 8 rows twice was 0.98x. */
  const int own_pairs = M <= 4;
  uint32_t* a = own_pairs ? NULL : (uint32_t*)xl_kept(0, sizeof(uint32_t) * 16 * (size_t)(padded * blocks));
  float* s = own_pairs ? NULL : (float*)xl_kept(1, sizeof(float) * (size_t)(M * blocks));
  if (!own_pairs && padded > M) memset(a + M * blocks * 16, 0, sizeof(uint32_t) * 16 * (size_t)((padded - M) * blocks));
#pragma omp parallel num_threads(threads)
  {
    uint32_t* my_a = own_pairs ? (uint32_t*)xl_kept(2, sizeof(uint32_t) * 16 * (size_t)(M * blocks)) : a;
    float* my_s = own_pairs ? (float*)xl_kept(3, sizeof(float) * (size_t)(M * blocks)) : s;
    if (own_pairs)
      for (int64_t m = 0; m < M; ++m) pair_row(base, x + m * K, blocks, my_a + m * blocks * 16, my_s + m * blocks);
    else {
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) pair_row(base, x + m * K, blocks, a + m * blocks * 16, s + m * blocks);
    }
    uint32_t* bt = (uint32_t*)xl_kept(4, 4096); /* two pairs' B tiles (group_rows' pipeline) */
    float* cb = (float*)xl_kept(5, 4096);
    float* sums = M > 16 ? (float*)xl_kept(6, sizeof(float) * 16 * PASS_ROWS) : NULL;
    configure(M > 16 ? 16 : (int)M);
    for (int64_t m0 = 0; m0 < M; m0 += PASS_ROWS) { /* a pass's activation pairs stay in L2 */
      const int64_t rows = M - m0 < PASS_ROWS ? M - m0 : PASS_ROWS;
      /* no barrier between passes: each writes its own rows (the region's end waits for all) */
#pragma omp for schedule(static) nowait
      for (int64_t gi = 0; gi < groups; ++gi) {
        const uint8_t* g = w + gi * group_bytes;
        if (M > 16) group_tiles(base, g, my_a + m0 * blocks * 16, my_s + m0 * blocks, rows, blocks,
                                out + m0 * ldo + 16 * gi, ldo, bt, cb, sums);
        else group_rows(base, g, my_a, my_s, (int)M, blocks, out + 16 * gi, ldo, bt, cb);
      }
    }
    _tile_release();
  }
}
#else
int xl_amx_quant_ready(void) { return 0; }

void xl_linear_amx_quant(int base, const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K,
                         int64_t ldo, int threads) {
  (void)base, (void)x, (void)w, (void)out, (void)M, (void)N, (void)K, (void)ldo, (void)threads;
  abort(); /* never called: weights take this layout for it only where xl_amx_quant_ready says 1 */
}
#endif
