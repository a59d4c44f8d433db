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
#include "vec_math.h"

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

#define LANES 16

/* sum of squares of one row in fp32, in 16 partial sums (a loop the compiler vectorizes) */
static float sum_squares(const void* x, int64_t base, int64_t H, int bf16) {
  float part[LANES] = {0};
  int64_t i = 0;
  if (bf16) {
    const uint16_t* p = (const uint16_t*)x + base;
    for (; i + LANES <= H; i += LANES)
      for (int j = 0; j < LANES; ++j) part[j] += bf16_to_f32(p[i + j]) * bf16_to_f32(p[i + j]);
  } else {
    const float* p = (const float*)x + base;
    for (; i + LANES <= H; i += LANES)
      for (int j = 0; j < LANES; ++j) part[j] += p[i + j] * p[i + j];
  }
  float ss = 0.f;
  for (; i < H; ++i) ss += ld(x, base + i, bf16) * ld(x, base + i, bf16);
  for (int j = 0; j < LANES; ++j) ss += part[j];
  return ss;
}

/* out = w * dtype(x * rsqrt(mean(x^2) + eps)), the statistics in fp32 */
void xl_rmsnorm(const void* x, const void* w, void* out, int64_t T, int64_t H, float eps, int bf16) {
#pragma omp parallel for schedule(static) if (T >= 64)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t base = t * H;
    const float r = 1.0f / sqrtf(sum_squares(x, base, H, bf16) / (float)H + eps);
    if (bf16) {
      const uint16_t *xp = (const uint16_t*)x + base, *wp = (const uint16_t*)w;
      uint16_t* op = (uint16_t*)out + base;
      for (int64_t i = 0; i < H; ++i)
        op[i] = f32_to_bf16(bf16_to_f32(wp[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xp[i]) * r)));
    } else {
      const float *xp = (const float*)x + base, *wp = (const float*)w;
      float* op = (float*)out + base;
      for (int64_t i = 0; i < H; ++i) op[i] = wp[i] * (xp[i] * r);
    }
  }
}

/* In place on the fused projection qkv [T, row] (q heads first, then k heads):
 * x = x*cos + rotate_half(x)*sin for the Hq + Hk rotary heads of each token;
 * cos/sin are [T, D] in the activation dtype. */
void xl_rope(void* qkv, const void* cs, const void* sn, int64_t T, int64_t row, int64_t Hq, int64_t Hk,
             int64_t D, int bf16) {
  const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (T >= 64)
  for (int64_t t = 0; t < T; ++t) {
    float tmp[1024];
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

#ifdef XL_HAVE_BF16_DOT
/* bf16 rows, 16 lanes at a time: the same two roundings as the scalar loop, exp16 for expf. */
static void silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t T, int64_t I) {
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* g_row = gate_up + t * 2 * I;
    for (int64_t i = 0; i < I; i += LANES) {
      const __mmask16 m = I - i >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (I - i)) - 1u);
      const __m512 g = widen_bf16(_mm256_maskz_loadu_epi16(m, g_row + i));
      const __m512 u = widen_bf16(_mm256_maskz_loadu_epi16(m, g_row + I + i));
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 s = widen_bf16(round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e))));
      _mm256_mask_storeu_epi16(out + t * I + i, m, round_bf16(_mm512_mul_ps(s, u)));
    }
  }
}
#endif

/* gate_up: [T, 2I] (gate then up) -> out [T, I] = dtype(silu(gate)) * up */
void xl_silu_mul(const void* gate_up, void* out, int64_t T, int64_t I, int bf16) {
#ifdef XL_HAVE_BF16_DOT
  if (bf16) {
    silu_mul_bf16((const uint16_t*)gate_up, (uint16_t*)out, T, I);
    return;
  }
#endif
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < I; ++i) {
      float g = ld(gate_up, t * 2 * I + i, bf16);
      float u = ld(gate_up, t * 2 * I + I + i, bf16);
      float s = rnd(g / (1.0f + expf(-g)), bf16);
      st(out, t * I + i, s * u, bf16);
    }
  }
}
