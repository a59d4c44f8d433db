/* The dense AMX tile kernel's arithmetic (gemm_amx.c) without the tiles: bfloat16 weights [N, K]
 * in their plain layout against bfloat16 activations, in vector FMAs, on any CPU with AVX512F
 * and AVX512BW (AMD Zen 4 / 5, Intel Ice Lake and Cooper Lake). Every output has the bits the
 * tiles give it, so a bfloat16 model under --deterministic answers the same on a CPU with AMX
 * and one without (invariant_linear.py), as a model kept in Q4_0 / Q4_1 / Q8_0 does by default
 * (gemm_tile_order.c).
 *
 * The tiles' order (measured bit for bit against tdpbf16ps with a nonzero C, 25.6 million
 * outputs, docs/quantization.md): in a block of 32 values, the first products of the 16 pairs
 * summed in pair order, each step rounded to fp32, the second products the same way apart, then
 * C + (first + second); C starts at zero and carries across the blocks of K. A product of two
 * bfloat16 values is exact in fp32, so one FMA a product in that order is what the tile
 * computes. Inputs below 2^-126 count as zero, as the tiles take them. Not reproduced: a tile
 * flushes a partial sum below 2^-126 to zero, which the FMAs keep (never seen in a model).
 *
 * Below 16 rows the lanes are 16 output features: a block of 16 weight rows is transposed in
 * registers (64 shuffles) into its 16 pairs, once for a pass of up to ROWS_MAX activation rows,
 * each pair feeding two FMAs a row. From 16 rows they are 16 activation rows (ROW_LANES_MIN,
 * below). The epilogue is the tiles' own, per row (tile_epilogue.h).
 * Against the fp32 kernel it replaces under --deterministic (gemm_quant.c:xl_linear_dense), 30
 * layers of the default model's bf16 shapes on the AMX Xeon capped at avx512-bf16, minimum of 5
 * in one process: 1 row 16.8 against 15.3 ms, 16 rows 36.8 against 28.1, 32 rows 45.9 against
 * 46.8, 256 rows 283 against 206 (with rows as lanes; 470 with features as lanes).
 */
#include <stdint.h>
#include <stdlib.h>

#include "scratch.h"
#include "tile_epilogue.h" /* built with cpu_ops.py's flags: AVX512F and AVX512BW */

/* rows a pass takes: their first and second sums and C, 24 registers at 8 */
#define ROWS_MAX 8

/* fp32 lanes whose exponent is zero (bfloat16 denormals widened) as +0: the tiles' inputs */
static inline __m512 flush_denormal(__m512i bits) {
  return _mm512_maskz_mov_ps(_mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x7F800000)), _mm512_castsi512_ps(bits));
}

/* ``count`` (a multiple of 16) bfloat16 values as fp32, denormals as zero */
static void widen_rows(const uint16_t* x, float* out, int64_t count) {
  for (int64_t i = 0; i < count; i += 16)
    _mm512_storeu_ps(out + i, flush_denormal(_mm512_castps_si512(vload_bf16(x + i))));
}

/* Block b of 16 weight rows (``w``: row 0's block, rows ``K`` values apart) as its 16 pairs:
 * pairs[p] lane n = row n's values 2p and 2p + 1 (bits, transposed) */
static inline void block_pairs(const uint16_t* w, int64_t K, __m512 pairs[16]) {
  vload_transposed((const float*)w, K / 2, pairs);
}

/* One block's products for ``rows`` rows (``x``: row 0's block, rows ``K`` apart) into C. */
static inline __attribute__((always_inline)) void block_products(const __m512 pairs[16], const float* x, int64_t K,
                                                                 int rows, __m512* c) {
  __m512 first[ROWS_MAX], second[ROWS_MAX];
  for (int i = 0; i < rows; ++i) first[i] = second[i] = _mm512_setzero_ps();
  const __m512i exponent = _mm512_set1_epi16(0x7F80);
  for (int p = 0; p < 16; ++p) { /* each bfloat16 whose exponent is zero made +0 */
    const __m512i raw = _mm512_castps_si512(pairs[p]);
    const __m512i bits = _mm512_maskz_mov_epi16(_mm512_test_epi16_mask(raw, exponent), raw);
    const __m512 wf = vbf16_low(_mm512_castsi512_ps(bits)), ws = vbf16_high(_mm512_castsi512_ps(bits));
    for (int i = 0; i < rows; ++i) {
      first[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * K + 2 * p]), wf, first[i]);
      second[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * K + 2 * p + 1]), ws, second[i]);
    }
  }
  for (int i = 0; i < rows; ++i) c[i] = _mm512_add_ps(c[i], _mm512_add_ps(first[i], second[i]));
}

/* Features n0 .. n0 + 15 of rows m0 .. m0 + rows - 1, every block of K; inlined for each row
 * count (a constant there), so that the sums stay in registers. */
static inline __attribute__((always_inline)) void group_pass_of(const float* xf, const uint16_t* w, int64_t n0,
                                                                int64_t m0, const int rows, int64_t K,
                                                                const epilogue* e) {
  __m512 c[ROWS_MAX], pairs[16];
  for (int i = 0; i < rows; ++i) c[i] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    block_pairs(w + n0 * K + k0, K, pairs);
    block_products(pairs, xf + m0 * K + k0, K, rows, c);
  }
  for (int i = 0; i < rows; ++i) finish_row(c[i], m0 + i, n0, e);
}

static void group_pass(const float* xf, const uint16_t* w, int64_t n0, int64_t m0, int rows, int64_t K,
                       const epilogue* e) {
  switch (rows) {
#define ROWS_CASE(R) \
  case R: return group_pass_of(xf, w, n0, m0, R, K, e);
    ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#undef ROWS_CASE
    default: abort(); /* never: passes hold 1 to ROWS_MAX rows */
  }
}

/* From ROW_LANES_MIN rows the lanes are 16 activation rows instead (the same sums, each in the
 * same order): the rows are transposed once a call, a 16-feature group's weights widened once
 * for every group of rows, and each weight is a broadcast operand of its FMAs, so no transpose
 * runs per pass. */
#define ROW_LANES_MIN 16
/* Rows a pass of the row-lane path takes: their transposed rows, 1.5 MiB at K 1,536, stay in L2
 * while every feature group reads them. */
#define ROW_PASS 256

/* Rows as lanes: xt [M / 16 (rounded up)][K][16] fp32, group r lane i = row 16 r + i (zero past M). */
static void transpose_rows(const float* xf, int64_t M, int64_t K, float* xt) {
  for (int64_t r = 0; r < (M + 15) / 16; ++r)
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
      float block[256] __attribute__((aligned(64)));
      for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) block[16 * i + j] = 16 * r + i < M ? xf[(16 * r + i) * K + k0 + j] : 0.0f;
      __m512 col[16];
      vload_transposed(block, 16, col);
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(xt + (r * K + k0 + j) * 16, col[j]);
    }
}

/* Block k0's products of four features (wf: their fp32 weights, rows K apart) over a group of 16
 * rows (xt: its [K][16]), in the tiles' order, added to c[0..3] (lane i: row i). */
static inline __attribute__((always_inline)) void four_features(const float* wf, const float* xt, int64_t K,
                                                                int64_t k0, __m512* c) {
  __m512 first[4], second[4];
  for (int j = 0; j < 4; ++j) first[j] = second[j] = _mm512_setzero_ps();
  for (int p = 0; p < 16; ++p) {
    const __m512 xa = _mm512_loadu_ps(xt + (k0 + 2 * p) * 16), xb = _mm512_loadu_ps(xt + (k0 + 2 * p + 1) * 16);
    for (int j = 0; j < 4; ++j) {
      first[j] = _mm512_fmadd_ps(_mm512_set1_ps(wf[j * K + k0 + 2 * p]), xa, first[j]);
      second[j] = _mm512_fmadd_ps(_mm512_set1_ps(wf[j * K + k0 + 2 * p + 1]), xb, second[j]);
    }
  }
  for (int j = 0; j < 4; ++j) c[j] = _mm512_add_ps(c[j], _mm512_add_ps(first[j], second[j]));
}

/* Features n0 .. n0 + 15 against rows m0 .. m1 - 1 (m0 a multiple of 16), rows as lanes (wf:
 * scratch for their K fp32 weights); block by block, each block's rows and weights read from L1
 * by the four quarters of the group. */
static void group_rows_as_lanes(const float* xt, const uint16_t* w, int64_t n0, int64_t m0, int64_t M, int64_t K,
                                float* wf, const epilogue* e) {
  widen_rows(w + n0 * K, wf, 16 * K);
  for (int64_t r = m0 / 16; r < (M + 15) / 16; ++r) {
    __m512 c[16]; /* [feature] lanes: rows */
    for (int j = 0; j < 16; ++j) c[j] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += 32)
      for (int q = 0; q < 4; ++q) four_features(wf + 4 * q * K, xt + r * K * 16, K, k0, c + 4 * q);
    vtranspose(c); /* now [row] lanes: features */
    for (int64_t i = 0; i < 16 && 16 * r + i < M; ++i) finish_row(c[i], 16 * r + i, n0, e);
  }
}

/* Rows xf [M, K] (M < ROW_LANES_MIN) against every feature group, features as lanes. */
static void features_as_lanes(const float* xf, const uint16_t* w, int64_t M, int64_t N, int64_t K,
                              const epilogue* e, int threads) {
  const int64_t passes = (M + ROWS_MAX - 1) / ROWS_MAX;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t g = 0; g < N / 16; ++g)
    for (int64_t q = 0; q < passes; ++q)
      group_pass(xf, w, 16 * g, q * ROWS_MAX, M - q * ROWS_MAX < ROWS_MAX ? (int)(M - q * ROWS_MAX) : ROWS_MAX, K, e);
}

/* Rows xf [M, K] against every feature group, rows as lanes, in passes of ROW_PASS rows. */
static void rows_as_lanes(const float* xf, const uint16_t* w, int64_t M, int64_t N, int64_t K, const epilogue* e,
                          int threads) {
  float* xt = (float*)xl_scratch(sizeof(float) * (size_t)((M + 15) / 16 * 16 * K));
  transpose_rows(xf, M, K, xt);
#pragma omp parallel num_threads(threads)
  {
    float* wf = (float*)xl_scratch(sizeof(float) * (size_t)(16 * K));
    for (int64_t m0 = 0; m0 < M; m0 += ROW_PASS) {
#pragma omp for schedule(static)
      for (int64_t g = 0; g < N / 16; ++g)
        group_rows_as_lanes(xt, w, 16 * g, m0, m0 + ROW_PASS < M ? m0 + ROW_PASS : M, K, wf, e);
    }
    free(wf);
  }
  free(xt);
}

/* gemm_amx.c's multiply without the tiles, the same contract and bits: x [M, K] and w [N, K]
 * bfloat16 (K % 32 == 0, N % 32 == 0); bf16 ``out`` [M, N] (+ bias, rounded, + residual,
 * rounded) or, with ``out32``, the fp32 sums + bias, rows ``ldo`` apart. */
void xl_tile_order_dense(const uint16_t* x, const uint16_t* w, const void* bias, const void* residual, void* out,
                         float* out32, int64_t M, int64_t N, int64_t K, int64_t ldo, int threads) {
  const epilogue e = {(const uint16_t*)bias, (const uint16_t*)residual, (uint16_t*)out, out32, N, ldo};
  float* xf = (float*)xl_scratch(sizeof(float) * (size_t)(M * K));
  widen_rows(x, xf, M * K);
  if (M >= ROW_LANES_MIN)
    rows_as_lanes(xf, w, M, N, K, &e, threads);
  else
    features_as_lanes(xf, w, M, N, K, &e, threads);
  free(xf);
}

/* ``count`` fp32 values to bfloat16 as vcvtneps2bf16 rounds (tile_blocks.h), count % 16 == 0: the
 * activations of xl_linear_amx_dense on either path. */
void xl_round_rows_bf16(const float* x, uint16_t* out, int64_t count) {
  for (int64_t i = 0; i < count; i += 16)
    _mm256_storeu_si256((__m256i*)(out + i), _mm512_cvtepi32_epi16(bf16_round(_mm512_loadu_ps(x + i))));
}
