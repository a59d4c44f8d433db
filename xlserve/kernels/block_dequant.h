/* The block formats dequantized, bit-exact with gguf-py and ggml (the same fp32 products and
 * sums in the same order; built with -ffp-contract=off): a block into memory (block_*),
 * and a 32-value block into vectors for the register path (regs_*; block_*_regs stores those
 * for the 32-value formats). For gemm_quant.c. */
#ifndef XLSERVE_BLOCK_DEQUANT_H
#define XLSERVE_BLOCK_DEQUANT_H
#include <stdint.h>

#include "quant_blocks.h"
#include "vec_portable.h"

#define VPB (32 / VW) /* vectors per 32-value block */

#if defined(__AVX512F__)
/* 16 signed bytes -> 16 lanes */
static inline void i8_lanes(__m128i b, vf* out) { out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
#else
/* 8 bytes -> 8 int32 lanes, widened straight from memory (vpmovzxbd with a memory operand) */
static inline __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
/* 16 signed bytes -> 2 x 8 lanes */
static inline void i8_lanes(__m128i b, vf* out) {
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}
#endif

/* The eight 6-bit scales and mins of a K-quant super-block (12 bytes). */
static void scale_min_k4(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

/* Q4_K (qh == NULL) and Q5_K: d, dmin, 12 scale bytes, [qh 32 bytes], 128 bytes of nibbles;
 * sub-block j of 32 values: nibbles of bytes 32*(j/2).., low for even j, high for odd,
 * plus bit j of qh as the fifth bit. */
static void block_k(const uint8_t* restrict b, const uint8_t* restrict qh, const uint8_t* restrict qs,
                    float* restrict y) {
  const float d = half(b), dmin = half(b + 2);
  uint8_t sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  for (int j = 0; j < 8; ++j) {
    const float ds = d * (float)sc[j], dm = dmin * (float)mn[j];
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j & 1);
    for (int l = 0; l < 32; ++l) {
      int v = (q[l] >> shift) & 15;
      if (qh) v |= ((qh[l] >> j) & 1) << 4;
      y[32 * j + l] = ds * (float)v - dm;
    }
  }
}

static void block_q4_k(const uint8_t* restrict b, float* restrict y) { block_k(b, NULL, b + 16, y); }
static void block_q5_k(const uint8_t* restrict b, float* restrict y) { block_k(b, b + 16, b + 48, y); }

/* Q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, d. Value e of
 * half h, group s (32 values each): low nibble of ql[64h + 32(s&1) + l] (the high one for
 * s >= 2), bits 2s of qh[32h + l], scale e/16. Loops kept flat so they vectorize. */
static void block_q6_k(const uint8_t* restrict b, float* restrict y) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = (const int8_t*)(b + 192);
  const float d = half(b + 208);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      const uint8_t *low = ql + 64 * h + 32 * (s & 1), *high = qh + 32 * h;
      const int shift = 4 * (s >> 1);
      for (int part = 0; part < 2; ++part) {
        const float ds = d * (float)sc[8 * h + 2 * s + part];
        float* out = y + 128 * h + 32 * s + 16 * part;
        for (int l = 0; l < 16; ++l) {
          const int i = 16 * part + l;
          out[l] = ds * (float)((((low[i] >> shift) & 15) | (((high[i] >> (2 * s)) & 3) << 4)) - 32);
        }
      }
    }
  }
}

/* A 32-value block dequantized into VPB vectors: Q8_0 d * q, Q4_0 d * (q - 8), Q4_1 d * q + m,
 * each value with the reference's fp32 operations; the register path multiplies them where
 * they are, and block_*_regs (below) stores them for the tile buffer and row lookups. */
static inline void regs_q8_0(const uint8_t* b, vf* w) {
  const vf d = vset1(half(b));
  i8_lanes(_mm_loadu_si128((const __m128i*)(b + 2)), w);
  i8_lanes(_mm_loadu_si128((const __m128i*)(b + 18)), w + VPB / 2);
  for (int v = 0; v < VPB; ++v) w[v] = vmul(d, w[v]);
}

#if defined(__AVX512F__)
/* The 4-bit formats by lookup: a block's 16 possible values are one vector, computed with the
 * reference's own fp32 operations (d * q + m, d * (q - 8)), and each nibble picks its value
 * with vpermps, which reads only an index's low 4 bits: the low nibbles need no mask, the high
 * ones one shift. Per block 2 conversions, 2 multiplies and 2 adds become 2 permutes, 1
 * multiply and 1 add, and the nibble masking goes. On a 2-core Zen 4 EPYC, where one row is
 * bound by this dequantization (12 GB/s of a 32 GB/s read), the default model's gate/up
 * shape over 30 layers (92160 x 576 Q4_1) took 2.8-3.0 ms at 1 row, 2.2-2.4 by lookup. */
static inline void nibble_lookup(const uint8_t* q, vf table, vf* w) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
  w[0] = _mm512_permutexvar_ps(bytes, table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

static inline vf nibble_values(void) {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

static inline void regs_q4_0(const uint8_t* b, vf* w) {
  nibble_lookup(b + 2, vmul(vset1(half(b)), vsub(nibble_values(), vset1(8.0f))), w);
}

/* Q4_1's 16 possible values d * q + m (the reference's operations) */
static inline vf q4_1_table(float d, float m) { return vadd(vmul(vset1(d), nibble_values()), vset1(m)); }

static inline void regs_q4_1_with(const uint8_t* b, float d, float m, vf* w) {
  nibble_lookup(b + 4, q4_1_table(d, m), w);
}

/* Q4_K sub-block j's 16 possible values, ds_j * v - dm_j (the reference's operations). */
static inline vf q4_k_table(float d, float dmin, const uint8_t* sc, const uint8_t* mn, int j) {
  return vsub(vmul(vset1(d * (float)sc[j]), nibble_values()), vset1(dmin * (float)mn[j]));
}

/* The 32 bytes that Q4_K sub-blocks 2p and 2p+1 of super-block ``b`` share (low nibbles for
 * the even one, high for the odd), widened to two int32 vectors. */
static inline void q4_k_bytes(const uint8_t* b, int p, __m512i* nibbles) {
  nibbles[0] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 16 + 32 * p)));
  nibbles[1] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 32 + 32 * p)));
}

/* One of those sub-blocks (``odd``) into two vectors, from its ``table``. */
static inline void q4_k_sub(const __m512i* nibbles, int odd, vf table, vf* w) {
  for (int v = 0; v < 2; ++v)
    w[v] = _mm512_permutexvar_ps(odd ? _mm512_srli_epi32(nibbles[v], 4) : nibbles[v], table);
}

/* Q4_K into memory by the lookup. The default model's gate/up shape at K 1536 (34560 x 1536
 * Q4_K, 2-core Zen 4), one row: 10.35 ms with the scalar loop, see the commit. */
static void block_q4_k_vec(const uint8_t* restrict b, float* restrict y) {
  const float d = half(b), dmin = half(b + 2);
  uint8_t sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  for (int p = 0; p < 4; ++p) {
    __m512i nibbles[2];
    q4_k_bytes(b, p, nibbles);
    for (int odd = 0; odd < 2; ++odd) {
      vf w[2];
      q4_k_sub(nibbles, odd, q4_k_table(d, dmin, sc, mn, 2 * p + odd), w);
      vstore(y + 32 * (2 * p + odd), w[0]);
      vstore(y + 32 * (2 * p + odd) + 16, w[1]);
    }
  }
}

/* Q5_K: Q4_K's sub-blocks with a fifth bit (bit j of qh) over a 32-value table (vpermt2ps). */
static void block_q5_k_vec(const uint8_t* restrict b, float* restrict y) {
  const float d = half(b), dmin = half(b + 2);
  uint8_t sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  const __m512i low4 = _mm512_set1_epi32(15), one = _mm512_set1_epi32(1);
  const __m512i qh[2] = {_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 16))),
                         _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 32)))};
  for (int j = 0; j < 8; ++j) {
    const vf ds = vset1(d * (float)sc[j]), dm = vset1(dmin * (float)mn[j]);
    const vf low = vsub(vmul(ds, nibble_values()), dm);
    const vf high = vsub(vmul(ds, vadd(nibble_values(), vset1(16.0f))), dm);
    for (int half16 = 0; half16 < 2; ++half16) {
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 48 + 32 * (j / 2) + 16 * half16)));
      const __m512i v = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(q, 4 * (j & 1)), low4),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[half16], j), one), 4));
      vstore(y + 32 * j + 16 * half16, _mm512_permutex2var_ps(low, v, high));
    }
  }
}

/* Q6_K (layout at block_q6_k), 16 values at a time in int32 lanes. */
static void block_q6_k_vec(const uint8_t* restrict b, float* restrict y) {
  const float d = half(b + 208);
  const __m512i low4 = _mm512_set1_epi32(15), low2 = _mm512_set1_epi32(3), offset = _mm512_set1_epi32(32);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      const uint8_t *low = b + 64 * h + 32 * (s & 1), *high = b + 128 + 32 * h;
      for (int part = 0; part < 2; ++part) {
        const __m512i l = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(low + 16 * part)));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(high + 16 * part)));
        const __m512i v = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(l, 4 * (s >> 1)), low4),
                                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(q, 2 * s), low2), 4));
        const float ds = d * (float)((const int8_t*)b)[192 + 8 * h + 2 * s + part];
        vstore(y + 128 * h + 32 * s + 16 * part, vmul(vset1(ds), _mm512_cvtepi32_ps(_mm512_sub_epi32(v, offset))));
      }
    }
  }
}
#else
static inline void regs_q4_0(const uint8_t* b, vf* w) {
  const vf d = vset1(half(b));
  const __m128i q = _mm_loadu_si128((const __m128i*)(b + 2)), mask = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
  i8_lanes(_mm_sub_epi8(_mm_and_si128(q, mask), eight), w);
  i8_lanes(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), mask), eight), w + VPB / 2);
  for (int v = 0; v < VPB; ++v) w[v] = vmul(d, w[v]);
}

/* Q4_1 with 8 values per vector: value i is the low nibble of byte i, value i + 16 its high
 * one, so two 8-byte widenings from memory give all four vectors (a mask, a shift), where a
 * 16-byte load split into nibble bytes, each half widened in two steps, took 5 instructions
 * more (gemm_quant.c's SCALES_AHEAD_MICRO has the measurement). */
static inline void regs_q4_1_with(const uint8_t* b, float d, float m, vf* w) {
  const __m256i low4 = _mm256_set1_epi32(15), lo = u8x8(b + 4), hi = u8x8(b + 12);
  const __m256i q[4] = {_mm256_and_si256(lo, low4), _mm256_and_si256(hi, low4), _mm256_srli_epi32(lo, 4),
                        _mm256_srli_epi32(hi, 4)};
  for (int v = 0; v < VPB; ++v) w[v] = vadd(vmul(vset1(d), _mm256_cvtepi32_ps(q[v])), vset1(m));
}

#endif

/* Q4_1, d * q + m with the reference's operations; gemm_quant.c's 1-8 row kernels pass scales
 * they converted beforehand */
static inline void regs_q4_1(const uint8_t* b, vf* w) { regs_q4_1_with(b, half(b), half(b + 2), w); }

/* BF16: 32 raw bfloat16 values, widened exactly (the bits shifted into a float32's high half). */
static inline void regs_bf16(const uint8_t* b, vf* w) {
  for (int v = 0; v < VPB; ++v) w[v] = vload_bf16((const uint16_t*)b + v * VW);
}

/* The 32-value formats into memory through their register dequantization. */
#define BLOCK_BY_REGS(T)                                                              \
  static void block_##T##_regs(const uint8_t* restrict b, float* restrict y) {        \
    vf w[VPB];                                                                        \
    regs_##T(b, w);                                                                   \
    for (int v = 0; v < VPB; ++v) vstore(y + v * VW, w[v]);                           \
  }
BLOCK_BY_REGS(q8_0) BLOCK_BY_REGS(q4_0) BLOCK_BY_REGS(q4_1) BLOCK_BY_REGS(bf16)

#endif
