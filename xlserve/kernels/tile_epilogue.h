/* The dense tile kernel's epilogue (gemm_amx.c: write_tile), which its twin without the tiles
 * (gemm_tile_order_dense.c) runs as well, so both write the same bits: + bias (zero when none),
 * then either the fp32 sums as they are (the logits) or, rounded to bfloat16 as vcvtneps2bf16
 * rounds (tile_blocks.h: bf16_round, in integer instructions for CPUs without AVX512-BF16),
 * + residual and rounded again (xl_linear_bf16's rounding). Needs AVX512F and AVX512BW. */
#ifndef XLSERVE_TILE_EPILOGUE_H
#define XLSERVE_TILE_EPILOGUE_H
#include "tile_blocks.h"

/* Where the sums go: bf16 ``out`` [M, N] (+ ``bias``, rounded, + ``residual``, rounded) or, with
 * ``out32``, the fp32 sums + bias, rows ``ldo`` apart. */
typedef struct {
  const uint16_t *bias, *residual;
  uint16_t* out;
  float* out32;
  int64_t N, ldo;
} epilogue;

/* One row's 16 sums ``v``: outputs n0 .. n0 + 15 of row m. */
static inline void finish_row(__m512 v, int64_t m, int64_t n0, const epilogue* e) {
  v = _mm512_add_ps(v, e->bias ? vload_bf16(e->bias + n0) : _mm512_setzero_ps());
  if (e->out32) {
    _mm512_storeu_ps(e->out32 + m * e->ldo + n0, v);
    return;
  }
  if (e->residual) {
    const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_round(v), 16));
    v = _mm512_add_ps(rounded, vload_bf16(e->residual + m * e->N + n0));
  }
  _mm256_storeu_si256((__m256i*)(e->out + m * e->N + n0), _mm512_cvtepi32_epi16(bf16_round(v)));
}
#endif
