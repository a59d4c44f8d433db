/* A 16 x 16 transpose of 32-bit values in AVX-512 registers: the AMX tile kernel's activation
 * pairs and epilogue (gemm_amx.c) and its twin's weight pairs (gemm_tile_order_dense.c). */
#ifndef XLSERVE_TRANSPOSE16_H
#define XLSERVE_TRANSPOSE16_H
#include <immintrin.h>
#include <stdint.h>

/* The 16 x 16 matrix of 32-bit values at ``in`` (rows ``stride`` values apart) transposed into
 * ``col``: col[j] = its column j. 64 shuffles. */
static inline void transpose16(const float* in, int64_t stride, __m512 col[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; ++i) col[i] = _mm512_loadu_ps(in + stride * i);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(col[i], col[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(col[i], col[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    col[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    col[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    col[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    col[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(col[h + i], col[h + 4 + i], 0x88);
      t[h + 4 + i] = _mm512_shuffle_f32x4(col[h + i], col[h + 4 + i], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    col[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    col[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}
#endif
