/* Q4_0, Q4_1 and Q8_0 weights against activations quantized to 8 bits per 32 values, the
 * scheme llama.cpp computes these formats with (its Q8_0 / Q8_1 activation blocks):
 *
 *   x block -> d = max|x| / 127 (stored as float16), q = round(x * 127 / max|x|), s = d * sum(q)
 *   w.x     = sum over blocks of  d_w * d_x * (q_w . q_x)   (+ m_w * s_x for Q4_1)
 *
 * q_w . q_x is an exact integer: vpdpbusd on CPUs with AVX512-VNNI, vpmaddubsw + vpmaddwd
 * elsewhere (AVX2). The price is the activations' rounding: results are within bf16's error of
 * the dequantized weights' (tested), not fp32's. Asked for with --int8-activations. Against
 * the fp32-activation path (gemm_quant.c), 30 layers of the default model's Q4_1 shapes, 2-core
 * Zen 4 EPYC, in one process, minimum of 5: 1 row 2.43 vs 3.43 ms, 32 rows 29.3 vs 38.0, 128
 * rows 113 vs 141 (the 256-bit VNNI kernel before this one: 2.93, 47.1 at 32 rows, slower
 * than fp32 from 4 rows); on an AVX2 machine 0.115 vs 0.224 ms for a 3072 x 1024 Q4_1 weight.
 *
 * Batch invariance: a row's activations are quantized alone, and each output accumulates its
 * blocks in order into fixed fp32 lanes (16 with AVX512-VNNI, 8 on AVX2) summed in a fixed
 * order, whatever M, the tile or the thread.
 */
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"
#include "scratch.h"
#include "vec_portable.h"

int xl_q8_handles(int type) { return type == Q4_0 || type == Q4_1 || type == Q8_0; }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* AVX512-VNNI, 512 bits wide: vpdpbusd multiplies 64 unsigned weight bytes by 64 signed
 * activation bytes into 16 int32 lanes, each the exact sum of 4 products. A group is 4
 * blocks: the 4-bit formats' low nibbles (values 0-15 of the 4 blocks) in one register and
 * their high nibbles (values 16-31) in another, two vpdpbusd, so lane l holds an exact
 * integer part of block l / 4's dot; Q8_0's values are two blocks a register (lane l of a
 * register: block l / 8). Each register of lanes then takes one conversion and one FMA with
 * its lanes' d_w * d_x, and Q4_1 one more with m_w * s_x. A weight group is unpacked once for
 * up to ROWS_MAX activation rows.
 *
 * Activations (quantize_row): per group, the bytes in the order the weight registers hold
 * them, each lane's d_x, Q4_1's s_x (in the block's first lane, zero in the others), and the
 * offset that makes the unsigned operand signed: Q4_0 multiplies q_w (0..15) and subtracts 8
 * times the lane's activation sum, Q8_0 multiplies q_w + 128 and subtracts 128 times it; the
 * offset is the initial value of the lane, so it costs nothing.
 *
 * Batch invariance: every output (weight row, activation row) sees the same operations in
 * the same order whatever M, the tile or the thread: exact integer lanes, then per group the
 * same conversions and FMAs into one accumulator of 16 lanes, summed in a fixed order. */
#define GROUP 4
#define ROWS_MAX 4 /* activation rows a weight group is unpacked for; 8 measured 2-5% slower at 4-128 rows */
#define N_TILE 64 /* weight rows a chunk; 16 measured 3-5% slower at 32-128 rows, 256 the same */

typedef struct {
  int8_t x[128];    /* Q4: values 0-15 of blocks 0-3, then 16-31; Q8_0: blocks 0-1, then 2-3 */
  float dx[32];     /* Q4: lanes 0-15 (block l / 4); Q8_0: register s's lanes at 16 s (block 2 s + l / 8) */
  float sx[16];     /* Q4_1: d * sum of block b in lane 4 b, zero elsewhere */
  int32_t init[32]; /* Q4_0: -8, Q8_0: -128 times the sum of the activations each lane multiplies */
} act_group;

/* Lane sums of ``values`` (int8, 4 per lane), ``lanes`` of them, times ``scale``. */
static inline void lane_offsets(const int8_t* values, int lanes, int scale, int32_t* out) {
  for (int l = 0; l < lanes; ++l)
    out[l] = scale * (values[4 * l] + values[4 * l + 1] + values[4 * l + 2] + values[4 * l + 3]);
}

/* One row of K values into groups (zeros past the last block), llama.cpp's rounding: d =
 * max|x| / 127, q = round-to-nearest-even(x * 127 / max|x|), d and d * sum(q) as float16. */
static void quantize_row(int type, const float* x, int64_t blocks, act_group* groups) {
  memset(groups, 0, sizeof(act_group) * (size_t)((blocks + GROUP - 1) / GROUP));
  for (int64_t b = 0; b < blocks; ++b) {
    act_group* g = groups + b / GROUP;
    const int j = (int)(b % GROUP);
    __m512i q0, q1;
    int sum;
    const float d = quantize_block32(x + 32 * b, &q0, &q1, &sum);
    int8_t* lo = type == Q8_0 ? g->x + 64 * (j / 2) + 32 * (j % 2) : g->x + 16 * j;
    int8_t* hi = type == Q8_0 ? lo + 16 : lo + 64;
    _mm_storeu_si128((__m128i*)lo, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)hi, _mm512_cvtepi32_epi8(q1));
    const float dh = half_round(d);
    if (type == Q8_0) {
      const int at = 16 * (j / 2) + 8 * (j % 2);
      for (int l = 0; l < 8; ++l) g->dx[at + l] = dh;
      lane_offsets(lo, 8, -128, g->init + at);
      continue;
    }
    for (int l = 0; l < 4; ++l) g->dx[4 * j + l] = dh;
    if (type == Q4_1) g->sx[4 * j] = half_round(d * (float)sum);
    if (type == Q4_0) {
      int32_t lo_sums[4], hi_sums[4];
      lane_offsets(lo, 4, -8, lo_sums), lane_offsets(hi, 4, -8, hi_sums);
      for (int l = 0; l < 4; ++l) g->init[4 * j + l] = lo_sums[l] + hi_sums[l];
    }
  }
}

/* A weight group of ``nb`` (1..4) blocks: the unsigned operands u (two registers: the 4-bit
 * formats' low and high nibbles, or Q8_0's blocks 0-1 and 2-3), each register's lane scales dw, and Q4_1's mins in the blocks' first
 * lanes. Nothing past the group's last block is read. */
typedef struct {
  __m512i u[2];
  __m512 dw[2], mw;
} weight_group;

static inline __attribute__((always_inline)) weight_group unpack_group(int type, const uint8_t* blk, int bytes, int nb) {
  weight_group g;
  const int64_t length = (int64_t)nb * bytes;
  const __m512i head = _mm512_maskz_loadu_epi8(length >= 64 ? ~0ULL : (1ULL << length) - 1, blk);
  if (type == Q8_0) {
    __m256i v[GROUP];
    for (int j = 0; j < GROUP; ++j)
      v[j] = j < nb ? _mm256_loadu_si256((const __m256i*)(blk + j * bytes + 2)) : _mm256_setzero_si256();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    g.u[0] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v[0]), v[1], 1), flip);
    g.u[1] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v[2]), v[3], 1), flip);
    const int64_t rest = length - 64; /* d of blocks 2 and 3 sit past the first 64 bytes */
    const __m512i tail = _mm512_maskz_loadu_epi8(rest <= 0 ? 0 : rest >= 64 ? ~0ULL : (1ULL << rest) - 1, blk + 64);
    const __m512i d = _mm512_permutex2var_epi16(
        head, _mm512_set_epi16(51, 51, 51, 51, 51, 51, 51, 51, 34, 34, 34, 34, 34, 34, 34, 34, 17, 17, 17, 17, 17, 17,
                               17, 17, 0, 0, 0, 0, 0, 0, 0, 0), tail);
    g.dw[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(d));
    g.dw[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(d, 1));
    g.mw = _mm512_setzero_ps();
    return g;
  }
  const int off = type == Q4_1 ? 4 : 2;
  __m128i q[GROUP];
  for (int j = 0; j < GROUP; ++j)
    q[j] = j < nb ? _mm_loadu_si128((const __m128i*)(blk + j * bytes + off)) : _mm_setzero_si128();
  const __m512i v = _mm512_inserti32x4(
      _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(q[0]), q[1], 1), q[2], 2), q[3], 3);
  const __m512i low4 = _mm512_set1_epi8(15);
  g.u[0] = _mm512_and_si512(v, low4);
  g.u[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  /* the scales' float16 words: d of block j at word j * bytes / 2, Q4_1's m one word later */
  const short s = (short)(bytes / 2);
  const __m512i dm = _mm512_maskz_permutexvar_epi16(
      0x1111FFFF, _mm512_set_epi16(0, 0, 0, 3 * s + 1, 0, 0, 0, 2 * s + 1, 0, 0, 0, s + 1, 0, 0, 0, 1, 3 * s, 3 * s,
                                   3 * s, 3 * s, 2 * s, 2 * s, 2 * s, 2 * s, s, s, s, s, 0, 0, 0, 0),
      head);
  g.dw[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
  g.dw[1] = _mm512_setzero_ps();
  g.mw = type == Q4_1 ? _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1)) : _mm512_setzero_ps();
  return g;
}

/* One weight group against one activation row's group: into ``acc``. */
static inline __attribute__((always_inline)) __m512 group_dot(int type, const weight_group* w, const act_group* a,
                                                             __m512 acc) {
  if (type == Q8_0) {
    for (int s = 0; s < 2; ++s) {
      const __m512i dots = _mm512_dpbusd_epi32(_mm512_loadu_si512(a->init + 16 * s), w->u[s],
                                               _mm512_loadu_si512(a->x + 64 * s));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(w->dw[s], _mm512_loadu_ps(a->dx + 16 * s)), acc);
    }
    return acc;
  }
  const __m512i init = type == Q4_0 ? _mm512_loadu_si512(a->init) : _mm512_setzero_si512();
  const __m512i dots = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init, w->u[0], _mm512_loadu_si512(a->x)), w->u[1],
                                           _mm512_loadu_si512(a->x + 64));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(w->dw[0], _mm512_loadu_ps(a->dx)), acc);
  return type == Q4_1 ? _mm512_fmadd_ps(w->mw, _mm512_loadu_ps(a->sx), acc) : acc;
}

/* One weight row ``w`` against MR activation rows (``a``, ``groups`` apart): out[i * ldo]. */
static inline __attribute__((always_inline)) void row_dot(int type, int MR, const uint8_t* w, const act_group* a,
                                                         int64_t blocks, int64_t groups, float* out, int64_t ldo) {
  const int bytes = block_bytes(type);
  __m512 acc[ROWS_MAX];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = w + g * GROUP * bytes;
    prefetch_ahead(blk), prefetch_ahead(blk + 64);
    const int nb = blocks - g * GROUP < GROUP ? (int)(blocks - g * GROUP) : GROUP;
    const weight_group wg = nb == GROUP ? unpack_group(type, blk, bytes, GROUP) : unpack_group(type, blk, bytes, nb);
    for (int i = 0; i < MR; ++i) acc[i] = group_dot(type, &wg, a + i * groups + g, acc[i]);
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = _mm512_reduce_add_ps(acc[i]);
}

#define ROW_DOT_CASE(R) \
  case R: row_dot(type, R, w, a, blocks, groups, out, ldo); break;

static inline __attribute__((always_inline)) void rows_dot(int type, int rows, const uint8_t* w, const act_group* a,
                                                          int64_t blocks, int64_t groups, float* out, int64_t ldo) {
  switch (rows) {
    ROW_DOT_CASE(1) ROW_DOT_CASE(2) ROW_DOT_CASE(3) default: row_dot(type, 4, w, a, blocks, groups, out, ldo);
  }
}

/* Weight rows in chunks of about N_TILE, an equal number of chunks per thread; each chunk
 * against every activation row, ROWS_MAX at a time, so the chunk stays in cache while the
 * activation rows go by. */
static inline __attribute__((always_inline)) void rows_of(int type, const uint8_t* w, int64_t row_bytes,
                                                         const act_group* a, int64_t M, int64_t N, int64_t blocks,
                                                         float* out, int64_t ldo, int threads) {
  const int64_t groups = (blocks + GROUP - 1) / GROUP;
  const int64_t chunks = threads * ((N + threads * N_TILE - 1) / (threads * N_TILE)), per = (N + chunks - 1) / chunks;
#pragma omp for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n1 = (c + 1) * per < N ? (c + 1) * per : N;
    for (int64_t m = 0; m < M; m += ROWS_MAX)
      for (int64_t n = c * per; n < n1; ++n)
        rows_dot(type, M - m < ROWS_MAX ? (int)(M - m) : ROWS_MAX, w + n * row_bytes, a + m * groups, blocks, groups,
                 out + m * ldo + n, ldo);
  }
}

void xl_linear_q8(int type, const float* x, const uint8_t* w, int64_t row_bytes, float* out, int64_t M, int64_t N,
                  int64_t K, int64_t ldo, int threads) {
  const int64_t blocks = K / 32, groups = (blocks + GROUP - 1) / GROUP;
  act_group* a = (act_group*)aligned_alloc(64, sizeof(act_group) * (size_t)(M * groups));
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) quantize_row(type, x + m * K, blocks, a + m * groups);
    if (type == Q4_1) rows_of(Q4_1, w, row_bytes, a, M, N, blocks, out, ldo, threads);
    else if (type == Q4_0) rows_of(Q4_0, w, row_bytes, a, M, N, blocks, out, ldo, threads);
    else rows_of(Q8_0, w, row_bytes, a, M, N, blocks, out, ldo, threads);
  }
  free(a);
}
#else
#define NR 4 /* weight rows per tile: independent accumulation chains */

typedef struct {
  float d, s; /* block scale and d * sum(q), each rounded to float16 as ggml stores them */
} act_block;

/* One row of K values (a multiple of 32) into int8 blocks by llama.cpp's rule (quant_blocks.h). */
static void quantize_row(const float* x, int64_t K, int8_t* q, act_block* blocks) {
  for (int64_t b = 0; b < K / 32; ++b) {
    int sum;
    const float d = quantize_q8_block(x + 32 * b, q + 32 * b, &sum);
    blocks[b].d = half_round(d);
    blocks[b].s = half_round(d * (float)sum);
  }
}

/* 16 bytes of nibbles -> 32 bytes: low nibbles are values 0..15, high ones 16..31. */
static inline __m256i nibbles32(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

/* sum of 32 products of unsigned u and signed s bytes, as 8 int32 lanes -> floats */
static inline __m256 dot_us(__m256i u, __m256i s) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* signed . signed: vpmaddubsw takes one unsigned operand, so move the signs onto s */
static inline __m256 dot_ss(__m256i a, __m256i s) {
  return dot_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(s, a));
}

/* NR weight rows (``rows`` real) against one quantized activation row: out[r]. Inlined with
 * a constant ``type``, so each format is its own loop without branches. (Expanding a weight
 * block once for two activation rows measured slower: the accumulators spill.) */
static inline __attribute__((always_inline)) void tile_dot(int type, const uint8_t* w, int64_t row_bytes, int rows,
                                                          const int8_t* xq, const act_block* xb, int64_t blocks,
                                                          float* out) {
  __m256 acc[NR];
  float mins[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps(), mins[r] = 0.0f;
  const int bytes = block_bytes(type);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i qx = _mm256_loadu_si256((const __m256i*)(xq + 32 * b));
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w + (r < rows ? r : 0) * row_bytes + b * bytes;
      prefetch_ahead(blk);
      const __m256 d = _mm256_set1_ps(half(blk) * xb[b].d);
      __m256 dot;
      if (type == Q4_1) {
        dot = dot_us(nibbles32(blk + 4), qx);
        mins[r] += half(blk + 2) * xb[b].s;
      } else if (type == Q4_0) {
        dot = dot_ss(_mm256_sub_epi8(nibbles32(blk + 2), _mm256_set1_epi8(8)), qx);
      } else {
        dot = dot_ss(_mm256_loadu_si256((const __m256i*)(blk + 2)), qx);
      }
      acc[r] = _mm256_fmadd_ps(d, dot, acc[r]);
    }
  }
  for (int r = 0; r < rows; ++r) out[r] = hsum256(acc[r]) + mins[r];
}

static inline __attribute__((always_inline)) void tiles_of(int type, const uint8_t* w, int64_t row_bytes,
                                                          const int8_t* xq, const act_block* xb, int64_t blocks,
                                                          float* out, int64_t M, int64_t N, int64_t ldo,
                                                          int64_t tiles, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * NR;
    const int rows = N - n0 < NR ? (int)(N - n0) : NR;
    for (int64_t m = 0; m < M; ++m)
      tile_dot(type, w + n0 * row_bytes, row_bytes, rows, xq + m * blocks * 32, xb + m * blocks, blocks,
               out + m * ldo + n0);
  }
}

/* x: [M, K] fp32; w: [N, row_bytes]; out: [M, ldo], columns 0..N-1. */
void xl_linear_q8(int type, const float* x, const uint8_t* w, int64_t row_bytes, float* out, int64_t M, int64_t N,
                  int64_t K, int64_t ldo, int threads) {
  const int64_t blocks = K / 32, tiles = (N + NR - 1) / NR;
  int8_t* xq = (int8_t*)xl_scratch((size_t)(M * K));
  act_block* xb = (act_block*)xl_scratch(sizeof(act_block) * (size_t)(M * blocks));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, xq + m * K, xb + m * blocks);
  if (type == Q4_1) tiles_of(Q4_1, w, row_bytes, xq, xb, blocks, out, M, N, ldo, tiles, threads);
  else if (type == Q4_0) tiles_of(Q4_0, w, row_bytes, xq, xb, blocks, out, M, N, ldo, tiles, threads);
  else tiles_of(Q8_0, w, row_bytes, xq, xb, blocks, out, M, N, ldo, tiles, threads);
  free(xq);
  free(xb);
}
#endif
