/* The scores of a key tile on AMX tiles, for attention_paged.c: bf16 queries and cache, D a
 * multiple of 32. Included where the compiler targets AMX; attention_paged.c takes this path for
 * a whole call (``a->tiles``) or not at all, so every row of a process gets its scores one way.
 *
 * A key tile's K rows are the A operand as they lie in the cache (16 keys of one block, one
 * 64-byte tile row a key and 32 values), the item's queries the B operand (made once per item:
 * 16 queries a tile, a value pair a lane), so nothing is transposed per key tile: the FMA path
 * transposes every key of every tile into lanes, and that gather was ~18% of the C part of the
 * default model's 32-sequence decode step (perf). Each score is one tile product's element: its
 * sum runs over D in the same order whatever the key's row in the tile, the query's column, or
 * the tile's other rows and columns, so a row's scores keep their bits alone, batched or chunked,
 * as the FMA path's do.
 *
 * Queries of an item: for each of its KV heads h, queries n = r * group + g (row r, query head g
 * of that KV head) are tile t = n / 16's column n % 16; their states k = r * heads + h * group + g.
 */
#pragma once
#include "amx_tiles.h"

#define TILE_K 0 /* 16 keys x 32 values */
#define TILE_Q 1 /* 16 value pairs x 16 queries */
#define TILE_S 2 /* 16 keys x 16 queries, fp32 */

static inline void configure_score_tiles(void) {
  const uint8_t rows[3] = {16, 16, 16};
  load_tiles(3, rows);
}

/* Query tiles of the KV heads' queries in an item: [kvh][tiles][D / 32] tiles of 16 x 16 value
 * pairs (columns past the item's queries zero). */
static void make_query_tiles(const attention_args* a, const work_item* w, uint32_t* qt) {
  const int64_t D = a->D, dc = D / 32, per_head = w->rows * a->group, tiles = (per_head + 15) / 16;
  memset(qt, 0, sizeof(uint32_t) * 256 * w->kvh * tiles * dc);
  for (int64_t h = 0; h < w->kvh; ++h)
    for (int64_t n = 0; n < per_head; ++n) {
      const int64_t r = n / a->group, head = w->head + h * a->group + n % a->group;
      const uint16_t* values = (const uint16_t*)a->q + (w->row + r) * a->q_stride + head * D;
      uint32_t* tile = qt + (h * tiles + n / 16) * dc * 256 + n % 16;
      for (int64_t p = 0; p < D / 2; ++p) memcpy(tile + (p / 16) * 256 + (p % 16) * 16, values + 2 * p, 4);
    }
}

/* Where a tile's K rows are read from: in place when its n == 16 keys are 16 consecutive slots
 * (a tile of an aligned block), else copied into ``kb`` (16 rows of the item's span, rows past n
 * zero). Returns the rows of the item's first KV head; *stride is their distance in bytes. */
static const uint16_t* key_rows(const attention_args* a, const work_item* w, int64_t j0, int n, uint16_t* kb,
                                int64_t* stride) {
  const uint16_t* cache = (const uint16_t*)a->k_cache;
  const int64_t span = w->kvh * a->D, first = a->slots[j0];
  int consecutive = n == KT;
  for (int i = 1; i < n && consecutive; ++i) consecutive = a->slots[j0 + i] == first + i;
  if (consecutive) {
    *stride = a->slot_stride * 2;
    return cache + first * a->slot_stride + w->kh * a->D;
  }
  for (int i = 0; i < KT; ++i) {
    if (i < n) memcpy(kb + i * span, cache + a->slots[j0 + i] * a->slot_stride + w->kh * a->D, span * 2);
    else memset(kb + i * span, 0, span * 2);
  }
  *stride = span * 2;
  return kb;
}

/* The state of KV head h's query n (row n / group, query head n % group of that KV head). */
static inline int64_t query_state(int64_t n, int64_t h, int64_t group, int64_t heads) {
  return n / group * heads + h * group + n % group;
}

/* The columns [0, cols) of a stored score tile s (16 keys x 16 queries: queries n0 .. n0 + cols - 1
 * of KV head h) as their states' rows of sc, scaled: a decode row's few columns gathered, more
 * (a prompt's) by a 16 x 16 transpose. */
static inline void scatter_columns(const float* s, int64_t cols, int64_t n0, int64_t h, int64_t group, int64_t heads,
                                   float scale, float* sc) {
  const vf by = vset1(scale);
  if (cols <= 4) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    for (int64_t c = 0; c < cols; ++c)
      vstore(sc + query_state(n0 + c, h, group, heads) * KT, vmul(_mm512_i32gather_ps(rows, s + c, 4), by));
    return;
  }
  vf r[16];
  for (int i = 0; i < 16; ++i) r[i] = vload(s + 16 * i);
  vtranspose(r);
  for (int64_t c = 0; c < cols; ++c) vstore(sc + query_state(n0 + c, h, group, heads) * KT, vmul(r[c], by));
}

/* Scores of keys [j0, j0 + n) for every state of the item: sc[k * KT + i] = scale * q_k . K[j0 + i]
 * (lanes past n: the copied zero rows' 0, which the folds never read). Each KV head's
 * query tiles in turn: one score tile, D / 32 products into it (``C + (first + second)`` each). */
static void tile_scores(const attention_args* a, const work_item* w, int64_t j0, int n, const uint32_t* qt,
                        uint16_t* kb, float* tiles_out, float* sc) {
  const int64_t D = a->D, dc = D / 32, per_head = w->rows * a->group, tiles = (per_head + 15) / 16;
  int64_t stride;
  const uint16_t* keys = key_rows(a, w, j0, n, kb, &stride);
  for (int64_t h = 0; h < w->kvh; ++h)
    for (int64_t t = 0; t < tiles; ++t) {
      _tile_zero(TILE_S);
      for (int64_t c = 0; c < dc; ++c) {
        _tile_loadd(TILE_K, keys + h * D + 32 * c, stride);
        _tile_loadd(TILE_Q, qt + ((h * tiles + t) * dc + c) * 256, 64);
        _tile_dpbf16ps(TILE_S, TILE_K, TILE_Q);
      }
      _tile_stored(TILE_S, tiles_out + (h * tiles + t) * 256, 64);
    }
  /* read back once every tile is stored: a vector load right after the tile store of its line
   * waits for that store */
  for (int64_t h = 0; h < w->kvh; ++h)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t cols = per_head - 16 * t < 16 ? per_head - 16 * t : 16;
      scatter_columns(tiles_out + (h * tiles + t) * 256, cols, 16 * t, h, a->group, w->heads, a->scale, sc);
    }
}
