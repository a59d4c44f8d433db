/* A block of Q4_0, Q4_1 or Q8_0 weights interleaved 16 rows at a time against bfloat16
 * activation pairs: what the AMX tile kernel (gemm_amx_quant.c) and its twin without tiles
 * (gemm_tile_order.c) share, so that both prepare the same activations and scale the same
 * sums, bit for bit. Needs AVX512F and AVX512BW. */
#ifndef XLSERVE_TILE_BLOCKS_H
#define XLSERVE_TILE_BLOCKS_H
#include <immintrin.h>
#include <stdint.h>

#include "quant_blocks.h"
#include "vec_portable.h"

/* word i of a block's pairs is value PAIRED[i]: pair 4j + t holds values 8j + t and 8j + 4 + t,
 * the two nibbles of byte t of register j */
static const short PAIRED[32] = {0,  4,  1,  5,  2,  6,  3,  7,  8,  12, 9,  13, 10, 14, 11, 15,
                                 16, 20, 17, 21, 18, 22, 19, 23, 24, 28, 25, 29, 26, 30, 27, 31};

/* fp32 to bfloat16 (each dword's low word) as vcvtneps2bf16 rounds: the row kernels' rounding to
 * nearest even (vec_portable.h's round_bits_bf16), a denormal input first made a zero of its
 * sign, a NaN quieted (matched bit for bit on 16 million values, a quarter of them denormal).
 * In integer instructions, so CPUs without AVX512-BF16 round alike. */
static inline __m512i bf16_round(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __mmask16 denormal = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7F800000));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i v = _mm512_mask_and_epi32(bits, denormal, bits, _mm512_set1_epi32((int)0x80000000));
  const __m512i rounded = _mm512_srli_epi32(round_bits_bf16(_mm512_castsi512_ps(v)), 16);
  return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(v, 16), _mm512_set1_epi32(0x40));
}

/* Row ``x`` as ``blocks`` rows of an A tile (16 pairs of bfloat16, round to nearest even; Q8_0:
 * pair p holds values 2p and 2p + 1, Q4: PAIRED) and (Q4) each block's sum of those bfloat16
 * values (fp32, a fixed order). */
static inline void pair_row(int base, const float* x, int64_t blocks, uint32_t* pairs, float* sums) {
  const __m512i order = _mm512_loadu_si512(PAIRED);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i lo = _mm512_cvtepi32_epi16(bf16_round(_mm512_loadu_ps(x + 32 * b)));
    const __m256i hi = _mm512_cvtepi32_epi16(bf16_round(_mm512_loadu_ps(x + 32 * b + 16)));
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); /* words 0-15: lo, 16-31: hi */
    _mm512_storeu_si512(pairs + 16 * b, base == Q8_0 ? v : _mm512_permutexvar_epi16(order, v));
    if (base == Q8_0) continue; /* its blocks have no m: scale_sums ignores the sum */
    const __m512i wide_lo = _mm512_cvtepu16_epi32(lo), wide_hi = _mm512_cvtepu16_epi32(hi);
    sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wide_lo, 16)),
                                                 _mm512_castsi512_ps(_mm512_slli_epi32(wide_hi, 16))));
  }
}

/* Q8_0: byte t of each lane of register v (value 4j + t of row r's block) as fp32, exact. */
static inline __m512 q8_values(__m512i v, int t) {
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * t), 24));
}

/* The block's 16 d times 16 and m - 16 d (Q4_0: m = -8 d); Q8_0: d alone. */
static inline void block_scales(int base, const uint8_t* g, __m512* d16, __m512* c) {
  if (base == Q8_0) {
    *d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(g + 512)));
    *c = _mm512_setzero_ps();
    return;
  }
  *d16 = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(g + 256))), _mm512_set1_ps(16.0f));
  const __m512 m = base == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(g + 288)))
                                : _mm512_mul_ps(*d16, _mm512_set1_ps(-0.5f));
  *c = _mm512_sub_ps(m, *d16);
}

/* Row i's sum: block after block, acc = fma(16 d, its tile sums, acc) then (Q4) fma(m - 16 d,
 * its sum of x, acc); the same operations in the same order for every row count. */
static inline __m512 scale_sums(int base, __m512 acc, __m512 d16, __m512 c, __m512 sums, float s) {
  acc = _mm512_fmadd_ps(d16, sums, acc);
  return base == Q8_0 ? acc : _mm512_fmadd_ps(c, _mm512_set1_ps(s), acc);
}
#endif
