/* The AMX tile kernel's arithmetic (gemm_amx_quant.c) without the tiles: Q4_0, Q4_1 and Q8_0
 * weights interleaved 16 rows at a time against bfloat16 activations, in vector FMAs, on any
 * CPU with AVX512F and AVX512BW (AMD Zen 4 / 5, Intel Ice Lake and Cooper Lake). Every output
 * has the bits the tiles give it, so a bfloat16 model kept in these formats answers the same
 * on a CPU with AMX and one without, and a prompt computed on one decodes on the other as on
 * one machine.
 *
 * The tile product's order (measured bit for bit against tdpbf16ps, docs/quantization.md): in
 * a block, the first products of a row's pairs summed in pair order, each step rounded to
 * fp32, the second products the same way, then the two added to the zeroed C tile. Every
 * product x (1 + q / 16) or x q is exact, so one FMA a product in that order is what the tile
 * computes; the block's scaling is tile_blocks.h's, shared. Not reproduced: a tile flushes a
 * partial sum below 2^-126 to zero, which the FMAs keep (a block's products cancelling to
 * that, never seen in a model's activations).
 *
 * A pass holds up to ROWS_MAX activation rows against one group: each pair's weights are made
 * once (two shifts and two vpternlogd for Q4's 16 rows) and feed two FMAs a row. Against the
 * fp32 kernel (gemm_quant.c) it replaces there, 30 layers of the default model's Q4_1 shapes
 * on the AMX Xeon capped at avx512-bf16, minimum of 7: 1 row 4.57 / 4.90 ms, 8 rows 10.4 /
 * 11.9, 32 rows 34.1 / 30.5, 64 rows 66.1 / 55.3. Slower still: a group's weights made once
 * into an fp32 buffer for every pass, and two groups a pass from such a buffer (16 rows 3.97
 * against 2.75 ms on 4 layers: the buffer leaves L1).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"
#include "scratch.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "tile_blocks.h"

int xl_tile_order_ready(void) { return 1; }

/* rows a pass takes: 3 accumulators a row (first and second sums, the scaled sum), 24 of the 32
 * registers at 8, beside the pair's two weights and the masks */
#define ROWS_MAX 8

/* Pair 4j + t of a Q4 block from its register v, lane r = row r's two values as fp32 1 + q / 16:
 * the nibbles of each dword's byte t moved to bits 19-22 (low nibble: the first value, high:
 * the second), the rest set to 1.0's bits */
static inline void q4_pair(__m512i v, int t, __m512* first, __m512* second) {
  __m512i lo, hi;
  switch (t) {
    case 0: lo = _mm512_slli_epi32(v, 19), hi = _mm512_slli_epi32(v, 15); break;
    case 1: lo = _mm512_slli_epi32(v, 11), hi = _mm512_slli_epi32(v, 7); break;
    case 2: lo = _mm512_slli_epi32(v, 3), hi = _mm512_srli_epi32(v, 1); break;
    default: lo = _mm512_srli_epi32(v, 5), hi = _mm512_srli_epi32(v, 9); break;
  }
  const __m512i one = _mm512_set1_epi32(0x3F800000), nibble = _mm512_set1_epi32(0x00780000);
  *first = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(lo, one, nibble, 0xEC)); /* (lo & nibble) | one */
  *second = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(hi, one, nibble, 0xEC));
}

/* The FMAs of one pair of the block: each of the R rows' first and second values (``a``: row i's
 * at 2 i and 2 i + 1) times the pair's weights, into its two sums. */
#define PAIR_FMAS(R, a, wf, ws)                                                                 \
  for (int i = 0; i < R; ++i) {                                                                 \
    first[i] = _mm512_fmadd_ps(_mm512_set1_ps((a)[2 * i]), wf, first[i]);                      \
    second[i] = _mm512_fmadd_ps(_mm512_set1_ps((a)[2 * i + 1]), ws, second[i]);                \
  }

/* R activation rows against one group of Q4_0 / Q4_1 (KIND q4) or Q8_0 (q8) weights: ``xp`` the
 * rows' pairs (``pass_pairs``), ``s`` the Q4 block sums ([blocks][ROWS_MAX]); each row's 16
 * outputs at out + i * ldo. */
#define GROUP_ROWS(KIND, R)                                                                              \
  static void KIND##_##R(int base, const uint8_t* g, const float* xp, const float* s, int64_t blocks,     \
                         float* out, int64_t ldo) {                                                      \
    const int gb = 16 * block_bytes(base);                                                               \
    __m512 acc[R];                                                                                       \
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();                                           \
    for (int64_t b = 0; b < blocks; ++b) {                                                               \
      const uint8_t* p = g + b * gb;                                                                     \
      for (int o = 0; o < gb; o += 64) prefetch_ahead(p + o);                                            \
      __m512 first[R], second[R];                                                                        \
      for (int i = 0; i < R; ++i) first[i] = second[i] = _mm512_setzero_ps();                           \
      const float* a = xp + b * 32 * ROWS_MAX;                                                           \
      KIND##_BLOCK(R)                                                                                    \
      __m512 d16, c;                                                                                     \
      block_scales(base, p, &d16, &c);                                                                   \
      for (int i = 0; i < R; ++i) /* the zeroed C tile plus the two sums */                              \
        acc[i] = scale_sums(base, acc[i], d16, c,                                                        \
                            _mm512_add_ps(_mm512_setzero_ps(), _mm512_add_ps(first[i], second[i])),      \
                            s[b * ROWS_MAX + i]);                                                        \
    }                                                                                                    \
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + i * ldo, acc[i]);                                \
  }
/* a Q4 block's 16 pairs: register j holds pairs 4j .. 4j + 3 */
#define q4_BLOCK(R)                                                                                      \
  for (int j = 0; j < 4; ++j) {                                                                          \
    const __m512i v = _mm512_loadu_si512(p + 64 * j);                                                    \
    __m512 wf, ws;                                                                                       \
    q4_pair(v, 0, &wf, &ws);                                                                             \
    PAIR_FMAS(R, a + (4 * j) * 2 * ROWS_MAX, wf, ws)                                                     \
    q4_pair(v, 1, &wf, &ws);                                                                             \
    PAIR_FMAS(R, a + (4 * j + 1) * 2 * ROWS_MAX, wf, ws)                                                 \
    q4_pair(v, 2, &wf, &ws);                                                                             \
    PAIR_FMAS(R, a + (4 * j + 2) * 2 * ROWS_MAX, wf, ws)                                                 \
    q4_pair(v, 3, &wf, &ws);                                                                             \
    PAIR_FMAS(R, a + (4 * j + 3) * 2 * ROWS_MAX, wf, ws)                                                 \
  }
/* a Q8_0 block's 16 pairs: register j holds pairs 2j and 2j + 1 */
#define q8_BLOCK(R)                                                                                      \
  for (int j = 0; j < 8; ++j) {                                                                          \
    const __m512i v = _mm512_loadu_si512(p + 64 * j);                                                    \
    PAIR_FMAS(R, a + (2 * j) * 2 * ROWS_MAX, q8_values(v, 0), q8_values(v, 1))                           \
    PAIR_FMAS(R, a + (2 * j + 1) * 2 * ROWS_MAX, q8_values(v, 2), q8_values(v, 3))                       \
  }
#define KINDS(R) GROUP_ROWS(q4, R) GROUP_ROWS(q8, R)
KINDS(1) KINDS(2) KINDS(3) KINDS(4) KINDS(5) KINDS(6) KINDS(7) KINDS(8)

typedef void (*group_fn)(int, const uint8_t*, const float*, const float*, int64_t, float*, int64_t);
static const group_fn Q4_GROUPS[ROWS_MAX + 1] = {NULL, q4_1, q4_2, q4_3, q4_4, q4_5, q4_6, q4_7, q4_8};
static const group_fn Q8_GROUPS[ROWS_MAX + 1] = {NULL, q8_1, q8_2, q8_3, q8_4, q8_5, q8_6, q8_7, q8_8};

/* The rows of pass q of M rows: ROWS_MAX, fewer in the last. */
static inline int rows_in_pass(int64_t M, int64_t q) {
  return M - q * ROWS_MAX < ROWS_MAX ? (int)(M - q * ROWS_MAX) : ROWS_MAX;
}

/* A pass of up to ROWS_MAX rows, each as ``pair_row`` makes it, laid out for the FMAs: pair p of
 * every row in one 64-byte line, [blocks * 16 pairs][ROWS_MAX rows][first, second] as fp32
 * (missing rows zero), and the Q4 block sums [blocks][ROWS_MAX]. */
static void pass_pairs(int base, const float* x, int64_t K, int rows, float* xp, float* s) {
  const int64_t blocks = K / 32;
  uint32_t* pairs = (uint32_t*)xl_scratch(sizeof(uint32_t) * 16 * (size_t)blocks);
  float* sums = (float*)xl_scratch(sizeof(float) * (size_t)blocks);
  memset(xp, 0, sizeof(float) * 32 * ROWS_MAX * (size_t)blocks);
  memset(s, 0, sizeof(float) * ROWS_MAX * (size_t)blocks);
  for (int i = 0; i < rows; ++i) {
    pair_row(base, x + i * K, blocks, pairs, sums);
    for (int64_t p = 0; p < 16 * blocks; ++p) {
      const uint32_t lo = pairs[p] << 16, hi = pairs[p] & 0xFFFF0000u;
      memcpy(xp + (p * ROWS_MAX + i) * 2, &lo, 4);
      memcpy(xp + (p * ROWS_MAX + i) * 2 + 1, &hi, 4);
    }
    if (base != Q8_0)
      for (int64_t b = 0; b < blocks; ++b) s[b * ROWS_MAX + i] = sums[b];
  }
  free(pairs);
  free(sums);
}

/* xl_linear_amx_quant's contract, the same bits: x [M, K] fp32 (rounded to bfloat16 here); w:
 * N / 16 interleaved groups of Q4_0, Q4_1 or Q8_0 (K a multiple of 64); out: [M, ldo], columns
 * 0..N-1. */
void xl_linear_tile_order(int base, const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K,
                          int64_t ldo, int threads) {
  const int64_t blocks = K / 32, groups = N / 16, passes = (M + ROWS_MAX - 1) / ROWS_MAX;
  const int64_t group_bytes = blocks * 16 * block_bytes(base), pass_floats = 32 * ROWS_MAX * blocks;
  float* xp = (float*)xl_scratch(sizeof(float) * (size_t)(passes * pass_floats));
  float* s = (float*)xl_scratch(sizeof(float) * (size_t)(passes * ROWS_MAX * blocks));
  const group_fn* fns = base == Q8_0 ? Q8_GROUPS : Q4_GROUPS;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t q = 0; q < passes; ++q)
      pass_pairs(base, x + q * ROWS_MAX * K, K, rows_in_pass(M, q), xp + q * pass_floats, s + q * ROWS_MAX * blocks);
#pragma omp for schedule(static)
    for (int64_t gi = 0; gi < groups; ++gi)
      for (int64_t q = 0; q < passes; ++q)
        fns[rows_in_pass(M, q)](base, w + gi * group_bytes, xp + q * pass_floats, s + q * ROWS_MAX * blocks, blocks,
                             out + q * ROWS_MAX * ldo + 16 * gi, ldo);
  }
  free(xp);
  free(s);
}
#else
int xl_tile_order_ready(void) { return 0; }

void xl_linear_tile_order(int base, const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K,
                          int64_t ldo, int threads) {
  (void)base, (void)x, (void)w, (void)out, (void)M, (void)N, (void)K, (void)ldo, (void)threads;
  abort(); /* never called: weights take this layout for it only where xl_tile_order_ready says 1 */
}
#endif
