/* Matmul against GGUF block-quantized weights kept in their file format (Q8_0, Q4_0, Q4_1,
 * Q4_K, Q5_K, Q6_K, and BF16 where the model computes in float32): out[M, N] = x[M, K] @ dequant(W[N, K])^T, fp32 activations (or, asked,
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

#include "block_dequant.h"

#if defined(__AVX512F__)
#define MR_MAX 4 /* 4 x NR accumulators + NR weights + 1 activation: 21 of 32 zmm registers */
#else
#define MR_MAX 2 /* 2 x NR accumulators + NR weights + 1 activation: 13 of 16 ymm registers */
#endif
#define NR 4
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
 * 8.38 (the buffer's one dequantization wins from 10). With 16 registers (AVX2) 3-4 rows take
 * half a tile and 5-7 one weight row a pass (a pass of 2 rows each, the dequantization repeated,
 * lost to the buffer before: on a 2-core Zen 1, 3 rows 10.74 vs 8.08 ms): on a 2-core Zen 3
 * EPYC, one process, median of 7-11 interleaved, buffer vs registers, a third of the default
 * model's 30 layers and head (46080 x 576 and 5760 x 1536 Q4_1, 16384 x 576 Q8_0), 3 rows 4.86
 * -> 2.84, 1.30 -> 0.92, 1.41 -> 0.99 ms; 4 rows 5.15 -> 3.19, 1.42 -> 1.01, 1.87 -> 1.14; 5
 * rows 1.12-1.25x; 7 rows 6.22, 2.01, 2.20 against 7.01, 2.38, 2.47; 8 rows level (0.97-1.06x).
 * The same bits. */
#if MR_MAX == 4
#define REGS_PATH_ROWS 8
#else
#define REGS_PATH_ROWS 7
#endif


/* ``streamed``: the row is one of a weight read front to back (a matmul's tile), so the bytes
 * ahead are the next rows' and worth prefetching; an embedding lookup's rows are not. */
typedef void (*row_fn)(const uint8_t* row, int64_t K, float* y, int streamed);
typedef struct {
  int type, values, bytes;
  row_fn dequant_row; /* one function per format, each block a direct call */
} block_kind;

#if defined(__AVX512F__)
/* the K-quants by vector code: they have no register path (Q4_K past 3 rows), so a decode
 * row of a K-quant weight dequantizes each super-block into the tile buffer */
#define FORMATS(X)                                                                             \
  X(q8_0, Q8_0, 32, 34, block_q8_0_regs) X(q4_0, Q4_0, 32, 18, block_q4_0_regs)              \
  X(q4_1, Q4_1, 32, 20, block_q4_1_regs) X(q4_k, Q4_K, 256, 144, block_q4_k_vec)             \
  X(q5_k, Q5_K, 256, 176, block_q5_k_vec) X(q6_k, Q6_K, 256, 210, block_q6_k_vec)            \
  X(bf16, BF16, 32, 64, block_bf16_regs)
#else
#define FORMATS(X)                                                                             \
  X(q8_0, Q8_0, 32, 34, block_q8_0_regs) X(q4_0, Q4_0, 32, 18, block_q4_0_regs)              \
  X(q4_1, Q4_1, 32, 20, block_q4_1_regs) X(q4_k, Q4_K, 256, 144, block_q4_k)                 \
  X(q5_k, Q5_K, 256, 176, block_q5_k) X(q6_k, Q6_K, 256, 210, block_q6_k)                    \
  X(bf16, BF16, 32, 64, block_bf16_regs)
#endif
#define ROW_FN(T, TYPE, VALUES, BYTES, BLOCK)                                                  \
  static void row_##T(const uint8_t* row, int64_t K, float* y, int streamed) {                \
    for (int64_t i = 0; i < K / VALUES; ++i) {                                                 \
      if (streamed) prefetch_ahead(row + i * BYTES);                                           \
      BLOCK(row + i * BYTES, y + i * VALUES);                                                  \
    }                                                                                          \
  }
#define KIND(T, TYPE, VALUES, BYTES, BLOCK) {TYPE, VALUES, BYTES, row_##T},
FORMATS(ROW_FN)
static const block_kind KINDS[] = {FORMATS(KIND)};

static const block_kind* kind_of(int type) {
  for (unsigned i = 0; i < sizeof(KINDS) / sizeof(KINDS[0]); ++i)
    if (KINDS[i].type == type) return &KINDS[i];
  return NULL;
}

/* out[n, :] = dequant(w row ids[n]) for n < count: an embedding lookup. */
void xl_dequant_rows(int type, const uint8_t* w, int64_t row_bytes, const int64_t* ids, int64_t count, int64_t K,
                     float* out, int threads) {
  const block_kind* k = kind_of(type & ~X16);
  if (type & X16) { /* interleaved rows: each row gathered back into its blocks first, one row a thread */
#pragma omp parallel num_threads(threads)
    {
      uint8_t* row = (uint8_t*)malloc((size_t)row_bytes);
#pragma omp for schedule(static)
      for (int64_t n = 0; n < count; ++n) {
        x16_row(type & ~X16, w, K / 32, ids[n], row);
        k->dequant_row(row, K, out + n * K, 0);
      }
      free(row);
    }
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < count; ++n) k->dequant_row(w + ids[n] * row_bytes, K, out + n * K, 0);
}

/* out[m * ldo + r] = the lanes of acc[m * nw + r] summed, for m < mr and r < rows: every
 * kernel's epilogue, 16 sums a shuffle tree (vsums, the same bits as one vsum each). K is
 * 576 in the default model, so a dot is 36 FMAs and a one-at-a-time reduction about 9 more
 * instructions: perf put a fifth of micro_4's samples at 32 rows on them. The tree gained
 * 3-6% at 8-32 rows of its Q4_1 shapes on the AMX Xeon (two builds interleaved). */
static inline void store_sums(const vf* acc, int mr, int nw, int rows, float* out, int64_t ldo) {
  float s[32];
  vsums(acc, mr * nw, s);
  for (int m = 0; m < mr; ++m)
    for (int r = 0; r < rows; ++r) out[m * ldo + r] = s[m * nw + r];
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
    store_sums(acc[0], MR, NR, rows, out, ldo);                                             \
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

/* Activation rows that one pass over the weight multiplies: about PASS_BYTES of them in fp32,
 * so that every weight tile reads them from L2, not memory. All rows in one pass, the default
 * model's Q4_1 shapes (4 layers, 2 threads, the AMX Xeon) took 75-79 us a row up to 256 rows,
 * 120 at 512, 199 at 1,024 and 258 at 2,048 (a prefill chunk): each tile streamed the whole
 * [M, K] block again. Each output is the same dot product whatever the pass: the same bits. */
#define PASS_BYTES (512 * 1024)
static int64_t pass_rows(int64_t K) {
  const int64_t rows = PASS_BYTES / ((int64_t)sizeof(float) * K) / MR_MAX * MR_MAX;
  return rows > MR_MAX ? rows : MR_MAX;
}

/* Every activation row against one tile of NR dequantized weight rows (``rows`` real), MR_MAX
 * rows at a time: the tiled path of the quantized and the dense matmul alike. */
static void multiply_tile(const float* tile, int rows, const float* x, int64_t M, int64_t K, float* out,
                          int64_t ldo) {
  for (int64_t m = 0; m < M; m += MR_MAX) {
    const int mr = M - m < MR_MAX ? (int)(M - m) : MR_MAX;
    MICROS[mr](tile, x + m * K, K, out + m * ldo, ldo, rows);
  }
}


/* Few activation rows: MR rows against NW weight rows dequantized block by block in
 * registers. Each accumulator sees the same values in the same order as micro_MR on the
 * dequantized buffer, so both paths give identical bits, whatever MR and NW. */
#define REGS_MICRO(T, MR, NW) REGS_MICRO_NAMED(regs_##T##_##MR, T, MR, NW)
#define REGS_MICRO_NAMED(NAME, T, MR, NW)                                                       \
  static void NAME(const uint8_t* w, int64_t row_bytes, int bytes, const float* x,              \
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
    store_sums(acc[0], MR, NW, rows, out, ldo);                                                 \
  }

/* Q4_1 for 1-4 rows (AVX2: 1-2), each block's float16 scales converted first,
 * a chunk of blocks of the tile's rows at a time, into fp32 on the stack: the lookup table is
 * then a multiply and an add whose scale operands the instructions broadcast from memory
 * themselves, where scales converted in place cost two vector broadcasts per block and weight
 * row. The same operations on the same values as regs_q4_1: the same bits. The default model's
 * gate/up shape, 4 copies so that no cache holds it (368640 x 576 Q4_1), 2-core Zen 4 EPYC,
 * minimum of 20, 3 interleaved runs: 1 row 7.22-7.29 -> 5.77 ms, 2 rows 8.73-8.79 -> 7.49-7.50,
 * 3 rows 10.37-10.43 -> 9.46-9.49, 4 rows 12.15-12.25 -> 11.41-12.34; 6 and 8 rows lose
 * (16.9 -> 18.3, 22.0 -> 23.6), as does Q4_0 from 3 rows (one broadcast per block there).
 * AVX2 (its values widened from memory, block_dequant.h) took the same scales, with them
 * 22 instructions a block and weight row where converting in place and splitting a 16-byte
 * load took 31: on a 2-core Zen 3 EPYC, one process, both builds, 15 rounds interleaved,
 * median, the default model's 30 layers (138240 x 576 and 17280 x 1536 Q4_1): 1 row 7.98 ->
 * 6.20 and 2.65 -> 2.00 ms, 2 rows 7.53 -> 5.65 and 2.50 -> 2.00; the same bits. */
#define SCALE_CHUNK 32

#define SCALES_AHEAD_MICRO(T, MR, NW)                                                              \
  static void regs_##T##_##MR(const uint8_t* w, int64_t row_bytes, int bytes, const float* x,      \
                              int64_t K, float* out, int64_t ldo, int rows) {                      \
    vf acc[MR][NW];                                                                                \
    float dm[SCALE_CHUNK][NW][2];                                                                  \
    const uint8_t* row[NW];                                                                        \
    for (int r = 0; r < NW; ++r) row[r] = w + (r < rows ? r : 0) * row_bytes;                      \
    for (int m = 0; m < MR; ++m)                                                                   \
      for (int r = 0; r < NW; ++r) acc[m][r] = vzero();                                            \
    for (int64_t b0 = 0; b0 < K / 32; b0 += SCALE_CHUNK) {                                         \
      const int chunk = K / 32 - b0 < SCALE_CHUNK ? (int)(K / 32 - b0) : SCALE_CHUNK;              \
      for (int j = 0; j < chunk; ++j)                                                              \
        for (int r = 0; r < NW; ++r) {                                                             \
          int scales; /* d and m, two float16 values */                                            \
          memcpy(&scales, row[r] + (b0 + j) * bytes, sizeof scales);                               \
          _mm_storel_pi((__m64*)dm[j][r], _mm_cvtph_ps(_mm_cvtsi32_si128(scales)));                \
        }                                                                                          \
      for (int j = 0; j < chunk; ++j) {                                                            \
        for (int r = 0; r < NW; ++r) {                                                             \
          vf wv[VPB];                                                                              \
          const uint8_t* block = row[r] + (b0 + j) * bytes;                                        \
          prefetch_ahead(block);                                                                   \
          regs_##T##_with(block, dm[j][r][0], dm[j][r][1], wv);                                   \
          for (int m = 0; m < MR; ++m)                                                             \
            for (int v = 0; v < VPB; ++v)                                                          \
              acc[m][r] = vfma(wv[v], vload(x + m * K + (b0 + j) * 32 + v * VW), acc[m][r]);       \
        }                                                                                          \
      }                                                                                            \
    }                                                                                              \
    store_sums(acc[0], MR, NW, rows, out, ldo);                                                    \
  }

typedef void (*regs_fn)(const uint8_t*, int64_t, int, const float*, int64_t, float*, int64_t, int);
#if REGS_MAX_ROWS == 4
/* 1-4 rows against NR weight rows; 5-8 (WIDE_ROWS) against NR / 2, so one dequantized block
 * serves up to 8 rows (8 x 2 accumulators + 4 weight vectors + 1 activation: 21 registers)
 * where two passes of 4 would dequantize it twice: 30 layers of the default model's gate/up
 * shape (92160 x 576 Q4_1, 2-core Zen 4) at 8 rows, 6.2 ms in two passes, see the commit.
 * Q4_1 takes its lookup for 5-8 rows too, and 5 rows against the whole tile (20 accumulators,
 * FIVE_NW): a request checking 4 proposals is 5 rows. 30 layers of the default model's
 * Q4_1 shapes on a 2-core Xeon with AMX (Emerald Rapids), min / median of 40 interleaved, the
 * converting kernel on halves before: 5 rows 14.5 / 16.8 -> 11.3 / 13.3 ms, 6 rows 16.9 /
 * 18.4 -> 15.2 / 16.6, 7 rows 16.0 / 19.9 -> 14.4 / 18.6, 8 rows 18.9 / 22.1 -> 19.4 / 20.9;
 * the same bits. (6 rows against the whole tile, 24 accumulators, lost on a Zen 4 before.) */
#define WIDE_ROWS 8
#define REGS_TYPE_BY(MICRO, FIVE_NW, T)                                                                  \
  MICRO(T, 1, NR) MICRO(T, 2, NR) MICRO(T, 3, NR) MICRO(T, 4, NR)                                        \
  MICRO(T, 5, FIVE_NW) MICRO(T, 6, NR / 2) MICRO(T, 7, NR / 2) MICRO(T, 8, NR / 2)                      \
  static const regs_fn REGS_##T[9] = {0, regs_##T##_1, regs_##T##_2, regs_##T##_3, regs_##T##_4,         \
                                      regs_##T##_5, regs_##T##_6, regs_##T##_7, regs_##T##_8};
#else
/* AVX2, 16 registers: 1-2 rows against the whole tile, 3-4 against its halves (4 x 2
 * accumulators + 4 weight vectors + 1 activation: 13 registers), 5-7 (REGS_PATH_ROWS) against
 * one weight row at a time (7 + 4 + 1), so a dequantized block serves every row of the pass
 * where a third row used to cost the buffer's path. */
#define WIDE_ROWS REGS_PATH_ROWS
#define REGS_TYPE_BY(MICRO, FIVE_NW, T)                                                                  \
  MICRO(T, 1, NR) MICRO(T, 2, NR) MICRO(T, 3, NR / 2) MICRO(T, 4, NR / 2)                                \
  MICRO(T, 5, 1) MICRO(T, 6, 1) MICRO(T, 7, 1)                                                           \
  static const regs_fn REGS_##T[8] = {0, regs_##T##_1, regs_##T##_2, regs_##T##_3, regs_##T##_4,         \
                                      regs_##T##_5, regs_##T##_6, regs_##T##_7};
#endif
#define REGS_TYPE(T) REGS_TYPE_BY(REGS_MICRO, NR / 2, T)
#define REGS_TYPE_SCALES_AHEAD(T) REGS_TYPE_BY(SCALES_AHEAD_MICRO, NR, T)
REGS_TYPE(q8_0) REGS_TYPE(q4_0) REGS_TYPE_SCALES_AHEAD(q4_1) REGS_TYPE(bf16)

#if defined(__AVX512F__)
/* One activation row against one weight row at a time, each thread's rows front to back: for
 * the formats whose row is bound by bytes, not by dequantizing, this reads at the machine's
 * bandwidth where NR rows side by side (four streams) do not. 2-core Zen 4 EPYC, median of 9
 * interleaved: the default model's Q8_0 head (49152 x 576) 1.48 -> 1.01 ms; 30 layers of its
 * shapes in BF16 9.70 -> 6.67 ms; in Q4_1, bound by its dequantization, 4.29 -> 4.52 ms with
 * one accumulator chain (so it keeps NR rows). The same accumulation per output: the same
 * bits. Not on AVX2, where a block is four FMAs into one chain (unmeasured). */
REGS_MICRO_NAMED(stream_q8_0, q8_0, 1, 1) REGS_MICRO_NAMED(stream_bf16, bf16, 1, 1)
static regs_fn row_stream_for(int type) {
  return type == Q8_0 ? stream_q8_0 : type == BF16 ? stream_bf16 : NULL;
}
#else
static regs_fn row_stream_for(int type) { (void)type; return NULL; }
#endif

#if defined(__AVX512F__)
/* Q4_K in registers: per super-block and weight row the 8 sub-blocks' scales are decoded once
 * (scale_min_k4), then each sub-block is Q4_1's lookup against the MR rows. The same values
 * in the same order as the buffer path (block_q4_k_vec, then micro_MR): identical bits. (All
 * four vectors of a pair of sub-blocks at once measured slower at 3 rows: 4.4 vs 3.3 ms.) */
#define REGS_K_MICRO(MR, NW)                                                                      \
  static void regs_q4_k_##MR(const uint8_t* w, int64_t row_bytes, int bytes, const float* x,      \
                             int64_t K, float* out, int64_t ldo, int rows) {                      \
    vf acc[MR][NW];                                                                               \
    for (int m = 0; m < MR; ++m)                                                                  \
      for (int r = 0; r < NW; ++r) acc[m][r] = vzero();                                           \
    for (int64_t sb = 0; sb < K / 256; ++sb) {                                                    \
      for (int r = 0; r < NW; ++r) {                                                              \
        const uint8_t* b = w + (r < rows ? r : 0) * row_bytes + sb * bytes;                         \
        for (int o = 0; o < bytes; o += 64) prefetch_ahead(b + o);                                \
        uint8_t sc[8], mn[8];                                                                     \
        scale_min_k4(b + 4, sc, mn);                                                              \
        const float d = half(b), dmin = half(b + 2);                                              \
        for (int p = 0; p < 4; ++p) {                                                             \
          __m512i nibbles[2];                                                                     \
          q4_k_bytes(b, p, nibbles);                                                              \
          for (int odd = 0; odd < 2; ++odd) {                                                     \
            vf wv[2];                                                                             \
            q4_k_sub(nibbles, odd, q4_k_table(d, dmin, sc, mn, 2 * p + odd), wv);                 \
            const float* xk = x + sb * 256 + 32 * (2 * p + odd);                                  \
            for (int m = 0; m < MR; ++m) {                                                        \
              acc[m][r] = vfma(wv[0], vload(xk + m * K), acc[m][r]);                              \
              acc[m][r] = vfma(wv[1], vload(xk + m * K + 16), acc[m][r]);                         \
            }                                                                                     \
          }                                                                                       \
        }                                                                                         \
      }                                                                                           \
    }                                                                                             \
    store_sums(acc[0], MR, NW, rows, out, ldo);                                                   \
  }
REGS_K_MICRO(1, NR) REGS_K_MICRO(2, NR) REGS_K_MICRO(3, NR)
/* 1-3 rows only (regs_rows): past them the buffer wins */
static const regs_fn REGS_q4_k[9] = {0, regs_q4_k_1, regs_q4_k_2, regs_q4_k_3};
#endif

/* The register path for ``type`` and MR rows (1..WIDE_ROWS), or NULL (the buffer then: Q5_K and
 * Q6_K, and Q4_K on AVX2). */
static regs_fn regs_for(int type, int mr) {
  switch (type) {
    case Q8_0: return REGS_q8_0[mr];
    case Q4_0: return REGS_q4_0[mr];
    case Q4_1: return REGS_q4_1[mr];
    case BF16: return REGS_bf16[mr];
#if defined(__AVX512F__)
    case Q4_K: return REGS_q4_k[mr];
#endif
    default: return NULL;
  }
}

/* Up to how many rows ``type`` takes the register path (0: never). Q4_K's kernel holds its
 * pair of nibble vectors besides the accumulators and loses from 4 rows: 34560 x 1536 on the
 * 2-core Zen 4, registers vs buffer, 1 row 2.18 vs 3.39 ms, 3 rows 3.28 vs 4.61, 4 rows 5.49
 * vs 4.90. */
static int regs_rows(int type) {
  if (!regs_for(type, 1)) return 0;
  return type == Q4_K ? 3 : REGS_PATH_ROWS;
}

/* Up to how many activation rows ``type``'s register kernels take a whole tile of NR weight
 * rows at once (beyond, its halves in turn). */
static int full_tile_rows(int type) {
#if REGS_MAX_ROWS == 4
  if (type == Q4_1) return 5; /* its 5-row kernel holds 20 accumulators */
#else
  (void)type;
#endif
  return REGS_MAX_ROWS;
}

/* How many weight rows of a tile ``type``'s kernel for ``mr`` activation rows takes at once. */
static int pass_width(int type, int mr) {
  if (mr <= full_tile_rows(type)) return NR;
#if REGS_MAX_ROWS == 4
  return NR / 2;
#else
  return mr <= 4 ? NR / 2 : 1;
#endif
}

/* One tile of ``rows`` (<= NR) weight rows against every activation row, WIDE_ROWS at a time:
 * up to full_tile_rows of them against the whole tile, more against its parts in turn. */
static void regs_tile(int type, const uint8_t* w, int64_t row_bytes, int bytes, int rows, const float* x,
                      int64_t M, int64_t K, float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; m += WIDE_ROWS) {
    const int mr = M - m < WIDE_ROWS ? (int)(M - m) : WIDE_ROWS;
    const regs_fn fn = regs_for(type, mr);
    const int width = pass_width(type, mr);
    for (int r = 0; r < rows; r += width)
      fn(w + r * row_bytes, row_bytes, bytes, x + m * K, K, out + m * ldo + r, ldo,
         rows - r < width ? rows - r : width);
  }
}

/* The AMX tiles multiply an interleaved ``base`` weight against M rows where the process may use
 * them, but Q8_0 up to Q8_0_TWIN_ROWS rows takes the twin, the same bits: its B tiles go through
 * fp32 (about 8 instructions a pair, gemm_amx_quant.c), where the twin's FMAs use the values
 * directly. The default model's Q8_0 head (49152 x 576), one process, minimum of 11
 * interleaved, six runs on the AMX Xeon: 1 row 0.72-1.13 against 1.31-1.82 ms, 2 rows 0.88-1.35
 * against 1.33-1.89, 4 rows level, 8 rows 2.0-2.6 against 1.5-1.9. */
#define Q8_0_TWIN_ROWS 3
static int tiles_take(int base, int64_t M) {
  return xl_amx_quant_ready() && !(base == Q8_0 && M <= Q8_0_TWIN_ROWS);
}

/* x: [M, K] fp32; w: [N, row_bytes] blocks of ``type``; out: [M, ldo] fp32, columns 0..N-1
 * written (ldo > N writes one part of a wider output). K is a multiple of the block.
 * ``eight_bit``: Q4_0 / Q4_1 / Q8_0 multiply 8-bit activations (dot_q8.c), as llama.cpp does;
 * their interleaved forms (X16 | type) take dot_q8_x16.c then, and without it gemm_amx_quant.c
 * (bfloat16 activations on AMX tiles) or, on a CPU without AMX, its twin gemm_tile_order.c. */
void xl_linear_quant(int type, const float* x, const uint8_t* w, int64_t row_bytes, float* out, int64_t M,
                     int64_t N, int64_t K, int64_t ldo, int eight_bit, int threads) {
  if (type & X16) { /* the layout exists for the 8-bit kernel and, asked for fp32 activations, the tile one */
    if (eight_bit) xl_linear_x16(type & ~X16, x, w, out, M, N, K, ldo, threads);
    else if (tiles_take(type & ~X16, M)) xl_linear_amx_quant(type & ~X16, x, w, out, M, N, K, ldo, threads);
    else xl_linear_tile_order(type & ~X16, x, w, out, M, N, K, ldo, threads);
    return;
  }
  if (eight_bit && xl_q8_handles(type)) {
    xl_linear_q8(type, x, w, row_bytes, out, M, N, K, ldo, threads);
    return;
  }
  const block_kind* kind = kind_of(type);
  const int64_t tiles = (N + NR - 1) / NR;
  const regs_fn row_stream = M == 1 ? row_stream_for(type) : NULL;
  if (row_stream) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) row_stream(w + n * row_bytes, row_bytes, kind->bytes, x, K, out + n, ldo, 1);
    return;
  }
  if (M <= regs_rows(type)) { /* decode: dequantize in registers, no buffer */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t n0 = t * NR;
      const int rows = N - n0 < NR ? (int)(N - n0) : NR;
      regs_tile(type, w + n0 * row_bytes, row_bytes, kind->bytes, rows, x, M, K, out + n0, ldo);
    }
    return;
  }
  const int64_t pass = pass_rows(K);
#pragma omp parallel num_threads(threads)
  {
    float* buf = (float*)aligned_alloc(64, sizeof(float) * NR * K); /* K * 4 is a multiple of 128 */
    /* a last tile's rows past N multiply whatever the buffer holds and are never stored;
     * zeroed once so that is never uninitialized memory */
    memset(buf, 0, sizeof(float) * NR * K);
    for (int64_t m0 = 0; m0 < M; m0 += pass) { /* each tile dequantized once a pass */
      const int64_t mp = M - m0 < pass ? M - m0 : pass;
#pragma omp for schedule(static)
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n0 = t * NR;
        const int rows = N - n0 < NR ? (int)(N - n0) : NR;
        for (int r = 0; r < rows; ++r) kind->dequant_row(w + (n0 + r) * row_bytes, K, buf + r * K, 1);
        multiply_tile(buf, rows, x + m0 * K, mp, K, out + m0 * ldo + n0, ldo);
      }
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
  const int64_t tiles = (N + NR - 1) / NR, pass = pass_rows(K);
#pragma omp parallel num_threads(threads)
  {
    float* buf = (float*)aligned_alloc(64, sizeof(float) * NR * K);
    memset(buf, 0, sizeof(float) * NR * K);
    for (int64_t m0 = 0; m0 < M; m0 += pass) {
      const int64_t mp = M - m0 < pass ? M - m0 : pass;
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
        multiply_tile(tile, rows, x + m0 * K, mp, K, out + m0 * ldo + n0, ldo);
      }
    }
    free(buf);
  }
}
