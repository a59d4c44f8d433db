/* Skinny matmul for CPU decode: out[M, N] = x[M, K] @ W[N, K]^T with bfloat16 weights.
 *
 * With a few activation rows a matmul is one pass over the weights, so its speed is
 * memory bandwidth. With 1 or 2 rows (ROW_STREAM_MAX) each thread reads its weight rows one
 * at a time, front to back: on a 2-core AMD EPYC (Zen 4) the default model's 30 layers and
 * head (268 MB of bf16) took 11.9 ms with eight rows read side by side (eight streams 1-3 KB
 * apart) and 8.2-8.5 ms one row at a time, ~32 GB/s, the machine's streaming bandwidth (fp32
 * or bf16 activations alike; software prefetch 2-32 rows ahead measured the same or slower,
 * so the row path has none). Larger batches take blocks of rows that stay in L1 while
 * every activation row multiplies them. Weights are widened from bf16 to fp32 in registers
 * (a 16-bit shift, exact); accumulation is fp32, one accumulator per output, so a row's
 * result is the same bits on either path. Rows or blocks are split over OpenMP threads.
 * Plain C with no torch headers: it compiles in about a second and is called by ctypes.
 */
#include <immintrin.h>
#include <stdint.h>

#include "vec_math.h"

#define ROW_BLOCK 8
#define ROW_STREAM_MAX 2 /* activation rows up to which weight rows stream one at a time */

static inline __m512 load_w(const uint16_t* p, int64_t remaining) {
  if (remaining >= 16) return widen_bf16(_mm256_loadu_si256((const __m256i*)p));
  return widen_bf16(_mm256_maskz_loadu_epi16((__mmask16)((1u << remaining) - 1u), p));
}

static inline __m512 load_x(const float* p, int64_t remaining) {
  if (remaining >= 16) return _mm512_loadu_ps(p);
  return _mm512_maskz_loadu_ps((__mmask16)((1u << remaining) - 1u), p);
}

/* R weight rows (R <= ROW_BLOCK) against MR activation rows (MR <= 4); PF: prefetch the rows
 * four blocks ahead. */
#define BLOCK_DOT(R, MR, PF)                                                               \
  static void dot_##R##_##MR(const uint16_t* w, const float* x, int64_t K, float* out,     \
                             int64_t N) {                                                  \
    __m512 acc[R][MR];                                                                     \
    for (int r = 0; r < R; ++r)                                                            \
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();                        \
    for (int64_t k = 0; k < K; k += 16) {                                                  \
      __m512 xv[MR];                                                                       \
      for (int m = 0; m < MR; ++m) xv[m] = load_x(x + m * K + k, K - k);                   \
      for (int r = 0; r < R; ++r) {                                                        \
        if (PF) _mm_prefetch((const char*)(w + (r + ROW_BLOCK * 4) * K + k), _MM_HINT_T0);  \
        __m512 wv = load_w(w + r * K + k, K - k);                                          \
        for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);    \
      }                                                                                    \
    }                                                                                      \
    for (int r = 0; r < R; ++r)                                                            \
      for (int m = 0; m < MR; ++m) out[m * N + r] = _mm512_reduce_add_ps(acc[r][m]);       \
  }

BLOCK_DOT(8, 1, 1) BLOCK_DOT(8, 2, 1) BLOCK_DOT(8, 3, 1) BLOCK_DOT(8, 4, 1)
BLOCK_DOT(1, 1, 0) BLOCK_DOT(1, 2, 0) BLOCK_DOT(1, 3, 0) BLOCK_DOT(1, 4, 0)

typedef void (*dot_fn)(const uint16_t*, const float*, int64_t, float*, int64_t);
static const dot_fn DOT4[5] = {0, dot_8_1, dot_8_2, dot_8_3, dot_8_4};
static const dot_fn DOT1[5] = {0, dot_1_1, dot_1_2, dot_1_3, dot_1_4};

/* x: [M, K] fp32, w: [N, K] bf16 bits, out: [M, N] fp32; all contiguous. */
void xl_gemv_bf16(const float* x, const uint16_t* w, float* out, int64_t M, int64_t N, int64_t K,
                  int threads) {
  if (M <= ROW_STREAM_MAX) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) DOT1[M](w + n * K, x, K, out + n, N);
    return;
  }
  const int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n0 = b * ROW_BLOCK;
    const int64_t rows = N - n0 < ROW_BLOCK ? N - n0 : ROW_BLOCK;
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t mr = M - m < 4 ? M - m : 4;
      if (rows == ROW_BLOCK) {
        DOT4[mr](w + n0 * K, x + m * K, K, out + m * N + n0, N);
      } else {
        for (int64_t r = 0; r < rows; ++r) DOT1[mr](w + (n0 + r) * K, x + m * K, K, out + m * N + n0 + r, N);
      }
    }
  }
}

#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "scratch.h"

#ifdef XL_HAVE_BF16_DOT
/* bf16 activations on CPUs with AVX512-BF16: vdpbf16ps multiplies 32 bf16 pairs per
 * instruction (exact products, fp32 accumulation), half the work of widening. */
static inline __m512i load_pairs(const uint16_t* p, int64_t remaining) {
  if (remaining >= 32) return _mm512_loadu_si512((const void*)p);
  return _mm512_maskz_loadu_epi16((__mmask32)((1ull << remaining) - 1ull), p);
}

/* sums[i] = the lane sum of v[i]: sixteen at once by a shuffle tree (a quarter of the
 * shuffles of sixteen separate horizontal sums), fewer one by one. */
static inline void lane_sums(const __m512* v, int n, float* sums) {
  int i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(sums + i, reduce16(v + i));
  for (; i < n; ++i) sums[i] = _mm512_reduce_add_ps(v[i]);  /* the same tree, one vector */
}

/* R weight rows x MR activation rows, one accumulator each: every output is the lane sum
 * (one fixed tree, lane_sums) of dot products over k in steps of 32 from 0, whatever R and
 * MR are, so a row's result is the same bits in any batch. */
#define BLOCK_DOTBF(R, MR)                                                                   \
  static void dotbf_##R##_##MR(const uint16_t* w, const uint16_t* x, int64_t K, float* out,  \
                               int64_t N) {                                                  \
    __m512 acc[R][MR];                                                                       \
    for (int r = 0; r < R; ++r)                                                              \
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();                          \
    for (int64_t k = 0; k < K; k += 32) {                                                    \
      __m512bh xv[MR];                                                                       \
      for (int m = 0; m < MR; ++m) xv[m] = (__m512bh)load_pairs(x + m * K + k, K - k);       \
      for (int r = 0; r < R; ++r) {                                                          \
        __m512bh wv = (__m512bh)load_pairs(w + r * K + k, K - k);                            \
        for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);     \
      }                                                                                      \
    }                                                                                        \
    float sums[R * MR];                                                                      \
    lane_sums(&acc[0][0], R * MR, sums);                                                     \
    for (int r = 0; r < R; ++r)                                                              \
      for (int m = 0; m < MR; ++m) out[m * N + r] = sums[r * MR + m];                        \
  }

/* 1-2 rows: weight rows streamed one at a time (see the top of this file). */
BLOCK_DOTBF(1, 1) BLOCK_DOTBF(1, 2)
/* Batches (3 to 64+ rows) are bound by vdpbf16ps, not memory: 4 x 4 accumulators take 8
 * loads per 16 products where 8 x 2 take 10, and the weight block stays in L1 across the
 * row blocks. Measured on a 2-core AVX512-BF16 Xeon without AMX (gate/up 3072 x 576, 16
 * rows): 8 x 2 499 us, 4 x 4 454 us, 4 x 4 with the prefetch 443-509 us (noisy, no gain). */
BLOCK_DOTBF(4, 1) BLOCK_DOTBF(4, 2) BLOCK_DOTBF(4, 3) BLOCK_DOTBF(4, 4)
BLOCK_DOTBF(1, 3) BLOCK_DOTBF(1, 4)

typedef void (*dotbf_fn)(const uint16_t*, const uint16_t*, int64_t, float*, int64_t);
typedef struct {
  int64_t rows, batch;  /* weight rows a block, activation rows a pass */
  dotbf_fn block[5], single[5];  /* by activation rows in the pass: a whole block, one weight row */
} dotbf_plan;
static const dotbf_plan STREAM = {1, ROW_STREAM_MAX, {0, dotbf_1_1, dotbf_1_2}, {0, dotbf_1_1, dotbf_1_2}};
static const dotbf_plan BATCHED = {4, 4, {0, dotbf_4_1, dotbf_4_2, dotbf_4_3, dotbf_4_4},
                                   {0, dotbf_1_1, dotbf_1_2, dotbf_1_3, dotbf_1_4}};

static void gemv_bf16_pairs(const uint16_t* x, const uint16_t* w, float* out, int64_t M, int64_t N, int64_t K,
                            int threads) {
  const dotbf_plan* plan = M <= ROW_STREAM_MAX ? &STREAM : &BATCHED;
  const int64_t R = plan->rows, blocks = (N + R - 1) / R;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n0 = b * R;
    const int64_t rows = N - n0 < R ? N - n0 : R;
    for (int64_t m = 0; m < M; m += plan->batch) {
      const int64_t mr = M - m < plan->batch ? M - m : plan->batch;
      if (rows == R) {
        plan->block[mr](w + n0 * K, x + m * K, K, out + m * N + n0, N);
      } else {
        for (int64_t r = 0; r < rows; ++r) plan->single[mr](w + (n0 + r) * K, x + m * K, K, out + m * N + n0 + r, N);
      }
    }
  }
}

/* 1 when bf16 activations multiply on vdpbf16ps (the row and batched kernels above). */
int xl_bf16_dot_ready(void) { return 1; }
#else
int xl_bf16_dot_ready(void) { return 0; }
#endif

/* fp32 products ``of`` [M, N] -> out: + bias, rounded to the dtype, + residual, rounded
 * again (in place when out is fp32 and is ``of``). */
static void linear_epilogue(float* of, const void* bias, const void* residual, void* out, int64_t M, int64_t N,
                            int bf16) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      float v = of[m * N + n];
      if (bias) v += bf16 ? bf16_to_f32(((const uint16_t*)bias)[n]) : ((const float*)bias)[n];
      if (residual) {
        if (bf16) v = bf16_to_f32(f32_to_bf16(v)) + bf16_to_f32(((const uint16_t*)residual)[m * N + n]);
        else v += ((const float*)residual)[m * N + n];
      }
      if (bf16) ((uint16_t*)out)[m * N + n] = f32_to_bf16(v);
      else of[m * N + n] = v;
    }
  }
}

/* out = x @ w.T (+ bias) (+ residual), x and out in bf16 or fp32, as eager torch computes
 * it: fp32 accumulation with the bias, rounded to the dtype; then the residual added and
 * rounded again. bias: [N], residual: [M, N], both in the activation dtype or NULL.
 * bf16: 0 fp32 x and out, 1 bf16 x and out, XL_BF16_X_F32_OUT bf16 x and the fp32 sums as
 * they are (the logits; no bias or residual). */
#define XL_BF16_X_F32_OUT 2
void xl_linear_bf16(const void* x, const uint16_t* w, const void* bias, const void* residual, void* out,
                    int64_t M, int64_t N, int64_t K, int bf16, int threads) {
  const int f32_out = bf16 == XL_BF16_X_F32_OUT;
  float* of = (bf16 && !f32_out) ? (float*)xl_scratch(sizeof(float) * M * N) : (float*)out;
  float* xf = (float*)x;
#ifdef XL_HAVE_BF16_DOT
  if (bf16) {
    gemv_bf16_pairs((const uint16_t*)x, w, of, M, N, K, threads);
    xf = NULL;
  }
#endif
  if (bf16 && xf) {
    xf = (float*)xl_scratch(sizeof(float) * M * K);
    for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_f32(((const uint16_t*)x)[i]);
  }
  if (xf) xl_gemv_bf16(xf, w, of, M, N, K, threads);
  if (bf16 && xf) free(xf);
  if (f32_out) return;
  linear_epilogue(of, bias, residual, out, M, N, bf16);
  if (bf16) free(of);
}
