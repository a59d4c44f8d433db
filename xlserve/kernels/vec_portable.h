/* One vector vocabulary for the kernels built twice (AVX-512: 16 fp32 lanes; AVX2 + FMA +
 * F16C: 8), so a source reads the same for both and each build is tested on its own. */
#ifndef XLSERVE_VEC_PORTABLE_H
#define XLSERVE_VEC_PORTABLE_H
#include <immintrin.h>
#include <stdint.h>

/* the 8 lanes of v summed in a fixed order (the AVX2 build's vsum; dot_q8.c's 8-lane sums) */
static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#if defined(__AVX512F__)
typedef __m512 vf;
#define VW 16
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
#define vset1 _mm512_set1_ps
#define vmul _mm512_mul_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vdiv _mm512_div_ps
#define vmax _mm512_max_ps
#define vmin _mm512_min_ps
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
/* s[i] = vsum(v[i]) for 16 vectors at once: the same additions, in the same pairs, as
 * _mm512_reduce_add_ps on each (lanes j + j+8, then j + j+4, j + j+2, j + j+1), so the same
 * bits; shuffles pair two vectors' halves per addition, 45 instructions where 16 reductions
 * take about 130. The result's lane 4k + j holds v[4j + k]'s sum, hence the final permute. */
static inline void vsum16(const vf* v, float* s) {
  vf h1[8], h2[4], h3[2];
  for (int i = 0; i < 8; ++i)
    h1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),   /* chunks 0 1 | 0 1 */
                          _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));  /* chunks 2 3 | 2 3 */
  for (int i = 0; i < 4; ++i)
    h2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(h1[2 * i], h1[2 * i + 1], 0x88),  /* chunks 0 2 | 0 2 */
                          _mm512_shuffle_f32x4(h1[2 * i], h1[2 * i + 1], 0xDD)); /* chunks 1 3 | 1 3 */
  for (int i = 0; i < 2; ++i)
    h3[i] = _mm512_add_ps(_mm512_shuffle_ps(h2[2 * i], h2[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(h2[2 * i], h2[2 * i + 1], 0xEE));
  const vf sums = _mm512_add_ps(_mm512_shuffle_ps(h3[0], h3[1], 0x88), _mm512_shuffle_ps(h3[0], h3[1], 0xDD));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  _mm512_storeu_ps(s, _mm512_permutexvar_ps(order, sums));
}
/* each lane's two bf16 halves as fp32: the low (bits 0-15) and the high one (bits 16-31) */
static inline vf vbf16_low(vf v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(v), 16)); }
static inline vf vbf16_high(vf v) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0xFFFF0000)));
}
/* r[i][j] -> r[j][i] for the 16 x 16 lanes of r[0..15] */
static inline void vtranspose(vf* r) {
  vf t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xDD);
  }
}
/* the largest lane (no NaN) */
static inline float vmax_lanes(vf v) { return _mm512_reduce_max_ps(v); }
/* VW bf16 values (raw bits) -> fp32, exact */
static inline vf vload_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
/* exp over the lanes: 2^n * p(r), r = x - n ln2, degree-6 polynomial (relative error < 1e-6) */
static inline vf vexp(vf x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
#else
typedef __m256 vf;
#define VW 8
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
#define vset1 _mm256_set1_ps
#define vmul _mm256_mul_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vdiv _mm256_div_ps
#define vmax _mm256_max_ps
#define vmin _mm256_min_ps
static inline float vsum(vf v) { return hsum256(v); }
/* r[i][j] -> r[j][i] for the 8 x 8 lanes of r[0..7] */
static inline void vtranspose(vf* r) {
  vf t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}
static inline float vmax_lanes(vf v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}
static inline vf vload_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline vf vexp(vf x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const vf n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  vf r = vfma(n, vset1(-0.693145752f), x);
  r = vfma(n, vset1(-1.42860677e-6f), r);
  vf p = vset1(1.0f / 720);
  p = vfma(p, r, vset1(1.0f / 120));
  p = vfma(p, r, vset1(1.0f / 24));
  p = vfma(p, r, vset1(1.0f / 6));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.0f));
  p = vfma(p, r, vset1(1.0f));
#if defined(__AVX512F__)
  return _mm512_scalef_ps(p, n);
#else
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
#endif
}
/* fp32 lanes rounded to bfloat16 as bf16.h's f32_to_bf16 rounds (to nearest even), then either
 * widened back (vround_bf16) or stored as bfloat16 (vstore_bf16): the row kernels' bf16
 * roundings, VW at a time, with the same bits as the scalar ones. */
#if defined(__AVX512F__)
static inline __m512i round_bits_bf16(vf v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
}
static inline vf vround_bf16(vf v) {
  return _mm512_castsi512_ps(_mm512_and_si512(round_bits_bf16(v), _mm512_set1_epi32((int)0xFFFF0000u)));
}
static inline void vstore_bf16(uint16_t* p, vf v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bits_bf16(v), 16)));
}
#else
static inline __m256i round_bits_bf16(vf v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
}
static inline vf vround_bf16(vf v) {
  return _mm256_castsi256_ps(_mm256_and_si256(round_bits_bf16(v), _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline void vstore_bf16(uint16_t* p, vf v) {
  const __m256i high = _mm256_srli_epi32(round_bits_bf16(v), 16); /* each fits 16 bits: the pack cannot saturate */
  _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
}
#endif

/* s[i] = vsum(v[i]) for i < n (the same bits): 16 at a time where the build has vsum16 */
static inline void vsums(const vf* v, int n, float* s) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) vsum16(v + i, s + i);
  if (n - i >= 8) { /* a part group still beats one reduction each */
    vf rest[16];
    for (int j = 0; j < 16; ++j) rest[j] = i + j < n ? v[i + j] : vzero();
    float sums[16];
    vsum16(rest, sums);
    for (int j = 0; i + j < n; ++j) s[i + j] = sums[j];
    return;
  }
#endif
  for (; i < n; ++i) s[i] = vsum(v[i]);
}

/* VW rows of VW fp32 values at ``in`` (``stride`` values apart), transposed: r[j] = column j */
static inline void vload_transposed(const float* in, int64_t stride, vf* r) {
  for (int i = 0; i < VW; ++i) r[i] = vload(in + stride * i);
  vtranspose(r);
}

/* VW values of a row in the activation dtype (fp32, or bf16 when ``bf16``) as fp32 lanes, and back */
static inline vf load_lanes(const void* p, int64_t i, int bf16) {
  return bf16 ? vload_bf16((const uint16_t*)p + i) : vload((const float*)p + i);
}
static inline void store_lanes(void* p, int64_t i, vf v, int bf16) {
  if (bf16) vstore_bf16((uint16_t*)p + i, v);
  else vstore((float*)p + i, v);
}
static inline vf round_lanes(vf v, int bf16) { return bf16 ? vround_bf16(v) : v; }
#endif
