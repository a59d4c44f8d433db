/* Decode attention: one query token per sequence against its paged KV context.
 *
 * One task per (sequence, kv head) reads each cached K/V row once for all the query
 * heads that share it (grouped-query attention). Keys go sixteen at a time: sixteen dot
 * products are reduced together by a shuffle tree (a quarter of the shuffles of sixteen
 * separate horizontal sums), the softmax exponentials are taken sixteen lanes at a time,
 * and the weighted sum of V rows stays in registers for a 64-wide slice of the head.
 * Softmax and accumulation in fp32; the output rounded once to the activation dtype.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec_math.h"

#define KEYS 16
#define SLICE 64 /* head dims per pass of the weighted V sum: 4 zmm per query head */
#define MAX_GROUP 64

static inline __m512 load16(const void* p, int64_t i, int bf16) {
  if (bf16) return widen_bf16(_mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i)));
  return _mm512_loadu_ps((const float*)p + i);
}

/* Cache offsets of keys j0 .. j0 + 15 of one kv head; a short last block (m < 16 keys)
 * repeats its last key, whose extra lanes store_scores drops. */
static inline void key_offsets(const int64_t* slots, int64_t j0, int64_t m, int64_t Hk, int64_t kh, int64_t D,
                               int64_t base[KEYS]) {
  for (int j = 0; j < KEYS; ++j) base[j] = (slots[j0 + (j < m ? j : m - 1)] * Hk + kh) * D;
}

/* scores[j0 .. j0 + m) = scale * the lane sums of the sixteen accumulators. */
static inline void store_scores(const __m512 acc[KEYS], float scale, int64_t m, float* scores) {
  const __m512 s = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(scores, (__mmask16)((1u << m) - 1u), s);
}

/* scores[j] = scale * q . K[slot j] for the n keys of one kv head (D % 16 == 0). Loops
 * have constant bounds so the sixteen accumulators live in registers. */
static void scores_of(const float* q, const void* kc, const int64_t* slots, int64_t n, int64_t Hk, int64_t kh,
                      int64_t D, float scale, int bf16, float* scores) {
  for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
    const int64_t m = n - j0 < KEYS ? n - j0 : KEYS;
    int64_t base[KEYS];
    key_offsets(slots, j0, m, Hk, kh, D, base);
    __m512 acc[KEYS];
    for (int j = 0; j < KEYS; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      for (int j = 0; j < KEYS; ++j) acc[j] = _mm512_fmadd_ps(qv, load16(kc, base[j] + d, bf16), acc[j]);
    }
    store_scores(acc, scale, m, scores + j0);
  }
}

#ifdef XL_HAVE_BF16_DOT
/* scores_of for bf16 q and K on CPUs with AVX512-BF16: vdpbf16ps multiplies 32 bf16 pairs
 * per instruction straight from the cache rows (exact products, fp32 sums), a quarter of
 * the instructions of widening each K row to fp32 for every query head. */
static void scores_of_bf16(const uint16_t* q, const uint16_t* kc, const int64_t* slots, int64_t n, int64_t Hk,
                           int64_t kh, int64_t D, float scale, float* scores) {
  for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
    const int64_t m = n - j0 < KEYS ? n - j0 : KEYS;
    int64_t base[KEYS];
    key_offsets(slots, j0, m, Hk, kh, D, base);
    __m512 acc[KEYS];
    for (int j = 0; j < KEYS; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      const __mmask32 k = D - d >= 32 ? 0xFFFFFFFFu : (__mmask32)((1ull << (D - d)) - 1ull);
      const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(k, q + d);
      for (int j = 0; j < KEYS; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_maskz_loadu_epi16(k, kc + base[j] + d));
    }
    store_scores(acc, scale, m, scores + j0);
  }
}
#endif

/* p = exp(s - max), in place; returns the sum. */
static float softmax_numerators(float* s, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, s + j));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
    const __m512 p = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), m)));
    _mm512_mask_storeu_ps(s + j, k, p);
    sum = _mm512_add_ps(sum, p);
  }
  return _mm512_reduce_add_ps(sum);
}

/* acc[g] = sum_j p[g][j] V[slot j][d0 : d0 + 16 CW) for GS query heads. Inlined with
 * constant GS and CW, so the GS x CW accumulators stay in registers. */
static inline __attribute__((always_inline)) void weighted_slice(
    const float* p, int64_t n, const void* vc, const int64_t* slots, int64_t Hk, int64_t kh, int64_t D,
    int64_t d0, int bf16, const int GS, const int CW, __m512 acc[4][SLICE / 16]) {
  for (int g = 0; g < GS; ++g)
    for (int c = 0; c < CW; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t base = (slots[j] * Hk + kh) * D + d0;
    __m512 v[SLICE / 16];
    for (int c = 0; c < CW; ++c) v[c] = load16(vc, base + 16 * c, bf16);
    for (int g = 0; g < GS; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * n + j]);
      for (int c = 0; c < CW; ++c) acc[g][c] = _mm512_fmadd_ps(pg, v[c], acc[g][c]);
    }
  }
}

#define WEIGHTED_CASE(GS, CW) weighted_slice(p + g0 * n, n, vc, slots, Hk, kh, D, d0, bf16, GS, CW, acc)

/* out[g] = sum_j p[g][j] V[slot j] / denom[g], slice by slice of the head, four query heads
 * at a time. */
static void weighted_values(const float* p, const float* denom, int64_t group, int64_t n, const void* vc,
                            const int64_t* slots, int64_t Hk, int64_t kh, int64_t D, int bf16, float* out) {
  for (int64_t d0 = 0; d0 < D; d0 += SLICE) {
    const int cw = (int)((D - d0 < SLICE ? D - d0 : SLICE) / 16);
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      const int gs = (int)(group - g0 < 4 ? group - g0 : 4);
      __m512 acc[4][SLICE / 16];
      if (cw == 4) {
        switch (gs) {
          case 1: WEIGHTED_CASE(1, 4); break;
          case 2: WEIGHTED_CASE(2, 4); break;
          case 3: WEIGHTED_CASE(3, 4); break;
          default: WEIGHTED_CASE(4, 4); break;
        }
      } else {
        switch (cw) {
          case 1: WEIGHTED_CASE(gs, 1); break;
          case 2: WEIGHTED_CASE(gs, 2); break;
          default: WEIGHTED_CASE(gs, 3); break;
        }
      }
      for (int g = 0; g < gs; ++g) {
        const __m512 inv = _mm512_set1_ps(1.0f / denom[g0 + g]);
        for (int c = 0; c < cw; ++c) _mm512_storeu_ps(out + (g0 + g) * D + d0 + 16 * c, _mm512_mul_ps(acc[g][c], inv));
      }
    }
  }
}

/* q, k_new, v_new: B rows `row` elements apart (views into the fused projection), heads
 * contiguous; caches: [slots, Hk, D]; slots: [B, L] (row b uses its first lens[b]);
 * out: [B, Hq, D]. First writes each sequence's new K/V into new_slots[b].
 * The caller guarantees D % 16 == 0 and Hq / Hk <= 64. */
void xl_decode_attention(const void* q, const void* k_new, const void* v_new, int64_t row,
                         const int64_t* new_slots, void* kc, void* vc, const int64_t* slots,
                         const int64_t* lens, void* out, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                         int64_t L, float scale, int bf16, int threads) {
  const int64_t group = Hq / Hk, esize = bf16 ? 2 : 4;
  for (int64_t b = 0; b < B; ++b) {
    memcpy((char*)kc + new_slots[b] * Hk * D * esize, (const char*)k_new + b * row * esize, Hk * D * esize);
    memcpy((char*)vc + new_slots[b] * Hk * D * esize, (const char*)v_new + b * row * esize, Hk * D * esize);
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t bk = 0; bk < B * Hk; ++bk) {
    const int64_t b = bk / Hk, kh = bk % Hk, n = lens[b];
    const int64_t* seq_slots = slots + b * L;
    float* qf = (float*)malloc(sizeof(float) * group * D * 2 + sizeof(float) * group * ((n + 15) & ~15));
    float* acc = qf + group * D;
    float* p = acc + group * D;
    float denom[MAX_GROUP];
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kh * group + g;
#ifdef XL_HAVE_BF16_DOT
      if (bf16) {
        scores_of_bf16((const uint16_t*)q + b * row + h * D, kc, seq_slots, n, Hk, kh, D, scale, p + g * n);
        denom[g] = softmax_numerators(p + g * n, n);
        continue;
      }
#endif
      for (int64_t i = 0; i < D; ++i)
        qf[g * D + i] = bf16 ? bf16_to_f32(((const uint16_t*)q)[b * row + h * D + i]) : ((const float*)q)[b * row + h * D + i];
      scores_of(qf + g * D, kc, seq_slots, n, Hk, kh, D, scale, bf16, p + g * n);
      denom[g] = softmax_numerators(p + g * n, n);
    }
    weighted_values(p, denom, group, n, vc, seq_slots, Hk, kh, D, bf16, acc);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t o = (b * Hq + kh * group + g) * D;
      for (int64_t i = 0; i < D; ++i) {
        if (bf16) ((uint16_t*)out)[o + i] = f32_to_bf16(acc[g * D + i]);
        else ((float*)out)[o + i] = acc[g * D + i];
      }
    }
    free(qf);
  }
}
