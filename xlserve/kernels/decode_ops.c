/* Fused CPU kernels for the small-batch (decode) step.
 *
 * At batch 1 a decoder layer is ~30 tiny torch ops whose dispatch costs more than
 * their math. These kernels do each piece in one call and reproduce the rounding of the
 * eager torch code they replace: intermediate results are rounded to the model dtype
 * (bf16, round-to-nearest-even) exactly where torch would round them.
 * Tensors are contiguous; `bf16` says whether activations are bf16 (else fp32).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* load / store element i of an activation buffer in fp32 */
static inline float ld(const void* p, int64_t i, int bf16) {
  return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}
static inline void st(void* p, int64_t i, float v, int bf16) {
  if (bf16) ((uint16_t*)p)[i] = f32_to_bf16(v);
  else ((float*)p)[i] = v;
}
/* round to the activation dtype, staying in fp32 */
static inline float rnd(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* out = w * dtype(x * rsqrt(mean(x^2) + eps)), the statistics in fp32 */
void xl_rmsnorm(const void* x, const void* w, void* out, int64_t T, int64_t H, float eps, int bf16) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t base = t * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; ++i) {
      float v = ld(x, base + i, bf16);
      ss += v * v;
    }
    float r = 1.0f / sqrtf(ss / (float)H + eps);
    for (int64_t i = 0; i < H; ++i)
      st(out, base + i, ld(w, i, bf16) * rnd(ld(x, base + i, bf16) * r, bf16), bf16);
  }
}

/* In place on the fused projection qkv [T, row] (q heads first, then k heads):
 * x = x*cos + rotate_half(x)*sin for the Hq + Hk rotary heads of each token;
 * cos/sin are [T, D] in the activation dtype. */
void xl_rope(void* qkv, const void* cs, const void* sn, int64_t T, int64_t row, int64_t Hq, int64_t Hk,
             int64_t D, int bf16) {
  const int64_t half = D / 2;
  float tmp[1024];
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < Hq + Hk; ++h) {
      const int64_t base = t * row + h * D;
      for (int64_t i = 0; i < D; ++i) tmp[i] = ld(qkv, base + i, bf16);
      for (int64_t i = 0; i < D; ++i) {
        float rot = i < half ? -tmp[i + half] : tmp[i - half];
        float a = rnd(tmp[i] * ld(cs, t * D + i, bf16), bf16);
        float b = rnd(rot * ld(sn, t * D + i, bf16), bf16);
        st(qkv, base + i, a + b, bf16);
      }
    }
  }
}

/* gate_up: [T, 2I] (gate then up) -> out [T, I] = dtype(silu(gate)) * up */
void xl_silu_mul(const void* gate_up, void* out, int64_t T, int64_t I, int bf16) {
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < I; ++i) {
      float g = ld(gate_up, t * 2 * I + i, bf16);
      float u = ld(gate_up, t * 2 * I + I + i, bf16);
      float s = rnd(g / (1.0f + expf(-g)), bf16);
      st(out, t * I + i, s * u, bf16);
    }
  }
}

/* Vector helpers: 16 lanes of the activation dtype widened to fp32. */
#include <immintrin.h>
static inline __m512 vld(const void* p, int64_t i, int bf16) {
  if (bf16) {
    __m256i raw = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  return _mm512_loadu_ps((const float*)p + i);
}

static inline float dot(const float* q, const void* k, int64_t base, int64_t D, int bf16) {
  if (D % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), vld(k, base + i, bf16), acc);
    return _mm512_reduce_add_ps(acc);
  }
  float s = 0.f;
  for (int64_t i = 0; i < D; ++i) s += q[i] * ld(k, base + i, bf16);
  return s;
}

static inline void axpy(float* acc, float p, const void* v, int64_t base, int64_t D, int bf16) {
  if (D % 16 == 0) {
    __m512 pv = _mm512_set1_ps(p);
    for (int64_t i = 0; i < D; i += 16)
      _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, vld(v, base + i, bf16), _mm512_loadu_ps(acc + i)));
    return;
  }
  for (int64_t i = 0; i < D; ++i) acc[i] += p * ld(v, base + i, bf16);
}

/* One query token per sequence against its paged context, after writing that token's
 * key and value into their slots (new_slots[b]).
 * q, k_new, v_new: B rows `row` elements apart (views into the fused projection), heads
 * contiguous; caches: [slots, Hk, D]; slots: [B, L] (row b uses its first lens[b]);
 * out: [B, Hq, D]. Softmax in fp32; the output rounded once to the activation dtype. */
void xl_decode_attention(const void* q, const void* k_new, const void* v_new, int64_t row,
                         const int64_t* new_slots, void* kc, void* vc, const int64_t* slots,
                         const int64_t* lens, void* out, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                         int64_t L, float scale, int bf16, int threads) {
  const int64_t group = Hq / Hk, esize = bf16 ? 2 : 4;
  for (int64_t b = 0; b < B; ++b) {
    memcpy((char*)kc + new_slots[b] * Hk * D * esize, (const char*)k_new + b * row * esize, Hk * D * esize);
    memcpy((char*)vc + new_slots[b] * Hk * D * esize, (const char*)v_new + b * row * esize, Hk * D * esize);
  }
  /* One task per (sequence, kv head): each cached K/V row is read once for all the query
   * heads that share it (grouped-query attention). */
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t bk = 0; bk < B * Hk; ++bk) {
    const int64_t b = bk / Hk, kh = bk % Hk, n = lens[b];
    float* qv = (float*)__builtin_alloca(sizeof(float) * group * D);
    float* acc = (float*)__builtin_alloca(sizeof(float) * group * D);
    float* scores = (float*)malloc(sizeof(float) * group * n);  /* heap: contexts can be long */
    float mx[64], denom[64];  /* group <= 64, checked by the caller */
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t i = 0; i < D; ++i) qv[g * D + i] = ld(q, b * row + (kh * group + g) * D + i, bf16);
      mx[g] = -INFINITY;
      denom[g] = 0.f;
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t base = (slots[b * L + j] * Hk + kh) * D;
      for (int64_t g = 0; g < group; ++g) {
        float s = dot(qv + g * D, kc, base, D, bf16) * scale;
        scores[g * n + j] = s;
        if (s > mx[g]) mx[g] = s;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t j = 0; j < n; ++j) {
        scores[g * n + j] = expf(scores[g * n + j] - mx[g]);
        denom[g] += scores[g * n + j];
      }
      for (int64_t i = 0; i < D; ++i) acc[g * D + i] = 0.f;
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t base = (slots[b * L + j] * Hk + kh) * D;
      for (int64_t g = 0; g < group; ++g) axpy(acc + g * D, scores[g * n + j] / denom[g], vc, base, D, bf16);
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t i = 0; i < D; ++i) st(out, (b * Hq + kh * group + g) * D + i, acc[g * D + i], bf16);
    free(scores);
  }
}
