/* Matmul against GGUF block-quantized weights kept in their file format (Q8_0, Q4_0, Q4_1,
 * Q4_K, Q5_K, Q6_K): out[M, N] = x[M, K] @ dequant(W[N, K])^T, fp32 activations (or, asked,
 * 8-bit ones for the 32-value formats: dot_q8.c).
 *
 * Each thread takes tiles of NR weight rows: it dequantizes them into a small buffer that
 * stays in L1/L2, then multiplies every activation row against them, MR rows at a time.
 * The weight crosses memory once per call in its 4.5-8.5 bits per value, which is what
 * bounds decode on a CPU.
 *
 * Batch invariance: every output element is one dot product whose order is fixed (VW-wide
 * fp32 lanes along K, then a fixed lane sum), whatever M, MR, the tile or the thread, so a
 * row's result does not depend on what else is in the batch.
 *
 * Dequantization is bit-exact with the reference (gguf-py, ggml): the same fp32 products
 * and sums in the same order, so this file is built with -ffp-contract=off; the dot
 * products use explicit FMA instructions.
 *
 * One source for two builds (vec_portable.h): AVX-512 (16 lanes) and AVX2 + FMA + F16C (8).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"
#include "vec_portable.h"

#if defined(__AVX512F__)
#define MR_MAX 4 /* 4 x NR accumulators + NR weights + 1 activation: 21 of 32 zmm registers */
/* 16 bytes -> 16 lanes */
static inline void u8_lanes(__m128i b, vf* out) { out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
static inline void i8_lanes(__m128i b, vf* out) { out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
#else
#define MR_MAX 2 /* 2 x NR accumulators + NR weights + 1 activation: 13 of 16 ymm registers */
/* 16 bytes -> 2 x 8 lanes */
static inline void u8_lanes(__m128i b, vf* out) {
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
}
static inline void i8_lanes(__m128i b, vf* out) {
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}
#endif
#define NR 4
#define VPB (32 / VW) /* vectors per 32-value block */
/* Up to this many rows dequantize in registers, all rows in one pass (beyond, one
 * dequantization into the buffer serves all rows). With 32 registers, 4: the default
 * model's Q4_1 gate/up projection (3072 x 576, 2 threads) takes 136 us for 1 row, 176 for
 * 4 (328 through the buffer), which is what a request checking 3 proposals computes. */
#if MR_MAX == 4
#define REGS_MAX_ROWS 4
#else
#define REGS_MAX_ROWS 2
#endif
/* Up to this many rows the register path takes them (dequantizing a tile once per pass, while
 * it is in L1): a request checking up to 7 proposals, or a small batch, reads the weight from
 * memory once, not through the buffer. The default model's gate/up shape over 30 layers
 * (92160 x 576 Q4_1) on a 2-core Zen 4 EPYC, minimum of 21, registers vs buffer: 4 rows 3.17
 * vs 3.92 ms, 6 rows 4.46 vs 5.32, 8 rows 5.50 vs 6.00, 10 rows 7.68 vs 7.41, 12 rows 8.58 vs
 * 8.38 (the buffer's one dequantization wins from 10). */
#define REGS_PATH_ROWS (2 * REGS_MAX_ROWS)

static void block_q8_0(const uint8_t* restrict b, float* restrict y) { /* d, 32 x int8 */
  const float d = half(b);
  for (int j = 0; j < 32; ++j) y[j] = d * (float)(int8_t)b[2 + j];
}

/* d, 16 bytes: low nibbles are values 0..15, high nibbles 16..31 */
static void block_q4_0(const uint8_t* restrict b, float* restrict y) {
  const float d = half(b);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)((b[2 + j] & 15) - 8);
    y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
  }
}

static void block_q4_1(const uint8_t* restrict b, float* restrict y) { /* d, min, 16 bytes of nibbles */
  const float d = half(b), m = half(b + 2);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)(b[4 + j] & 15) + m;
    y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
  }
}

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

typedef void (*block_fn)(const uint8_t*, float*);
typedef struct {
  int type, values, bytes;
  block_fn fn;
} block_kind;
static const block_kind KINDS[] = {
    {Q8_0, 32, 34, block_q8_0}, {Q4_0, 32, 18, block_q4_0},   {Q4_1, 32, 20, block_q4_1},
    {Q4_K, 256, 144, block_q4_k}, {Q5_K, 256, 176, block_q5_k}, {Q6_K, 256, 210, block_q6_k},
};

static const block_kind* kind_of(int type) {
  for (unsigned i = 0; i < sizeof(KINDS) / sizeof(KINDS[0]); ++i)
    if (KINDS[i].type == type) return &KINDS[i];
  return NULL;
}

/* ``streamed``: the row is one of a weight read front to back (a matmul's tile), so the bytes
 * ahead are the next rows' and worth prefetching; an embedding lookup's rows are not. */
static void dequant_row(const block_kind* k, const uint8_t* row, int64_t K, float* y, int streamed) {
  for (int64_t i = 0; i < K / k->values; ++i) {
    if (streamed) prefetch_ahead(row + i * k->bytes);
    k->fn(row + i * k->bytes, y + i * k->values);
  }
}

/* out[n, :] = dequant(w row ids[n]) for n < count: an embedding lookup. */
void xl_dequant_rows(int type, const uint8_t* w, int64_t row_bytes, const int64_t* ids, int64_t count, int64_t K,
                     float* out, int threads) {
  const block_kind* k = kind_of(type);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < count; ++n) dequant_row(k, w + ids[n] * row_bytes, K, out + n * K, 0);
}

/* MR activation rows against NR dequantized weight rows ``w`` (row stride K). */
#define MICRO(MR)                                                                          \
  static void micro_##MR(const float* w, const float* x, int64_t K, float* out, int64_t ldo, \
                         int rows) {                                                        \
    vf acc[MR][NR];                                                                         \
    for (int m = 0; m < MR; ++m)                                                            \
      for (int r = 0; r < NR; ++r) acc[m][r] = vzero();                                     \
    for (int64_t k = 0; k < K; k += VW) {                                                   \
      vf wv[NR];                                                                            \
      for (int r = 0; r < NR; ++r) wv[r] = vload(w + r * K + k);                            \
      for (int m = 0; m < MR; ++m) {                                                        \
        const vf xv = vload(x + m * K + k);                                                 \
        for (int r = 0; r < NR; ++r) acc[m][r] = vfma(wv[r], xv, acc[m][r]);                \
      }                                                                                     \
    }                                                                                       \
    for (int m = 0; m < MR; ++m)                                                            \
      for (int r = 0; r < rows; ++r) out[m * ldo + r] = vsum(acc[m][r]);                    \
  }

MICRO(1) MICRO(2)
#if MR_MAX == 4
MICRO(3) MICRO(4)
typedef void (*micro_fn)(const float*, const float*, int64_t, float*, int64_t, int);
static const micro_fn MICROS[5] = {0, micro_1, micro_2, micro_3, micro_4};
#else
typedef void (*micro_fn)(const float*, const float*, int64_t, float*, int64_t, int);
static const micro_fn MICROS[3] = {0, micro_1, micro_2};
#endif

/* Every activation row against one tile of NR dequantized weight rows (``rows`` real), MR_MAX
 * rows at a time: the tiled path of the quantized and the dense matmul alike. */
static void multiply_tile(const float* tile, int rows, const float* x, int64_t M, int64_t K, float* out,
                          int64_t ldo) {
  for (int64_t m = 0; m < M; m += MR_MAX) {
    const int mr = M - m < MR_MAX ? (int)(M - m) : MR_MAX;
    MICROS[mr](tile, x + m * K, K, out + m * ldo, ldo, rows);
  }
}

/* A 32-value block dequantized into VPB vectors, the same values as block_* computes (the
 * same fp32 products and sums): the weight never goes through memory as floats. */
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

static inline void regs_q4_1(const uint8_t* b, vf* w) {
  nibble_lookup(b + 4, vadd(vmul(vset1(half(b)), nibble_values()), vset1(half(b + 2))), w);
}
#else
static inline void regs_q4_0(const uint8_t* b, vf* w) {
  const vf d = vset1(half(b));
  const __m128i q = _mm_loadu_si128((const __m128i*)(b + 2)), mask = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
  i8_lanes(_mm_sub_epi8(_mm_and_si128(q, mask), eight), w);
  i8_lanes(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), mask), eight), w + VPB / 2);
  for (int v = 0; v < VPB; ++v) w[v] = vmul(d, w[v]);
}

static inline void regs_q4_1(const uint8_t* b, vf* w) {
  const vf d = vset1(half(b)), m = vset1(half(b + 2));
  const __m128i q = _mm_loadu_si128((const __m128i*)(b + 4)), mask = _mm_set1_epi8(15);
  u8_lanes(_mm_and_si128(q, mask), w);
  u8_lanes(_mm_and_si128(_mm_srli_epi16(q, 4), mask), w + VPB / 2);
  for (int v = 0; v < VPB; ++v) w[v] = vadd(vmul(d, w[v]), m);
}

#endif

/* Few activation rows: MR rows against NW weight rows dequantized block by block in
 * registers. Each accumulator sees the same values in the same order as micro_MR on the
 * dequantized buffer, so both paths give identical bits, whatever MR and NW. */
#define REGS_MICRO(T, MR, NW)                                                                   \
  static void regs_##T##_##MR(const uint8_t* w, int64_t row_bytes, int bytes, const float* x,   \
                              int64_t K, float* out, int64_t ldo, int rows) {                   \
    vf acc[MR][NW];                                                                             \
    for (int m = 0; m < MR; ++m)                                                                \
      for (int r = 0; r < NW; ++r) acc[m][r] = vzero();                                         \
    for (int64_t blk = 0; blk < K / 32; ++blk) {                                                \
      for (int r = 0; r < NW; ++r) {                                                            \
        vf wv[VPB];                                                                             \
        const uint8_t* block = w + (r < rows ? r : 0) * row_bytes + blk * bytes;                  \
        prefetch_ahead(block);                                                                  \
        regs_##T(block, wv);                                                                    \
        for (int m = 0; m < MR; ++m)                                                            \
          for (int v = 0; v < VPB; ++v)                                                         \
            acc[m][r] = vfma(wv[v], vload(x + m * K + blk * 32 + v * VW), acc[m][r]);           \
      }                                                                                         \
    }                                                                                           \
    for (int m = 0; m < MR; ++m)                                                                \
      for (int r = 0; r < rows; ++r) out[m * ldo + r] = vsum(acc[m][r]);                        \
  }

typedef void (*regs_fn)(const uint8_t*, int64_t, int, const float*, int64_t, float*, int64_t, int);
#if REGS_MAX_ROWS == 4
/* 1-4 rows against NR weight rows; 5-8 (WIDE_ROWS) against NR / 2, so one dequantized block
 * serves up to 8 rows (8 x 2 accumulators + 4 weight vectors + 1 activation: 21 registers)
 * where two passes of 4 would dequantize it twice: 30 layers of the default model's gate/up
 * shape (92160 x 576 Q4_1, 2-core Zen 4) at 8 rows, 6.2 ms in two passes, see the commit. */
#define WIDE_ROWS 8
#define REGS_TYPE(T)                                                                                     \
  REGS_MICRO(T, 1, NR) REGS_MICRO(T, 2, NR) REGS_MICRO(T, 3, NR) REGS_MICRO(T, 4, NR)                    \
  REGS_MICRO(T, 5, NR / 2) REGS_MICRO(T, 6, NR / 2) REGS_MICRO(T, 7, NR / 2) REGS_MICRO(T, 8, NR / 2)    \
  static const regs_fn REGS_##T[9] = {0, regs_##T##_1, regs_##T##_2, regs_##T##_3, regs_##T##_4,         \
                                      regs_##T##_5, regs_##T##_6, regs_##T##_7, regs_##T##_8};
#else
#define WIDE_ROWS REGS_MAX_ROWS
#define REGS_TYPE(T) \
  REGS_MICRO(T, 1, NR) REGS_MICRO(T, 2, NR) static const regs_fn REGS_##T[3] = {0, regs_##T##_1, regs_##T##_2};
#endif
REGS_TYPE(q8_0) REGS_TYPE(q4_0) REGS_TYPE(q4_1)

/* The register path for ``type`` and MR rows (1..WIDE_ROWS), or NULL (K-quants use the buffer). */
static regs_fn regs_for(int type, int mr) {
  switch (type) {
    case Q8_0: return REGS_q8_0[mr];
    case Q4_0: return REGS_q4_0[mr];
    case Q4_1: return REGS_q4_1[mr];
    default: return NULL;
  }
}

/* A weight row into floats for the tile buffer with the register path's dequantization
 * (the same values as block_*; 32-value formats only). Against the scalar block loops, 30
 * layers of the gate/up shape on the Zen 4 took 12.0 ms instead of 16.3 at 16 rows, 19.7
 * instead of 23.5 at 32, 39.8 instead of 42.3 at 64. */
static void dequant_row_vec(int type, const uint8_t* row, int bytes, int64_t K, float* y) {
  for (int64_t i = 0; i < K / 32; ++i) {
    const uint8_t* b = row + i * bytes;
    prefetch_ahead(b);
    vf w[VPB];
    if (type == Q4_1) regs_q4_1(b, w);
    else if (type == Q4_0) regs_q4_0(b, w);
    else regs_q8_0(b, w);
    for (int v = 0; v < VPB; ++v) vstore(y + i * 32 + v * VW, w[v]);
  }
}

/* One tile of ``rows`` (<= NR) weight rows against every activation row, WIDE_ROWS at a time:
 * up to REGS_MAX_ROWS of them against the whole tile, more against its halves in turn. */
static void regs_tile(int type, const uint8_t* w, int64_t row_bytes, int bytes, int rows, const float* x,
                      int64_t M, int64_t K, float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; m += WIDE_ROWS) {
    const int mr = M - m < WIDE_ROWS ? (int)(M - m) : WIDE_ROWS;
    const regs_fn fn = regs_for(type, mr);
    if (mr <= REGS_MAX_ROWS) {
      fn(w, row_bytes, bytes, x + m * K, K, out + m * ldo, ldo, rows);
      continue;
    }
    for (int r = 0; r < rows; r += NR / 2)
      fn(w + r * row_bytes, row_bytes, bytes, x + m * K, K, out + m * ldo + r, ldo,
         rows - r < NR / 2 ? rows - r : NR / 2);
  }
}

/* x: [M, K] fp32; w: [N, row_bytes] blocks of ``type``; out: [M, ldo] fp32, columns 0..N-1
 * written (ldo > N writes one part of a wider output). K is a multiple of the block.
 * ``eight_bit``: Q4_0 / Q4_1 / Q8_0 multiply 8-bit activations (dot_q8.c), as llama.cpp does. */
void xl_linear_quant(int type, const float* x, const uint8_t* w, int64_t row_bytes, float* out, int64_t M,
                     int64_t N, int64_t K, int64_t ldo, int eight_bit, int threads) {
  if (eight_bit && xl_q8_handles(type)) {
    xl_linear_q8(type, x, w, row_bytes, out, M, N, K, ldo, threads);
    return;
  }
  const block_kind* kind = kind_of(type);
  const int64_t tiles = (N + NR - 1) / NR;
  if (M <= REGS_PATH_ROWS && regs_for(type, 1)) { /* decode: dequantize in registers, no buffer */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t n0 = t * NR;
      const int rows = N - n0 < NR ? (int)(N - n0) : NR;
      regs_tile(type, w + n0 * row_bytes, row_bytes, kind->bytes, rows, x, M, K, out + n0, ldo);
    }
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    float* buf = (float*)aligned_alloc(64, sizeof(float) * NR * K); /* K * 4 is a multiple of 128 */
    /* a last tile's rows past N multiply whatever the buffer holds and are never stored;
     * zeroed once so that is never uninitialized memory */
    memset(buf, 0, sizeof(float) * NR * K);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t n0 = t * NR;
      const int rows = N - n0 < NR ? (int)(N - n0) : NR;
      for (int r = 0; r < rows; ++r) {
        if (regs_for(type, 1)) dequant_row_vec(type, w + (n0 + r) * row_bytes, kind->bytes, K, buf + r * K);
        else dequant_row(kind, w + (n0 + r) * row_bytes, K, buf + r * K, 1);
      }
      multiply_tile(buf, rows, x, M, K, out + n0, ldo);
    }
    free(buf);
  }
}

/* Dense fp32 or bf16 weights [N, K] (K a multiple of 16): the same tiles and the same dot
 * order per output as the quantized path, so under --deterministic every matmul reduces a
 * row one way whatever the batch. fp32 tiles are read in place; bf16 ones widened (exactly)
 * into the tile buffer, as is a last tile of fewer than NR rows. */
void xl_linear_dense(const float* x, const void* w, int bf16, float* out, int64_t M, int64_t N, int64_t K,
                     int64_t ldo, int threads) {
  const int64_t tiles = (N + NR - 1) / NR;
#pragma omp parallel num_threads(threads)
  {
    float* buf = (float*)aligned_alloc(64, sizeof(float) * NR * K);
    memset(buf, 0, sizeof(float) * NR * K);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t n0 = t * NR;
      const int rows = N - n0 < NR ? (int)(N - n0) : NR;
      const float* tile = (const float*)w + n0 * K;
      if (bf16) {
        for (int r = 0; r < rows; ++r)
          for (int64_t k = 0; k < K; k += VW)
            vstore(buf + r * K + k, vload_bf16((const uint16_t*)w + (n0 + r) * K + k));
        tile = buf;
      } else if (rows < NR) {
        memcpy(buf, tile, sizeof(float) * rows * K);
        tile = buf;
      }
      multiply_tile(tile, rows, x, M, K, out + n0, ldo);
    }
    free(buf);
  }
}
