/* bf16 matmul on AMX tiles that reads the weight in its plain [N, K] layout.
 *
 * out[M, N] = x[M, K] @ W[N, K]^T for 1 to a few hundred rows (decode, short prefill
 * chunks). oneDNN needs the weight reordered into its blocked layout for AMX:
 * per call that reorder costs more than the product at these sizes, and keeping a
 * reordered copy doubles the weights. Here the roles are swapped: a tile of W (16
 * output features x 32 inputs, rows of W as they lie in memory) is the A operand, and
 * the activations, transposed once per call into AMX's pair-interleaved layout, are the
 * B operand. The tile product is then out^T, 16 features x 16 rows, accumulated in fp32
 * across K and written back transposed.
 *
 * Even one row runs faster on the tiles than on the row kernel (gemv_bf16.c), which streams at
 * the bandwidth it gets: 30 layers of the default model's shapes in bf16 on a 2-core Xeon with
 * AMX (Emerald Rapids), minimum of 9, 4.45 against 4.81 ms from L3, 29.1 against 37.4 ms for
 * 120 layers from memory. The tile loads read each slab where it lies: a front-to-back sweep
 * of each 32-row slab before them (which gained 10-25% at 32 rows on the AMX Xeon of
 * 2026-11-29) cost there 1 row 5.49 against 4.45 ms, 32 rows 9.25 against 7.41 (from memory
 * 33.0 against 29.1, 46.8 against 43.2).
 *
 * Needs K % 32 == 0 and N % 32 == 0 (the caller checks), and AMX permission from the
 * kernel, asked for once per process. Without it (another CPU, a build without AMX, the
 * permission refused) the entry points below compute the same bits in vector FMAs
 * (gemm_tile_order_dense.c).
 */
#include <stdint.h>
#include <stdlib.h>

#include "scratch.h"

#ifdef XL_HAVE_AMX
#include <string.h>

#include "amx_tiles.h"
#include "tile_epilogue.h"
#include "vec_portable.h"

/* 1 when the process may use AMX tiles (asks the kernel on first call). */
int xl_amx_ready(void) { return amx_permitted(); }

/* Every tile register is 16 rows x 64 bytes: C (16 x 16 fp32), A (16 x 32 bf16), B (16 x 16 pairs). */
static void configure_tiles(void) {
  static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
  load_tiles(8, rows);
}

/* x [M, K] bf16 -> tiles [M/16][K/32] of 16 K-pairs x 16 rows (32-bit pairs), zero-padded rows. */
static uint32_t* pair_interleave(const uint16_t* x, int64_t M, int64_t K, int64_t m_blocks) {
  const int64_t k_blocks = K / 32;
  uint32_t* xb = aligned_alloc(64, (size_t)m_blocks * k_blocks * 1024);
  for (int64_t mb = 0; mb < m_blocks; ++mb) {
    if (mb * 16 + 16 <= M) { /* a whole block: each K-block a 16 x 16 transpose of pairs */
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        __m512 col[16];
        vload_transposed((const float*)(x + mb * 16 * K + kb * 32), K / 2, col);
        for (int p = 0; p < 16; ++p) _mm512_store_ps((float*)(xb + (mb * k_blocks + kb) * 256 + p * 16), col[p]);
      }
      continue;
    }
    /* the last, part-filled block (a decode step's rows): zeroed whole, then its rows' pairs
     * (1 row, 30 layers: 4.47 -> 4.31 ms against a test per row and pair for all 16) */
    memset(xb + mb * k_blocks * 256, 0, (size_t)k_blocks * 1024);
    for (int64_t j = 0; mb * 16 + j < M; ++j) {
      const uint32_t* row = (const uint32_t*)(x + (mb * 16 + j) * K);
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        uint32_t* tile = xb + (mb * k_blocks + kb) * 256;
        for (int64_t p = 0; p < 16; ++p) tile[p * 16 + j] = row[kb * 16 + p];
      }
    }
  }
  return xb;
}

/* One C tile (16 features x 16 rows, fp32) -> out rows [m0, m0 + 16) x features [n0, n0 + 16)
 * through tile_epilogue.h's finish_row (bf16 ``out`` + bias, rounded, + residual, rounded
 * again; or, with ``out32``, the fp32 sums + bias), which the twin runs too. From 3 rows the
 * tile is transposed in registers (64 shuffles, as pair_interleave transposes whole row
 * blocks), so each output row is one store. With a gather per row and a scalar interleave,
 * 30 layers of the default model's bf16 shapes at 512 rows took 81 ms on a 2-core AMX Xeon
 * (minimum of 5); now 65 (oneDNN's: 43). */
static void write_tile(const float* c, int64_t n0, int64_t m0, int64_t M, int64_t N, int64_t ldo,
                       const uint16_t* bias, const uint16_t* residual, uint16_t* out, float* out32) {
  const int64_t rows = M - m0 < 16 ? M - m0 : 16;
  __m512 col[16];
  if (rows >= 3) {
    vload_transposed(c, 16, col);
  } else { /* 1-2 rows (decode): a gather each is cheaper (1 row, 30 layers: 4.41 vs 4.51 ms) */
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    for (int64_t j = 0; j < rows; ++j)
      col[j] = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32((int)j)), c, 4);
  }
  const epilogue e = {bias, residual, out, out32, N, ldo};
  for (int64_t j = 0; j < rows; ++j) finish_row(col[j], m0 + j, n0, &e);
}

/* Two feature blocks x two row blocks: tmm0-3 accumulate, tmm4-5 hold W, tmm6-7 x. */
static void pass_2x2(const uint16_t* w0, const uint16_t* w1, const uint32_t* x0, const uint32_t* x1,
                     int64_t k_blocks, int64_t stride, float c[4][256]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    _tile_loadd(4, w0 + kb * 32, stride);
    _tile_loadd(5, w1 + kb * 32, stride);
    _tile_loadd(6, x0 + kb * 256, 64);
    _tile_loadd(7, x1 + kb * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
}

/* Two feature blocks x the last, single row block (tile registers are immediates in the
 * instructions, so each shape of pass is spelled out). */
static void pass_2x1(const uint16_t* w0, const uint16_t* w1, const uint32_t* x0, int64_t k_blocks, int64_t stride,
                     float c[4][256]) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    _tile_loadd(4, w0 + kb * 32, stride);
    _tile_loadd(5, w1 + kb * 32, stride);
    _tile_loadd(6, x0 + kb * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
}

static void gemm_tiles(const uint16_t* w, const uint32_t* xb, const uint16_t* bias, const uint16_t* residual,
                       uint16_t* out, float* out32, int64_t M, int64_t N, int64_t K, int64_t ldo, int64_t m_blocks,
                       int threads) {
  const int64_t k_blocks = K / 32, n_pairs = N / 32, stride = K * 2;
#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
    float c[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int64_t np = 0; np < n_pairs; ++np) {
      const int64_t n0 = np * 32;
      const uint16_t* w0 = w + n0 * K;
      for (int64_t mb = 0; mb < m_blocks; mb += 2) {
        const uint32_t* x0 = xb + mb * k_blocks * 256;
        if (mb + 1 < m_blocks) {
          pass_2x2(w0, w0 + 16 * K, x0, x0 + k_blocks * 256, k_blocks, stride, c);
          write_tile(c[2], n0, (mb + 1) * 16, M, N, ldo, bias, residual, out, out32);
          write_tile(c[3], n0 + 16, (mb + 1) * 16, M, N, ldo, bias, residual, out, out32);
        } else {
          pass_2x1(w0, w0 + 16 * K, x0, k_blocks, stride, c);
        }
        write_tile(c[0], n0, mb * 16, M, N, ldo, bias, residual, out, out32);
        write_tile(c[1], n0 + 16, mb * 16, M, N, ldo, bias, residual, out, out32);
      }
    }
    _tile_release();
  }
}

/* bf16 x [M, K] against w on the tiles, written by write_tile (bf16 ``out`` or fp32 ``out32``, rows
 * ``ldo`` apart in out32): every entry point below. */
static void multiply_tiles(const uint16_t* x, const uint16_t* w, const void* bias, const void* residual, void* out,
                           float* out32, int64_t M, int64_t N, int64_t K, int64_t ldo, int threads) {
  const int64_t m_blocks = (M + 15) / 16;
  uint32_t* xb = pair_interleave(x, M, K, m_blocks);
  gemm_tiles(w, xb, bias, residual, out, out32, M, N, K, ldo, m_blocks, threads);
  free(xb);
}

#else
int xl_amx_ready(void) { return 0; }
#endif

/* gemm_tile_order_dense.c: the tiles' arithmetic in FMAs, for CPUs without them */
void xl_tile_order_dense(const uint16_t* x, const uint16_t* w, const void* bias, const void* residual, void* out,
                         float* out32, int64_t M, int64_t N, int64_t K, int64_t ldo, int threads);
void xl_round_rows_bf16(const float* x, uint16_t* out, int64_t count);

/* The tiles where the process may use them, else their twin: the same bits either way. */
static void multiply(const uint16_t* x, const uint16_t* w, const void* bias, const void* residual, void* out,
                     float* out32, int64_t M, int64_t N, int64_t K, int64_t ldo, int threads) {
#ifdef XL_HAVE_AMX
  if (amx_permitted()) return multiply_tiles(x, w, bias, residual, out, out32, M, N, K, ldo, threads);
#endif
  xl_tile_order_dense(x, w, bias, residual, out, out32, M, N, K, ldo, threads);
}

/* out = x @ w.T (+ bias) (+ residual), all bf16, rounded as xl_linear_bf16 rounds;
 * K % 32 == 0, N % 32 == 0. */
void xl_linear_amx(const uint16_t* x, const uint16_t* w, const void* bias, const void* residual, void* out,
                   int64_t M, int64_t N, int64_t K, int threads) {
  multiply(x, w, bias, residual, out, NULL, M, N, K, N, threads);
}

/* out [M, N] fp32 = x @ w.T, x and w bf16: the tiles' fp32 sums, never rounded (the logits). */
void xl_linear_amx_f32(const uint16_t* x, const uint16_t* w, float* out, int64_t M, int64_t N, int64_t K,
                       int threads) {
  multiply(x, w, NULL, NULL, NULL, out, M, N, K, N, threads);
}

/* out [M, ldo] fp32, columns 0..N-1 = x @ w.T, x fp32 rounded to bf16 (to nearest even: the
 * activations of a bf16 model already are), w bf16: the batch-invariant matmul of
 * --deterministic (invariant_linear.py), for every M, one row as many. Each output is one tile
 * element accumulated over K in one order by one thread, whatever M, the row's place in its
 * tile or the thread count (tested); on a CPU without the tiles their twin computes the same
 * bits (gemm_tile_order_dense.c), so the mode answers alike on both. */
void xl_linear_amx_dense(const float* x, const uint16_t* w, float* out, int64_t M, int64_t N, int64_t K,
                         int64_t ldo, int threads) {
  uint16_t* xh = xl_scratch((size_t)M * K * 2);
  xl_round_rows_bf16(x, xh, M * K); /* K % 32 == 0 */
  multiply(xh, w, NULL, NULL, NULL, out, M, N, K, ldo, threads);
  free(xh);
}

