/* Q4_0, Q4_1 and Q8_0 weights interleaved 16 rows at a time, against 8-bit activations: the
 * layout --int8-activations repacks these formats into (llama.cpp repacks the same way for
 * its fastest CPU kernels), on every build: 16 rows at once with AVX512-VNNI, 8 without.
 * Same scheme as dot_q8.c (llama.cpp's Q8_0 / Q8_1 activation blocks), and the same
 * operations in the same order as ggml's own ggml_vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0
 * on x86 (which llama.cpp runs on weights as stored): every output is bit-identical to
 * llama.cpp's (tests/unit/test_ggml_parity.py calls libggml-cpu where the ``peers`` extra is
 * installed), so greedy output parts from llama.cpp's only where the rest of the model
 * computes differently.
 *
 * One 512-bit register holds 4 bytes of each of 16 weight rows (lane r: row r), so one
 * vpdpbusd against 4 activation bytes broadcast adds 4 products to each of 16 rows' lanes.
 * ggml keeps 8 fp32 lanes per dot (values 4t..4t+3 of every block in lane t), so each row
 * carries 8 accumulators: 8 conversions and 8 FMAs per block for 16 rows. 30 layers of the
 * default model's Q4_1 shapes, 2-core Xeon with AMX (Emerald Rapids), min of 9, twice in one
 * process: 1 row 2.41-2.52 ms against 3.19-3.21 for dot_q8.c's row-major kernel (4.25-4.28
 * with fp32 activations), 32 rows 26.0-26.1 against 35.3-35.5 (31.1-31.3). One exact integer
 * per block and row and one FMA (not ggml's order) was 1.9-2.2x the row-major kernel, but
 * failed the agreement with llama.cpp's greedy output (tests/e2e/test_llama_cpp_numerics.py).
 *
 * Layout of a group of 16 rows, block by block (the same bytes as the 16 rows' blocks):
 *   Q4_0 / Q4_1: 4 registers of nibbles: register j, lane r, byte t holds value 8j + t of row
 *                r's block in its low nibble and value 8j + 4 + t in its high one; then the
 *                16 rows' d (float16), then Q4_1's 16 m.
 *   Q8_0:        8 registers: register j, lane r, byte t holds value 4j + t; then 16 d.
 * gguf_blocks.interleave16 packs it (and deinterleave16 undoes it); x16_row below reads one
 * row back for an embedding lookup.
 *
 * Batch invariance: each output's 8 lanes are exact per block (int32), then fp32 FMAs in
 * block order, one accumulator a lane, summed in a fixed order (group_dot), whatever M, the
 * chunk or the thread.
 */
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"
#include "scratch.h"

/* Row ``n`` of an interleaved weight with ``blocks`` blocks a row, back in GGUF's layout. */
void x16_row(int base, const uint8_t* w, int64_t blocks, int64_t n, uint8_t* row) {
  const int bb = block_bytes(base), lane = (int)(n % 16), scales = base == Q8_0 ? 512 : 256;
  const uint8_t* group = w + (n / 16) * blocks * 16 * bb;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* g = group + b * 16 * bb;
    uint8_t* out = row + b * bb;
    memcpy(out, g + scales + 2 * lane, 2);
    if (base == Q4_1) memcpy(out + 2, g + scales + 32 + 2 * lane, 2);
    if (base == Q8_0) {
      for (int j = 0; j < 8; ++j) memcpy(out + 2 + 4 * j, g + 64 * j + 4 * lane, 4);
      continue;
    }
    uint8_t v[32];
    for (int j = 0; j < 4; ++j)
      for (int t = 0; t < 4; ++t) {
        const uint8_t byte = g[64 * j + 4 * lane + t];
        v[8 * j + t] = byte & 15, v[8 * j + 4 + t] = byte >> 4;
      }
    uint8_t* qs = out + (base == Q4_1 ? 4 : 2);
    for (int i = 0; i < 16; ++i) qs[i] = (uint8_t)(v[i] | (v[i + 16] << 4));
  }
}

#define CHUNK_GROUPS 4 /* groups (64 weight rows) a thread's chunk: stays in L1 while activation rows go by */

/* One activation block: its 32 values (int8, in order), d (float16-rounded), Q4_1's d * sum
 * (float16-rounded), and per 4-value lane the integer that makes the unsigned weight operand
 * signed (Q4_0: -8 times the lane's activation sum, Q8_0: -128 times it), the lane's initial
 * value. */
typedef struct {
  int8_t q[32];
  float d, s;
  int32_t offset[8];
} act_block;

static void quantize_row(int base, const float* x, int64_t blocks, act_block* out) {
  const int scale = base == Q4_0 ? -8 : base == Q8_0 ? -128 : 0;
  for (int64_t b = 0; b < blocks; ++b) {
    int sum;
    const float d = quantize_q8_block(x + 32 * b, out[b].q, &sum);
    out[b].d = half_round(d);
    out[b].s = base == Q4_1 ? half_round(d * (float)sum) : 0.0f;
    for (int t = 0; t < 8; ++t) {
      const int8_t* v = out[b].q + 4 * t;
      out[b].offset[t] = scale * (v[0] + v[1] + v[2] + v[3]);
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Activation rows per pass over a group. 4 x 9 accumulators spill a few registers and still
 * win from 4 rows: 30 layers of the default model's Q4_1 shapes, ratio to the row-major
 * kernel in the same process, 4 / 3 / 2 rows a pass: at 4 rows 0.76 / 0.90 / 1.0, 8 rows
 * 0.77 / 0.84 / 0.92, 32 rows 0.73 / 0.81 / 0.80; at 1 row 0.72-0.77 alike. */
#define ROWS_MAX 4

/* 16 rows' block: the unsigned operands, 8 registers, register t against activation dword t */
static inline __attribute__((always_inline)) void unpack(int base, const uint8_t* g, __m512i* u) {
  if (base == Q8_0) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int t = 0; t < 8; ++t) u[t] = _mm512_xor_si512(_mm512_loadu_si512(g + 64 * t), flip);
    return;
  }
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(g + 64 * j);
    u[2 * j] = _mm512_and_si512(v, low4);
    u[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  }
}

/* One group of 16 weight rows against R activation rows (``a``, ``blocks`` apart): 16
 * outputs per activation row, at out + i * ldo. Lane t of a block (values 4t..4t+3) is an
 * exact integer, scaled and added into its own accumulator, block after block; the 8 lanes
 * are then summed ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)), and Q4_1's m * s, summed apart,
 * added last: the operations of ggml's vec_dot_q4_1_q8_1 / q4_0_q8_0 / q8_0_q8_0 on
 * AVX2 and AVX-512 (8 lanes of 32 bits, FMAs, hsum_float_8), 16 rows at a time. */
static inline __attribute__((always_inline)) void group_dot(int base, int R, const uint8_t* g, const act_block* a,
                                                           int64_t blocks, float* out, int64_t ldo) {
  const int gb = 16 * block_bytes(base), scales = base == Q8_0 ? 512 : 256;
  __m512 acc[ROWS_MAX][8], mins[ROWS_MAX];
  for (int i = 0; i < R; ++i) {
    mins[i] = _mm512_setzero_ps();
    for (int t = 0; t < 8; ++t) acc[i][t] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = g + b * gb;
    for (int c = 0; c < gb; c += 64) prefetch_ahead(p + c);
    __m512i u[8];
    unpack(base, p, u);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + scales)));
    const __m512 m = base == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + scales + 32)))
                                  : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const act_block* x = a + i * blocks + b;
      const int32_t* xq = (const int32_t*)x->q;
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x->d));
      for (int t = 0; t < 8; ++t) {
        const __m512i init = base == Q4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(x->offset[t]);
        const __m512i dots = _mm512_dpbusd_epi32(init, u[t], _mm512_set1_epi32(xq[t]));
        acc[i][t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dots), acc[i][t]);
      }
      if (base == Q4_1) mins[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(x->s), mins[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const __m512* l = acc[i];
    const __m512 even = _mm512_add_ps(_mm512_add_ps(l[0], l[4]), _mm512_add_ps(l[2], l[6]));
    const __m512 odd = _mm512_add_ps(_mm512_add_ps(l[1], l[5]), _mm512_add_ps(l[3], l[7]));
    _mm512_storeu_ps(out + i * ldo, _mm512_add_ps(_mm512_add_ps(even, odd), mins[i]));
  }
}

#define GROUP_DOT_CASE(R) \
  case R: group_dot(base, R, g, a, blocks, out, ldo); break;

static inline __attribute__((always_inline)) void groups_dot(int base, int rows, const uint8_t* g, const act_block* a,
                                                            int64_t blocks, float* out, int64_t ldo) {
  switch (rows) {
    GROUP_DOT_CASE(1) GROUP_DOT_CASE(2) GROUP_DOT_CASE(3) default: group_dot(base, 4, g, a, blocks, out, ldo);
  }
}

#else
/* AVX2 (and AVX-512 without VNNI): the same layout read 8 rows at a time. A 256-bit half of
 * register j holds 4 bytes of each of 8 rows (lane r: row r of the half), so vpmaddubsw +
 * vpmaddwd against 4 activation bytes broadcast give the exact integer of lane t for 8 rows,
 * and each of the 8 accumulators carries one of ggml's 8 lanes for the 8 rows: the bits of
 * ggml's AVX2 vec_dot (tests/unit/test_ggml_parity.py), ~8 instructions a block and row
 * where the row-major kernel (dot_q8.c) takes ~20. 16 rows' 8 lanes would take 16 of AVX2's
 * 16 registers, so a group is read in two passes, one a half; the second finds it in cache.
 * 2-core Zen 3 EPYC, one process, medians of 11 interleaved, 1 row, against the row-major
 * 8-bit kernel and fp32 activations: 30 layers' Q4_1 138240 x 576 4.34 ms against 5.53 and
 * 5.63, 17280 x 1536 1.59 against 3.17 and 1.99, the Q8_0 head 2.37 against 5.26 and 2.92
 * (near the VM's bandwidth: 11-13 GB/s); 8 rows 1.5x fp32, 512 rows 1.1-1.2x. With the
 * weight in cache 2.2 ns a block and row on one core (fp32 activations: 5.3). */

/* lane t's exact integer for the 8 rows of half ``h``: unsigned weight bytes u against the
 * activation's 4 bytes x in every lane (Q4_0 then adds its offset, -8 times their sum) */
static inline __m256i lane_dot(__m256i u, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

/* Half ``h`` (rows 8h..8h+7) of a group of 16 weight rows against one activation row: 8
 * outputs at ``out``. The operations of ggml's AVX2 vec_dot for each row (see group_dot of the
 * VNNI build): exact lanes, one FMA a lane and block, hsum_float_8's order, Q4_1's m * s last. */
static inline __attribute__((always_inline)) void half_dot(int base, const uint8_t* g, int h, const act_block* a,
                                                          int64_t blocks, float* out) {
  const int gb = 16 * block_bytes(base), scales = base == Q8_0 ? 512 : 256;
  __m256 acc[8], mins = _mm256_setzero_ps();
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = g + b * gb;
    if (h == 0)
      for (int c = 0; c < gb; c += 64) prefetch_ahead(p + c);
    const act_block* x = a + b;
    const int32_t* xq = (const int32_t*)x->q;
    const __m256 scale =
        _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + scales + 16 * h))), _mm256_set1_ps(x->d));
    __m256i dots[8];
    if (base == Q8_0) {
      for (int t = 0; t < 8; ++t) { /* vpmaddubsw takes one unsigned operand: the signs go onto x */
        const __m256i w = _mm256_loadu_si256((const __m256i*)(p + 64 * t + 32 * h));
        dots[t] = lane_dot(_mm256_sign_epi8(w, w), _mm256_sign_epi8(_mm256_set1_epi32(xq[t]), w));
      }
    } else {
      const __m256i low4 = _mm256_set1_epi8(15);
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 64 * j + 32 * h));
        dots[2 * j] = lane_dot(_mm256_and_si256(v, low4), _mm256_set1_epi32(xq[2 * j]));
        dots[2 * j + 1] = lane_dot(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), _mm256_set1_epi32(xq[2 * j + 1]));
      }
    }
    for (int t = 0; t < 8; ++t) {
      if (base == Q4_0) dots[t] = _mm256_add_epi32(dots[t], _mm256_set1_epi32(x->offset[t]));
      acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dots[t]), acc[t]);
    }
    if (base == Q4_1)
      mins = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + scales + 32 + 16 * h))),
                             _mm256_set1_ps(x->s), mins);
  }
  const __m256 even = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
  const __m256 odd = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(even, odd), mins));
}

/* A group of 16 weight rows against one activation row, a half at a time (ROWS_MAX 1). */
#define ROWS_MAX 1
static inline __attribute__((always_inline)) void groups_dot(int base, int rows, const uint8_t* g, const act_block* a,
                                                            int64_t blocks, float* out, int64_t ldo) {
  (void)rows, (void)ldo;
  for (int h = 0; h < 2; ++h) half_dot(base, g, h, a, blocks, out + 8 * h);
}
#endif

/* Chunks of about CHUNK_GROUPS groups, the same number per thread, so two threads' shares
 * differ by one group at most (chunks of exactly CHUNK_GROUPS split a 576-row weight, 36
 * groups, 20 : 16, and a 64-row one 4 : 0). Each chunk against every activation row, ROWS_MAX
 * at a time. */
static inline __attribute__((always_inline)) void linear_of(int base, const uint8_t* w, const act_block* a, int64_t M,
                                                           int64_t N, int64_t blocks, float* out, int64_t ldo,
                                                           int threads) {
  const int64_t groups = N / 16, group_bytes = blocks * 16 * block_bytes(base);
  const int64_t chunks = threads * ((groups + threads * CHUNK_GROUPS - 1) / (threads * CHUNK_GROUPS));
#pragma omp for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t g0 = c * groups / chunks, g1 = (c + 1) * groups / chunks;
    for (int64_t m = 0; m < M; m += ROWS_MAX)
      for (int64_t g = g0; g < g1; ++g)
        groups_dot(base, M - m < ROWS_MAX ? (int)(M - m) : ROWS_MAX, w + g * group_bytes, a + m * blocks, blocks,
                   out + m * ldo + 16 * g, ldo);
  }
}

/* x: [M, K] fp32; w: N / 16 interleaved groups of ``base`` (N a multiple of 16); out: [M, ldo],
 * columns 0..N-1. */
void xl_linear_x16(int base, const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K,
                   int64_t ldo, int threads) {
  const int64_t blocks = K / 32;
  act_block* a = (act_block*)xl_scratch(sizeof(act_block) * (size_t)(M * blocks));
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) quantize_row(base, x + m * K, blocks, a + m * blocks);
    if (base == Q4_1) linear_of(Q4_1, w, a, M, N, blocks, out, ldo, threads);
    else if (base == Q4_0) linear_of(Q4_0, w, a, M, N, blocks, out, ldo, threads);
    else linear_of(Q8_0, w, a, M, N, blocks, out, ldo, threads);
  }
  free(a);
}
