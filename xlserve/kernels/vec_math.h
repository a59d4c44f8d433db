/* Vector math shared by the kernels (AVX-512, 16 fp32 lanes): bf16 conversions, exp and
 * sixteen horizontal sums at once. */
#ifndef XLSERVE_VEC_MATH_H
#define XLSERVE_VEC_MATH_H
#include <immintrin.h>

/* 16 bf16 values (raw bits) -> fp32: a 16-bit shift, exact (bf16_to_f32 of bf16.h). */
static inline __m512 widen_bf16(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

#ifdef XL_HAVE_BF16_DOT
/* 16 fp32 -> bf16 bits, rounded to nearest even (f32_to_bf16 of bf16.h). */
static inline __m256i round_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#endif

/* exp(x) for 16 lanes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial
 * (relative error below 1e-6, as good as an fp32 softmax needs); inputs below -88 give ~0. */
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}


/* out[j] = sum of the lanes of v[j], for sixteen vectors. The tree leaves lane 4k+m holding
 * v[4m+k]; the last permute puts each sum in its place. */
static inline __m512 reduce16(const __m512 v[16]) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, s);
}

#endif
