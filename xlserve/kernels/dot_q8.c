/* Q4_0, Q4_1 and Q8_0 weights against activations quantized to 8 bits per 32 values, the
 * scheme llama.cpp computes these formats with (its Q8_0 / Q8_1 activation blocks):
 *
 *   x block -> d = max|x| / 127 (stored as float16), q = round(x * 127 / max|x|), s = d * sum(q)
 *   w.x     = sum over blocks of  d_w * d_x * (q_w . q_x)   (+ m_w * s_x for Q4_1)
 *
 * q_w . q_x is an exact integer: one vpdpbusd per 32 products on CPUs with AVX512-VNNI,
 * vpmaddubsw + vpmaddwd elsewhere (AVX2). The price is the activations' rounding: results
 * are within bf16's error of the dequantized weights' (tested), not fp32's. Asked for with
 * --int8-activations. Speed against the fp32-activation path (gemm_quant.c) depends on the
 * CPU: on an AVX2 machine 0.115 vs 0.224 ms for a 3072 x 1024 Q4_1 weight; on a 2-core
 * Zen 4 EPYC, 30 layers of the default model's gate/up shape (92160 x 576 Q4_1), minimum of
 * 21 interleaved runs: 1 row 2.12 ms (VNNI) / 2.99 (AVX2 path) / 2.24 (fp32), 4 rows
 * 5.17 / 7.23 / 3.89, 32 rows 40.4 / 55.6 / 26.3 — there fp32 activations stay the faster.
 *
 * Batch invariance: a row's activations are quantized alone, and each output accumulates its
 * blocks in order into 8 fp32 lanes summed in a fixed order, whatever M, the tile or the thread.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"
#include "vec_portable.h"

#define NR 4 /* weight rows per tile: independent accumulation chains */

typedef struct {
  float d, s; /* block scale and d * sum(q), each rounded to float16 as ggml stores them */
} act_block;

int xl_q8_handles(int type) { return type == Q4_0 || type == Q4_1 || type == Q8_0; }

/* One block of 32 values into int8 (round to nearest even, as llama.cpp's AVX2
 * quantize_row_q8_1 does): its scale and d * sum; returns the integer sum. */
static int quantize_block(const float* v, int8_t* q, act_block* block) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
  const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
  int sum = 0;
  for (int j = 0; j < 32; ++j) {
    const int value = (int)nearbyintf(v[j] * id);
    q[j] = (int8_t)value;
    sum += value;
  }
  block->d = half_round(d);
  block->s = half_round(d * (float)sum);
  return sum;
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* AVX512-VNNI: vpdpbusd multiplies 32 unsigned weight bytes by 32 signed activation bytes
 * and adds them into 8 int32 lanes in one instruction, and the scales go 8 blocks at a time.
 * A group of 8 blocks leaves 8 exact integer dots (one per block, in block order), which
 * are converted, scaled by d_w * d_x and accumulated in 8 fp32 lanes, one group after the
 * other; the lanes are summed in a fixed order at the end. The AVX2 path below converts and
 * scales every block alone, with scalar float16 conversions and a scalar chain for Q4_1's
 * mins, which is what made --int8-activations slower than fp32 activations on a Zen 5.
 *
 * Activation layout (what quantize_rows writes): per row, blocks padded to a multiple of 8
 * with zeros; for the 4-bit formats each pair of blocks (2p, 2p+1) is stored as its values
 * 0-15 of both, then 16-31 of both, the order in which one 32-byte load of the pair's two
 * nibble runs splits into low and high nibbles; Q8_0's blocks stay in order. Per block the
 * scale d, d * sum (both rounded to float16, as ggml stores them) and the integer sum (Q4_0
 * and Q8_0 subtract 8 and 128 times it: the weight bytes enter vpdpbusd offset to unsigned). */
#define GROUP 8

typedef struct {
  int8_t* q;    /* [M][padded * 32] */
  float* d;     /* [M][padded] */
  float* s;     /* [M][padded] */
  int32_t* sum; /* [M][padded] */
  int64_t padded;
} act_rows;

static void quantize_rows(int type, const float* x, int64_t M, int64_t K, act_rows* a, int threads) {
  const int64_t blocks = K / 32;
  a->padded = (blocks + GROUP - 1) / GROUP * GROUP;
  a->q = (int8_t*)calloc((size_t)(M * a->padded * 32), 1);
  a->d = (float*)calloc((size_t)(M * a->padded), sizeof(float));
  a->s = (float*)calloc((size_t)(M * a->padded), sizeof(float));
  a->sum = (int32_t*)calloc((size_t)(M * a->padded), sizeof(int32_t));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t m = 0; m < M; ++m) {
    int8_t q[32];
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t i = m * a->padded + b;
      act_block blk;
      a->sum[i] = quantize_block(x + m * K + 32 * b, q, &blk);
      a->d[i] = blk.d, a->s[i] = blk.s;
      int8_t* out = a->q + m * a->padded * 32;
      if (type == Q8_0) {
        memcpy(out + 32 * b, q, 32);
      } else { /* pair p = b / 2: [lows of 2p | lows of 2p+1 | highs of 2p | highs of 2p+1] */
        int8_t* pair = out + 64 * (b / 2) + 16 * (b & 1);
        memcpy(pair, q, 16);
        memcpy(pair + 32, q + 16, 16);
      }
    }
  }
}

static void free_rows(act_rows* a) { free(a->q), free(a->d), free(a->s), free(a->sum); }

/* 8 vectors of 8 int32 lanes -> the 8 vectors' sums, in order (exact: integers). */
static inline __m256i sum8(const __m256i* v) {
  const __m256i h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                          _mm256_permute2x128_si256(h0123, h4567, 0x31));
}

/* A group's ``nb`` (1..8) weight blocks from ``w`` (``bytes`` apart, ``off`` to the values)
 * as vpdpbusd's unsigned operand: Q8_0's 8 blocks offset by 128; the 4-bit formats' 4 pairs
 * of blocks as their low nibbles (wv[p]) and high ones (wv[4 + p]). Blocks past ``nb`` are
 * zeros and never read. */
static inline __attribute__((always_inline)) void unpack_group(int type, const uint8_t* w, int bytes, int off, int nb,
                                                               __m256i* wv) {
  if (type == Q8_0) {
    for (int j = 0; j < GROUP; ++j)
      wv[j] = j < nb ? _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + j * bytes + off)),
                                        _mm256_set1_epi8((char)0x80))
                     : _mm256_setzero_si256();
    return;
  }
  const __m256i low4 = _mm256_set1_epi8(15);
  for (int p = 0; p < GROUP / 2; ++p) {
    const int b = 2 * p;
    const __m128i lo = b < nb ? _mm_loadu_si128((const __m128i*)(w + b * bytes + off)) : _mm_setzero_si128();
    const __m128i hi = b + 1 < nb ? _mm_loadu_si128((const __m128i*)(w + (b + 1) * bytes + off)) : _mm_setzero_si128();
    const __m256i both = _mm256_set_m128i(hi, lo);
    wv[p] = _mm256_and_si256(both, low4);
    wv[GROUP / 2 + p] = _mm256_and_si256(_mm256_srli_epi16(both, 4), low4);
  }
}

/* The group's 8 integer dots (one per block, in block order) against activations ``q``. */
static inline __attribute__((always_inline)) __m256i group_dots(int type, const __m256i* wv, const int8_t* q) {
  if (type == Q8_0) {
    __m256i v[GROUP];
    for (int j = 0; j < GROUP; ++j)
      v[j] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv[j], _mm256_loadu_si256((const __m256i*)(q + 32 * j)));
    return sum8(v);
  }
  __m256i v[GROUP / 2];
  for (int p = 0; p < GROUP / 2; ++p)
    v[p] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wv[p],
                                                   _mm256_loadu_si256((const __m256i*)(q + 64 * p))),
                               wv[GROUP / 2 + p], _mm256_loadu_si256((const __m256i*)(q + 64 * p + 32)));
  /* lanes 0-3 of v[p] are block 2p's, 4-7 block 2p+1's: two hadds give [0 2 4 6 | 1 3 5 7] */
  const __m256i r = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  return _mm256_permutevar8x32_epi32(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* The first 4 bytes of each of a group's ``nb`` blocks (d, and m for Q4_1), one per lane.
 * Neither vpgatherdd nor a store of 8 words read back as a vector: on a Zen 4 each stalled
 * this loop (a quarter of its samples on the first consumer); inserts in registers do not. */
static inline uint32_t word_at(const uint8_t* p, int valid) {
  uint32_t w = 0;
  if (valid) memcpy(&w, p, 4);
  return w;
}

static inline __attribute__((always_inline)) __m256i scale_words(const uint8_t* blk, int bytes, int nb) {
  return _mm256_setr_epi32((int)word_at(blk, 1), (int)word_at(blk + bytes, nb > 1), (int)word_at(blk + 2 * bytes, nb > 2),
                           (int)word_at(blk + 3 * bytes, nb > 3), (int)word_at(blk + 4 * bytes, nb > 4),
                           (int)word_at(blk + 5 * bytes, nb > 5), (int)word_at(blk + 6 * bytes, nb > 6),
                           (int)word_at(blk + 7 * bytes, nb > 7));
}

#define ROWS_MAX 4 /* activation rows per pass over a weight row: 2 x 4 accumulators + 8 weight vectors */

/* One weight row ``w`` against activation rows m0..m0+MR-1 of ``a``: out[i * ldo]. Each group
 * is unpacked once for all MR rows; every output sees the same operations in the same order
 * whatever MR, so a row's result does not depend on the batch. */
static inline __attribute__((always_inline)) void row_dot(int type, int MR, const uint8_t* w, const act_rows* a,
                                                         int64_t m0, int64_t blocks, float* out, int64_t ldo) {
  const int bytes = type == Q8_0 ? 34 : type == Q4_0 ? 18 : 20, off = type == Q4_1 ? 4 : 2;
  const int64_t stride = a->padded;
  __m256 acc[ROWS_MAX], mins[ROWS_MAX];
  for (int i = 0; i < MR; ++i) acc[i] = mins[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < blocks; g += GROUP) {
    const int nb = blocks - g < GROUP ? (int)(blocks - g) : GROUP;
    const uint8_t* blk = w + g * bytes;
    for (int o = 0; o < GROUP * bytes; o += 64) prefetch_ahead(blk + o);
    const __m256i dm = scale_words(blk, bytes, nb);
    const __m256 d_w = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(dm));
    const __m256 m_w = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(dm, 16)));
    __m256i wv[GROUP];
    unpack_group(type, blk, bytes, off, nb, wv);
    for (int i = 0; i < MR; ++i) {
      const int64_t row = (m0 + i) * stride + g;
      __m256i dots = group_dots(type, wv, a->q + row * 32);
      if (type != Q4_1)
        dots = _mm256_sub_epi32(dots, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(a->sum + row)),
                                                        type == Q8_0 ? 7 : 3));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(d_w, _mm256_loadu_ps(a->d + row)), acc[i]);
      if (type == Q4_1) mins[i] = _mm256_fmadd_ps(m_w, _mm256_loadu_ps(a->s + row), mins[i]);
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = hsum256(acc[i]) + (type == Q4_1 ? hsum256(mins[i]) : 0.0f);
}

static inline __attribute__((always_inline)) void rows_dot(int type, const uint8_t* w, const act_rows* a, int64_t M,
                                                          int64_t blocks, float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; m += ROWS_MAX) {
    switch (M - m < ROWS_MAX ? M - m : ROWS_MAX) {
      case 1: row_dot(type, 1, w, a, m, blocks, out + m * ldo, ldo); break;
      case 2: row_dot(type, 2, w, a, m, blocks, out + m * ldo, ldo); break;
      case 3: row_dot(type, 3, w, a, m, blocks, out + m * ldo, ldo); break;
      default: row_dot(type, 4, w, a, m, blocks, out + m * ldo, ldo); break;
    }
  }
}

static inline __attribute__((always_inline)) void tiles_of(int type, const uint8_t* w, int64_t row_bytes,
                                                          const act_rows* a, int64_t blocks, float* out, int64_t M,
                                                          int64_t N, int64_t ldo, int64_t tiles, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * NR, n1 = n0 + NR < N ? n0 + NR : N;
    for (int64_t n = n0; n < n1; ++n) rows_dot(type, w + n * row_bytes, a, M, blocks, out + n, ldo);
  }
}

void xl_linear_q8(int type, const float* x, const uint8_t* w, int64_t row_bytes, float* out, int64_t M, int64_t N,
                  int64_t K, int64_t ldo, int threads) {
  const int64_t blocks = K / 32, tiles = (N + NR - 1) / NR;
  act_rows a;
  quantize_rows(type, x, M, K, &a, threads);
  if (type == Q4_1) tiles_of(Q4_1, w, row_bytes, &a, blocks, out, M, N, ldo, tiles, threads);
  else if (type == Q4_0) tiles_of(Q4_0, w, row_bytes, &a, blocks, out, M, N, ldo, tiles, threads);
  else tiles_of(Q8_0, w, row_bytes, &a, blocks, out, M, N, ldo, tiles, threads);
  free_rows(&a);
}
#else
/* One row of K values (a multiple of 32) into int8 blocks. */
static void quantize_row(const float* x, int64_t K, int8_t* q, act_block* blocks) {
  for (int64_t b = 0; b < K / 32; ++b) quantize_block(x + 32 * b, q + 32 * b, &blocks[b]);
}

/* 16 bytes of nibbles -> 32 bytes: low nibbles are values 0..15, high ones 16..31. */
static inline __m256i nibbles32(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

/* sum of 32 products of unsigned u and signed s bytes, as 8 int32 lanes -> floats */
static inline __m256 dot_us(__m256i u, __m256i s) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* signed . signed: vpmaddubsw takes one unsigned operand, so move the signs onto s */
static inline __m256 dot_ss(__m256i a, __m256i s) {
  return dot_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(s, a));
}

/* NR weight rows (``rows`` real) against one quantized activation row: out[r]. Inlined with
 * a constant ``type``, so each format is its own loop without branches. (Expanding a weight
 * block once for two activation rows measured slower: the accumulators spill.) */
static inline __attribute__((always_inline)) void tile_dot(int type, const uint8_t* w, int64_t row_bytes, int rows,
                                                          const int8_t* xq, const act_block* xb, int64_t blocks,
                                                          float* out) {
  __m256 acc[NR];
  float mins[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps(), mins[r] = 0.0f;
  const int bytes = type == Q8_0 ? 34 : type == Q4_0 ? 18 : 20;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i qx = _mm256_loadu_si256((const __m256i*)(xq + 32 * b));
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w + (r < rows ? r : 0) * row_bytes + b * bytes;
      prefetch_ahead(blk);
      const __m256 d = _mm256_set1_ps(half(blk) * xb[b].d);
      __m256 dot;
      if (type == Q4_1) {
        dot = dot_us(nibbles32(blk + 4), qx);
        mins[r] += half(blk + 2) * xb[b].s;
      } else if (type == Q4_0) {
        dot = dot_ss(_mm256_sub_epi8(nibbles32(blk + 2), _mm256_set1_epi8(8)), qx);
      } else {
        dot = dot_ss(_mm256_loadu_si256((const __m256i*)(blk + 2)), qx);
      }
      acc[r] = _mm256_fmadd_ps(d, dot, acc[r]);
    }
  }
  for (int r = 0; r < rows; ++r) out[r] = hsum256(acc[r]) + mins[r];
}

static inline __attribute__((always_inline)) void tiles_of(int type, const uint8_t* w, int64_t row_bytes,
                                                          const int8_t* xq, const act_block* xb, int64_t blocks,
                                                          float* out, int64_t M, int64_t N, int64_t ldo,
                                                          int64_t tiles, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * NR;
    const int rows = N - n0 < NR ? (int)(N - n0) : NR;
    for (int64_t m = 0; m < M; ++m)
      tile_dot(type, w + n0 * row_bytes, row_bytes, rows, xq + m * blocks * 32, xb + m * blocks, blocks,
               out + m * ldo + n0);
  }
}

/* x: [M, K] fp32; w: [N, row_bytes]; out: [M, ldo], columns 0..N-1. */
void xl_linear_q8(int type, const float* x, const uint8_t* w, int64_t row_bytes, float* out, int64_t M, int64_t N,
                  int64_t K, int64_t ldo, int threads) {
  const int64_t blocks = K / 32, tiles = (N + NR - 1) / NR;
  int8_t* xq = (int8_t*)malloc((size_t)(M * K));
  act_block* xb = (act_block*)malloc(sizeof(act_block) * (size_t)(M * blocks));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, xq + m * K, xb + m * blocks);
  if (type == Q4_1) tiles_of(Q4_1, w, row_bytes, xq, xb, blocks, out, M, N, ldo, tiles, threads);
  else if (type == Q4_0) tiles_of(Q4_0, w, row_bytes, xq, xb, blocks, out, M, N, ldo, tiles, threads);
  else tiles_of(Q8_0, w, row_bytes, xq, xb, blocks, out, M, N, ldo, tiles, threads);
  free(xq);
  free(xb);
}
#endif
