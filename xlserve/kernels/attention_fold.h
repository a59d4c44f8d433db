/* The arithmetic of attention_paged.c on one key tile: the scores (TILE_DOTS, in the AMX tile
 * product's order), the running softmax (softmax_weights), the folds of a tile's weighted values
 * into (row, head) pairs' partials (FOLD_TILES) and the merge of chunk partials. Included by
 * attention_paged.c after KT and vec_portable.h. */
#pragma once

/* The running softmax of one (row, head): max, sum, and the weighted values in acc [D]. */
typedef struct {
  float m, l;
} running_softmax;

static const running_softmax EMPTY = {-INFINITY, 0.0f};

/* Runs R (1 or 2) of P value pairs from d0, their chains a[g][2 r + parity], added to sum in order
 * (constant R and P: the loops unroll, no bound checks). */
#define DOT_RUNS(G, R, P)                                                                                      \
  {                                                                                                            \
    vf a[G][2 * R][KT / VW];                                                                                   \
    for (int g = 0; g < G; ++g)                                                                                \
      for (int c = 0; c < 2 * R; ++c)                                                                          \
        for (int j = 0; j < KT / VW; ++j) a[g][c][j] = vzero();                                                \
    for (int p = 0; p < P; ++p)                                                                                \
      for (int j = 0; j < KT / VW; ++j)                                                                        \
        for (int c = 0; c < 2 * R; ++c) {                                                                      \
          const int64_t d = d0 + 32 * (c / 2) + 2 * p + c % 2;                                                 \
          const vf k = vload(kt + d * KT + j * VW);                                                            \
          for (int g = 0; g < G; ++g) a[g][c][j] = vfma(vset1(qf[g * D + d]), k, a[g][c][j]);                 \
        }                                                                                                      \
    for (int g = 0; g < G; ++g)                                                                                \
      for (int j = 0; j < KT / VW; ++j)                                                                        \
        for (int r = 0; r < R; ++r) sum[g][j] = vadd(sum[g][j], vadd(a[g][2 * r][j], a[g][2 * r + 1][j]));  \
  }

/* The scores s[g][lane] of G (row, head) pairs that read one KV head against a gathered tile
 * whose keys are transposed (kt: the KV head's D rows of KT lanes, a key a lane), in the order
 * of an AMX tile product (attention_tiles.h), so that a CPU without the tiles gets their bits:
 * per 32 values of D, the products of the even values summed in order, rounding each step (one
 * FMA each: a product of widened bf16 values is exact), the odd ones apart, the two added, and
 * each 32 values' sum added to the score in order (``C + (first + second)``, measured for
 * tdpbf16ps bit for bit: docs/quantization.md). A last 16 values (D % 32 == 16, which the tiles
 * do not take) are summed the same way. Two of those runs at a time: four chains a pair. Each
 * pair's operations and their order do not depend on G: the pairs only share the loads of the
 * keys and interleave their chains. */
#define TILE_DOTS(G)                                                                                           \
  static inline void tile_dots_##G(const float* qf, const float* kt, int64_t D, float scale, float s[G][KT]) { \
    vf sum[G][KT / VW];                                                                                        \
    for (int g = 0; g < G; ++g)                                                                                \
      for (int j = 0; j < KT / VW; ++j) sum[g][j] = vzero();                                                   \
    int64_t d0 = 0;                                                                                            \
    for (; d0 + 64 <= D; d0 += 64) DOT_RUNS(G, 2, 16)                                                          \
    if (D - d0 >= 32) {                                                                                        \
      DOT_RUNS(G, 1, 16)                                                                                       \
      d0 += 32;                                                                                                \
    }                                                                                                          \
    if (D - d0 == 16) DOT_RUNS(G, 1, 8)                                                                        \
    for (int g = 0; g < G; ++g)                                                                                \
      for (int j = 0; j < KT / VW; ++j) vstore(s[g] + j * VW, vmul(sum[g][j], vset1(scale)));                  \
  }

/* G (row, head) pairs that read one KV head, folded together over a tile: each into its running
 * softmax. Their scores are ``given`` (G rows of KT, from attention_tiles.h) or taken from the
 * transposed keys kt (tile_dots); the rows' keys are lanes [first, first + n) (the others are
 * another row's or past the tile's end), their values rows of vt (``ks`` apart, from lane
 * ``first``'s). The tile's weights are summed as lanes. The states are G consecutive ones: qf, st
 * and acc (D floats each) of heads h .. h + G - 1. */
#define FOLD_TILES(G)                                                                                          \
  static void fold_tile_##G(const float* qf, const float* kt, const float* given, const float* vt, int64_t ks,  \
                            int first, int n, int64_t D, float scale, running_softmax* st, float* acc) {       \
    float s[G][KT], p[G][KT], rescale[G];                                                                      \
    if (given) /* the tiles' scores (attention_tiles.h) */                                                    \
      memcpy(s, given, sizeof s);                                                                              \
    else                                                                                                       \
      tile_dots_##G(qf, kt, D, scale, s);                                                                      \
    for (int g = 0; g < G; ++g) rescale[g] = softmax_weights(s[g], p[g], first, n, st + g);                    \
    int64_t d = 0;                                                                                             \
    for (; d + 4 * VW <= D; d += 4 * VW) { /* four vectors of each output side by side, each in key order */  \
      vf b[G][4];                                                                                              \
      for (int g = 0; g < G; ++g)                                                                              \
        for (int c = 0; c < 4; ++c) b[g][c] = vmul(vload(acc + g * D + d + c * VW), vset1(rescale[g]));      \
      for (int i = 0; i < n; ++i)                                                                              \
        for (int c = 0; c < 4; ++c) {                                                                          \
          const vf v = vload(vt + i * ks + d + c * VW);                                                        \
          for (int g = 0; g < G; ++g) b[g][c] = vfma(vset1(p[g][first + i]), v, b[g][c]);                     \
        }                                                                                                      \
      for (int g = 0; g < G; ++g)                                                                              \
        for (int c = 0; c < 4; ++c) vstore(acc + g * D + d + c * VW, b[g][c]);                                \
    }                                                                                                          \
    for (; d < D; d += VW)                                                                                     \
      for (int g = 0; g < G; ++g) {                                                                            \
        vf b = vmul(vload(acc + g * D + d), vset1(rescale[g]));                                               \
        for (int i = 0; i < n; ++i) b = vfma(vset1(p[g][first + i]), vload(vt + i * ks + d), b);             \
        vstore(acc + g * D + d, b);                                                                            \
      }                                                                                                        \
  }

/* A pair's scores s (lanes [first, first + n) its keys) -> its weights p against the new running
 * max, which ``st`` takes with the weights' sum; returns the factor its earlier values take. */
static inline __attribute__((always_inline)) float softmax_weights(float* s, float* p, int first, int n,
                                                                    running_softmax* st) {
  const int partial = first > 0 || n < KT;
  if (partial)
    for (int i = 0; i < KT; ++i)
      if (i < first || i >= first + n) s[i] = -INFINITY;
  vf top = vload(s);
  for (int j = VW; j < KT; j += VW) top = vmax(top, vload(s + j));
  const float tile_max = vmax_lanes(top);
  /* a max the tile does not raise (most tiles of a long row) rescales by exp(0) = 1 */
  const float m_new = tile_max > st->m ? tile_max : st->m, rescale = m_new == st->m ? 1.0f : expf(st->m - m_new);
  for (int i = 0; i < KT; i += VW) vstore(p + i, vexp(vsub(vload(s + i), vset1(m_new))));
  if (partial) /* vexp floors its argument: an outside lane would weigh exp(-87), not 0 */
    for (int i = 0; i < KT; ++i)
      if (i < first || i >= first + n) p[i] = 0.0f;
  /* A row's keys may sit at other lanes in another item (a tile starts at the item's first key):
   * the same keys shifted, the other lanes 0, which is a rotation of the KT lanes. The sum is
   * halving pairs (lane i with i + KT/2, then i + KT/4, ...), whose pairs a rotation maps onto
   * pairs (a + b or b + a, the same bits): the same sum wherever the keys sit (tested with
   * sliding windows, alone against batched). */
  vf weights = vload(p);
  for (int j = VW; j < KT; j += VW) weights = vadd(weights, vload(p + j));
  st->l = st->l * rescale + vsum(weights);
  st->m = m_new;
  return rescale;
}

#define FOLD_GROUP 4 /* pairs folded together at most */
TILE_DOTS(1) TILE_DOTS(2) TILE_DOTS(3) TILE_DOTS(4)
FOLD_TILES(1) FOLD_TILES(2) FOLD_TILES(3) FOLD_TILES(4)
typedef void (*fold_fn)(const float*, const float*, const float*, const float*, int64_t, int, int, int64_t, float,
                        running_softmax*, float*);
static const fold_fn FOLDS[FOLD_GROUP + 1] = {0, fold_tile_1, fold_tile_2, fold_tile_3, fold_tile_4};

/* A chunk's partial (``part``, ``pacc``) merged into a (row, head)'s result, both rescaled to
 * the larger max. An empty partial (no key of the row in the chunk) changes nothing; into an
 * empty result it is copied exactly (scales 0 and 1). */
static void merge(running_softmax* st, float* acc, const running_softmax* part, const float* pacc, int64_t D) {
  if (part->l == 0.0f) return;
  const float m = part->m > st->m ? part->m : st->m, a = expf(st->m - m), b = expf(part->m - m);
  st->l = st->l * a + part->l * b;
  for (int64_t d = 0; d < D; d += VW) vstore(acc + d, vfma(vload(pacc + d), vset1(b), vmul(vload(acc + d), vset1(a))));
  st->m = m;
}
