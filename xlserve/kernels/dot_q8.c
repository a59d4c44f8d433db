/* Q4_0, Q4_1 and Q8_0 weights against activations quantized to 8 bits per 32 values, the
 * scheme llama.cpp computes these formats with (its Q8_0 / Q8_1 activation blocks):
 *
 *   x block -> d = max|x| / 127 (stored as float16), q = round(x * 127 / max|x|), s = d * sum(q)
 *   w.x     = sum over blocks of  d_w * d_x * (q_w . q_x)   (+ m_w * s_x for Q4_1)
 *
 * q_w . q_x is an exact integer (32 byte products in one vpmaddubsw + vpmaddwd): about half
 * the time of the fp32-activation path per decode matmul (measured: 0.115 vs 0.224 ms for a
 * 3072 x 1024 Q4_1 weight, AVX2, 2 threads). The price is the activations' rounding: results
 * are within bf16's error of the dequantized weights' (tested), not fp32's. Asked for with
 * --int8-activations.
 *
 * Batch invariance: a row's activations are quantized alone, and each output accumulates its
 * blocks in order into 8 fp32 lanes summed in a fixed order, whatever M, the tile or the thread.
 */
#include <math.h>
#include <stdlib.h>

#include "quant_blocks.h"
#include "vec_portable.h"

#define NR 4 /* weight rows per tile: independent accumulation chains */

typedef struct {
  float d, s; /* block scale and d * sum(q), each rounded to float16 as ggml stores them */
} act_block;

int xl_q8_handles(int type) { return type == Q4_0 || type == Q4_1 || type == Q8_0; }

/* One row of K values (a multiple of 32) into int8 blocks (round to nearest even, as
 * llama.cpp's AVX2 quantize_row_q8_1 does). */
static void quantize_row(const float* x, int64_t K, int8_t* q, act_block* blocks) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* v = x + 32 * b;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
    const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int value = (int)nearbyintf(v[j] * id);
      q[32 * b + j] = (int8_t)value;
      sum += value;
    }
    blocks[b].d = half_round(d);
    blocks[b].s = half_round(d * (float)sum);
  }
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
