/* Attention over the paged KV cache with one reduction order per query row, whatever the step:
 *
 *   out[t, h] = softmax(scale * q[t, h] . K[slots of t's sequence, 0 .. len(t))) V[same]
 *
 * A row's keys fall into chunks of CHUNK positions. Within a chunk they are visited in tiles of
 * KT with an online softmax (running max and sum, rescaled per tile), the tile's keys transposed
 * so that each score is one lane's dot product along D and the weights are summed as lanes, in a
 * fixed order; each chunk's partial softmax is then merged into the row's result in chunk order.
 * Nothing depends on which other rows are in the step, whether the earlier keys were computed
 * in this step or cached, how the prompt was chunked, which thread computed a chunk, or
 * whether one item folded every chunk or each chunk was an item of its own: a prompt token and
 * the same token decoded later, alone or in a batch, get the same bits.
 * (torch's fused attention splits and merges differently for each of those cases.)
 *
 * A work item is up to ROWS consecutive rows of one sequence times the query heads of a run of
 * KV heads, whose rows of a slot lie side by side in the cache: each key tile is read once, a
 * run per slot, and used by every (row, head) of the item while it is in L1. Reading it once
 * per (row, head) made a 5,000-token prefill of the default model memory-bound (2.5 MB of K/V
 * streamed per row and head), and reading one KV head's 128 bytes of each 384-byte slot (the
 * default model's three heads) cost a decode row 1.6x the contiguous read (4,000 keys, one
 * thread: 119 against 76 us a head). A step of few items (the decode of a sequence or two)
 * makes each chunk an item of its own, so every core shares a long row. Each (row, head) runs
 * the same operations in the same order either way. Both together: the default model's batch-1
 * decode after a 4,000-token prompt (Q4_1 kept, 2-core AMX Xeon, median of 3 interleaved fresh
 * processes) 79.5 -> 105 tok/s, after 1,000 tokens 156 -> 172.
 *
 * Windowed layers (sliding: Gemma 3, gpt-oss; chunked: Llama 4) give each row a first key
 * too, and a table may start at any position. Tiles and chunks are cut where positions are
 * multiples of KT and CHUNK, whatever the table's start, and a row folds the part of each tile
 * inside its window, so its partition of keys depends on its positions alone. Attention sinks
 * (gpt-oss) are a key with a logit and no value: each (row, head)'s result starts from it.
 *
 * Scores are summed in the order of an AMX tile product, per 32 values of D (tile_dots). With
 * bf16 queries and cache, D a multiple of 32 and the tiles usable, the tiles compute them
 * (attention_tiles.h: a key tile's rows read in place, no transpose); elsewhere FMAs in that
 * order over the transposed keys: every build gives a row the same bits, so a prompt computed on
 * an AMX Xeon decodes on an AMD Zen 4 as on one machine. Against the keys transposed and summed
 * in four chains before, on the AMX Xeon (9 query and 3 KV heads, bf16 cache, 2 threads, minimum
 * of 9 a layer in one process): 32 decode rows against 100 keys 0.296 -> 0.276 ms, against 200
 * keys 0.511 -> 0.433, 8 x 5 rows 0.118 -> 0.092, one row against 4,000 keys 0.346 -> 0.267, 256
 * prompt rows against 1,024 keys 4.80 -> 3.34; the AVX-512 build in the tiles' order level with
 * before (0.95-1.03x).
 *
 * fp32 or bf16 queries, cache and output (bf16 widened exactly, fp32 math, the output
 * rounded once).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"
#include "scratch.h"
#include "vec_portable.h"

#define KT 16      /* keys per tile: one rescale of the running sum per tile */
#define CHUNK 512  /* positions per chunk: one partial softmax, merged in order */
#define ROWS 16    /* rows of one sequence per work item */
#define STATES 192 /* (row, head) pairs per work item at most: their q and sums stay in L2 */
#define SPAN 256   /* values of a slot an item reads at most: its KV heads' rows side by side */

#include "attention_fold.h"

/* Rows [row, row + rows) of one sequence x query heads [head, head + heads), which read KV
 * heads [kh, kh + kvh), x chunks [c0, c1). */
typedef struct {
  int64_t row, rows, head, heads, kh, kvh, c0, c1;
} work_item;

typedef struct {
  const void *q, *k_cache, *v_cache;
  void* out;
  const int64_t *slots, *row_first, *row_len; /* row t sees table entries [row_first[t], row_len[t]) */
  const float* sinks;                          /* [Hq] or NULL */
  int64_t q_stride, Hq, group, D, slot_stride, pos0; /* pos0: the position of the table's entry 0 */
  float scale;
  int bf16, tiles; /* tiles: the scores on AMX tiles (attention_tiles.h) */
} attention_args;

/* A thread's: the item's queries, results and chunk partials ([states, D] each), and a tile; on
 * the tiles' path the queries as tiles (qt), a tile's copied keys (kb), its score tiles as stored
 * (so) and each state's scores (sc). */
typedef struct {
  float *qf, *acc, *pacc, *kt, *vt, *sc, *so;
  running_softmax *st, *pst;
  uint32_t* qt;
  uint16_t* kb;
} scratch;

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include "attention_tiles.h"
#else /* no tiles: the FMA path alone */
#define amx_permitted() 0
#define configure_score_tiles() ((void)0)
#define make_query_tiles(a, w, qt) ((void)0)
#define tile_scores(a, w, j0, n, qt, kb, so, sc) ((void)0)
#define _tile_release() ((void)0)
#endif

/* Keys and values [j0, j0 + n) of the item's KV heads, read from the cache once per tile, one
 * run a slot (bf16 widened exactly): the keys transposed into kt (value d of every key of the
 * tile in row d, a key a lane; lanes past n zero), VW keys at a time in registers; the values
 * as rows of vt, kvh * D values a key. */
#if VW == KT
/* Keys' values [d, d + 2 VW) from a bf16 cache into kt rows d.. d + 2 VW - 1: the tile's keys as
 * rows of VW value pairs, transposed a pair (32 bits) a lane, then each pair's two values
 * widened into their rows (a shift, a mask): half the shuffles of widening first and
 * transposing each VW values, the same floats. The gather of a decode row's tiles (a key tile
 * read for one row's heads) took 12% of the default model's 32-sequence decode (AMX Xeon,
 * perf); the kernel alone (9 query and 3 KV heads, bf16 cache, 2 threads, minimum of 7 in one
 * process), 32 decode rows against 100 keys 0.148 -> 0.130 ms a layer, against 480 keys 0.868
 * -> 0.807, one row against 4,000 keys 0.210 -> 0.188, 512 prompt rows against 1,024 keys
 * 7.39 -> 6.91. */
static void transpose_bf16_pairs(const uint16_t* cache, const int64_t* at, int n, int64_t d, float* kt) {
  vf r[VW];
  for (int i = 0; i < VW; ++i) r[i] = i < n ? vload((const float*)(cache + at[i] + d)) : vzero();
  vtranspose(r); /* r[p], lane i: key i's values d + 2p (low half) and d + 2p + 1 */
  for (int p = 0; p < VW; ++p) {
    vstore(kt + (d + 2 * p) * KT, vbf16_low(r[p]));
    vstore(kt + (d + 2 * p + 1) * KT, vbf16_high(r[p]));
  }
}
#endif

static void gather_tile(const attention_args* a, const work_item* w, int64_t j0, int n, float* kt, float* vt) {
  const int64_t span = w->kvh * a->D;
  int64_t at[KT];
  for (int i = 0; i < n; ++i) at[i] = a->slots[j0 + i] * a->slot_stride + w->kh * a->D;
  int64_t d = a->tiles ? span : 0; /* the tiles read the keys in place */
#if VW == KT
  if (a->bf16)
    for (; d + 2 * VW <= span; d += 2 * VW) transpose_bf16_pairs((const uint16_t*)a->k_cache, at, n, d, kt);
#endif
  for (; d < span; d += VW)
    for (int g = 0; g < KT; g += VW) {
      vf r[VW];
      for (int i = 0; i < VW; ++i) r[i] = g + i < n ? load_lanes(a->k_cache, at[g + i] + d, a->bf16) : vzero();
      vtranspose(r);
      for (int e = 0; e < VW; ++e) vstore(kt + (d + e) * KT + g, r[e]);
    }
  for (int i = 0; i < n; ++i)
    for (int64_t e = 0; e < span; e += VW) vstore(vt + i * span + e, load_lanes(a->v_cache, at[i] + e, a->bf16));
}

/* The table entries [lo, hi) that rows [row, row + rows) see, cut to chunk c's (c < 0: all). */
static void entries_in(const attention_args* a, int64_t row, int64_t rows, int64_t c, int64_t* lo, int64_t* hi) {
  *lo = INT64_MAX, *hi = 0;
  for (int64_t r = row; r < row + rows; ++r) {
    const int64_t first = a->row_first ? a->row_first[r] : 0, len = a->row_len[r];
    *lo = first < *lo ? first : *lo;
    *hi = len > *hi ? len : *hi;
  }
  if (c < 0) return;
  const int64_t c_lo = c * CHUNK - a->pos0, c_hi = c_lo + CHUNK;
  *lo = *lo > c_lo ? *lo : c_lo;
  *hi = *hi < c_hi ? *hi : c_hi;
}

/* The chunks [c0, c1) that keys of rows [row, row + rows) fall in (c1 == c0: none). */
static void chunks_of(const attention_args* a, int64_t row, int64_t rows, int64_t* c0, int64_t* c1) {
  int64_t lo, hi;
  entries_in(a, row, rows, -1, &lo, &hi);
  *c0 = (a->pos0 + lo) / CHUNK;
  *c1 = hi > lo ? (a->pos0 + hi - 1) / CHUNK + 1 : *c0;
}

/* Chunk c folded, tile by tile, into the item's partials (emptied first). */
static void fold_chunk(const attention_args* a, const work_item* w, int64_t c, scratch* s) {
  const int64_t D = a->D, span = w->kvh * D;
  for (int64_t k = 0; k < w->rows * w->heads; ++k) {
    s->pst[k] = EMPTY;
    memset(s->pacc + k * D, 0, sizeof(float) * D);
  }
  int64_t start, end;
  entries_in(a, w->row, w->rows, c, &start, &end);
  /* tiles [j0, j1) end where the position is a multiple of KT */
  for (int64_t j0 = start, j1; j0 < end; j0 = j1) {
    j1 = j0 + KT - (a->pos0 + j0) % KT;
    j1 = j1 < end ? j1 : end;
    gather_tile(a, w, j0, (int)(j1 - j0), s->kt, s->vt);
    if (a->tiles) tile_scores(a, w, j0, (int)(j1 - j0), s->qt, s->kb, s->so, s->sc);
    for (int64_t r = 0; r < w->rows; ++r) {
      const int64_t first = a->row_first ? a->row_first[w->row + r] : 0, len = a->row_len[w->row + r];
      const int64_t lo = first > j0 ? first : j0, hi = len < j1 ? len : j1;
      if (hi <= lo) continue;
      for (int64_t h = 0, g; h < w->heads; h += g) { /* the pairs of one KV head, up to FOLD_GROUP together */
        const int64_t left = a->group - h % a->group, k = r * w->heads + h, head = h / a->group * D;
        g = left < FOLD_GROUP ? left : FOLD_GROUP;
        FOLDS[g](s->qf + k * D, s->kt + head * KT, a->tiles ? s->sc + k * KT : NULL, s->vt + (lo - j0) * span + head,
                 span, (int)(lo - j0), (int)(hi - lo), D, a->scale, s->pst + k, s->pacc + k * D);
      }
    }
  }
}

/* A (row, head)'s result before any chunk: empty, or the sink (a key of that logit, no value). */
static running_softmax start_of(const attention_args* a, int64_t head) {
  return a->sinks ? (running_softmax){a->sinks[head], 1.0f} : EMPTY;
}

/* The item's results started (start_of, zero values). */
static void start_results(const attention_args* a, const work_item* w, scratch* s) {
  for (int64_t k = 0; k < w->rows * w->heads; ++k) {
    s->st[k] = start_of(a, w->head + k % w->heads);
    memset(s->acc + k * a->D, 0, sizeof(float) * a->D);
  }
}

/* acc / l of each (row, head) of the item, rounded once, into out. */
static void write_out(const attention_args* a, const work_item* w, const scratch* s) {
  const int64_t D = a->D;
  for (int64_t r = 0; r < w->rows; ++r)
    for (int64_t h = 0; h < w->heads; ++h) {
      const int64_t k = r * w->heads + h, o = ((w->row + r) * a->Hq + w->head + h) * D;
      const float inv = 1.0f / s->st[k].l;
      for (int64_t d = 0; d < D; ++d) {
        const float v = s->acc[k * D + d] * inv;
        if (a->bf16) ((uint16_t*)a->out)[o + d] = f32_to_bf16(v);
        else ((float*)a->out)[o + d] = v;
      }
    }
}

/* One work item: its queries loaded, then each of its chunks folded into partials. Without
 * ``part`` the partials are merged into the results in chunk order and written out; with it (an
 * item of one chunk) they are stored there ((m, l) per state, then [states, D]) for merge_parts. */
static void attend_item(const attention_args* a, const work_item* w, scratch* s, float* part) {
  const int64_t D = a->D, states = w->rows * w->heads;
  if (a->tiles)
    make_query_tiles(a, w, s->qt);
  else
    for (int64_t k = 0; k < states; ++k) {
      const int64_t at = (w->row + k / w->heads) * a->q_stride + (w->head + k % w->heads) * D;
      for (int64_t d = 0; d < D; d += VW) vstore(s->qf + k * D + d, load_lanes(a->q, at + d, a->bf16));
    }
  if (part) { /* one chunk (none: an empty partial) */
    if (w->c1 > w->c0) fold_chunk(a, w, w->c0, s);
    for (int64_t k = 0; k < states; ++k) ((running_softmax*)part)[k] = w->c1 > w->c0 ? s->pst[k] : EMPTY;
    memcpy(part + 2 * states, s->pacc, sizeof(float) * states * D);
    return;
  }
  start_results(a, w, s);
  for (int64_t c = w->c0; c < w->c1; ++c) {
    fold_chunk(a, w, c, s);
    for (int64_t k = 0; k < states; ++k) merge(s->st + k, s->acc + k * D, s->pst + k, s->pacc + k * D, D);
  }
  write_out(a, w, s);
}

/* The ``count`` partials attend_item stored for an item's chunks (``size`` floats apart), merged
 * in chunk order into its results, as attend_item merges them, and written out. */
static void merge_parts(const attention_args* a, const work_item* w, const float* parts, int64_t count, int64_t size,
                        scratch* s) {
  const int64_t D = a->D, states = w->rows * w->heads;
  start_results(a, w, s);
  for (int64_t c = 0; c < count; ++c) {
    const running_softmax* pst = (const running_softmax*)(parts + c * size);
    const float* pacc = parts + c * size + 2 * states;
    for (int64_t k = 0; k < states; ++k) merge(s->st + k, s->acc + k * D, pst + k, pacc + k * D, D);
  }
  write_out(a, w, s);
}

/* Row blocks: runs of up to ``rows_per_item`` consecutive rows with one table. Returns how many;
 * starts[i] is block i's first row, starts[count] == T. */
static int64_t row_blocks(const int64_t* row_seq, int64_t T, int64_t rows_per_item, int64_t* starts) {
  int64_t count = 0;
  for (int64_t t = 0; t < T; ++t)
    if (t == 0 || row_seq[t] != row_seq[t - 1] || t - starts[count - 1] == rows_per_item) starts[count++] = t;
  starts[count] = T;
  return count;
}

/* This thread's scratch for items of up to ``states`` (row, head) pairs of ``kvh`` KV heads (kept
 * for its next call). */
static scratch scratch_for(int64_t states, int64_t D, int64_t kvh) {
  const int64_t span = kvh * D, query_tiles = states / kvh / 16 + 1; /* a KV head's, at most */
  const size_t qt = sizeof(uint32_t) * 256 * kvh * query_tiles * (D / 32), kb = 2 * KT * span;
  const size_t so = sizeof(float) * 256 * kvh * query_tiles;
  char* tiles = (char*)xl_kept(7, qt + kb + so + sizeof(float) * states * KT);
  scratch s;
  s.qt = (uint32_t*)tiles, s.kb = (uint16_t*)(tiles + qt), s.so = (float*)(tiles + qt + kb);
  s.sc = (float*)(tiles + qt + kb + so);
  s.qf = (float*)xl_kept(0, sizeof(float) * states * D);
  s.acc = (float*)xl_kept(1, sizeof(float) * states * D);
  s.pacc = (float*)xl_kept(2, sizeof(float) * states * D);
  s.kt = (float*)xl_kept(3, sizeof(float) * KT * span);
  s.vt = (float*)xl_kept(4, sizeof(float) * KT * span);
  s.st = (running_softmax*)xl_kept(5, sizeof(running_softmax) * states);
  s.pst = (running_softmax*)xl_kept(6, sizeof(running_softmax) * states);
  return s;
}

/* The layout of a call's work: KV heads read side by side, row blocks, and per block its
 * items: one, or (``split``) one per chunk, first_item[b] .. first_item[b + 1]. */
typedef struct {
  int64_t kvh, runs, heads, blocks, states, items, *starts, *first_item;
  int split;
} plan;

static plan plan_for(const attention_args* base, const int64_t* table_pos0, const int64_t* row_seq, int64_t T,
                     int64_t Hk, int threads) {
  plan p;
  p.kvh = base->D >= SPAN ? 1 : SPAN / base->D;
  p.kvh = p.kvh > Hk ? Hk : p.kvh;
  while (Hk % p.kvh) --p.kvh;
  p.runs = Hk / p.kvh, p.heads = p.kvh * base->group;
  int64_t rows_per_item = STATES / p.heads < 1 ? 1 : STATES / p.heads, rows = 1;
  rows_per_item = rows_per_item > ROWS ? ROWS : rows_per_item;
  p.starts = (int64_t*)malloc(sizeof(int64_t) * (T + 1));
  p.blocks = row_blocks(row_seq, T, rows_per_item, p.starts);
  for (int64_t b = 0; b < p.blocks; ++b) rows = p.starts[b + 1] - p.starts[b] > rows ? p.starts[b + 1] - p.starts[b] : rows;
  p.states = rows * p.heads; /* (row, head) pairs of the largest item: a decode step's are one row's */
  p.split = p.blocks * p.runs < 4 * threads; /* too few items for the threads: a chunk each */
  p.first_item = (int64_t*)malloc(sizeof(int64_t) * (p.blocks + 1));
  p.first_item[0] = 0;
  for (int64_t b = 0; b < p.blocks; ++b) {
    attention_args a = *base;
    a.pos0 = table_pos0 ? table_pos0[row_seq[p.starts[b]]] : 0;
    int64_t c0, c1;
    chunks_of(&a, p.starts[b], p.starts[b + 1] - p.starts[b], &c0, &c1);
    p.first_item[b + 1] = p.first_item[b] + (p.split && c1 - c0 > 1 ? c1 - c0 : 1);
  }
  p.items = p.first_item[p.blocks];
  return p;
}

/* Item ``i`` of run ``run``: its arguments and its rows, heads and chunks. */
static void item_of(const plan* p, const attention_args* base, const int64_t* table, int64_t L,
                    const int64_t* table_pos0, const int64_t* row_seq, int64_t i, attention_args* a, work_item* w) {
  const int64_t run = i / p->items, at = i % p->items;
  int64_t b = 0;
  while (p->first_item[b + 1] <= at) ++b;
  const int64_t seq = row_seq[p->starts[b]];
  *a = *base;
  a->slots = table + seq * L;
  a->pos0 = table_pos0 ? table_pos0[seq] : 0;
  *w = (work_item){p->starts[b], p->starts[b + 1] - p->starts[b], run * p->heads, p->heads, run * p->kvh, p->kvh, 0, 0};
  chunks_of(a, w->row, w->rows, &w->c0, &w->c1);
  if (p->first_item[b + 1] - p->first_item[b] > 1) { /* one chunk of a split block */
    w->c0 += at - p->first_item[b];
    w->c1 = w->c0 + 1;
  }
}

/* q: [T, Hq, D] with row stride q_stride (elements); caches: [slots, Hk, D]; table: [S, L]
 * slot tables, table_pos0[s] the position of table s's entry 0 (NULL: 0); row_seq[t] its
 * table, row t attends to entries [row_first[t], row_len[t]) of it (row_first NULL: from 0;
 * its own key included); sinks [Hq] or NULL; out: [T, Hq, D] contiguous. D a multiple of 16,
 * Hq a multiple of Hk. */
void xl_paged_attention_windowed(const void* q, int64_t q_stride, int64_t T, int64_t Hq, int64_t Hk, int64_t D,
                                 const void* k_cache, const void* v_cache, const int64_t* table, int64_t L,
                                 const int64_t* table_pos0, const int64_t* row_seq, const int64_t* row_first,
                                 const int64_t* row_len, const float* sinks, float scale, void* out, int bf16,
                                 int threads) {
  /* decided once for the call, and the same way in every call of a process and model */
  const int tiles = bf16 && D % 32 == 0 && amx_permitted();
  const attention_args base = {q, k_cache, v_cache, out, NULL, row_first, row_len, sinks, q_stride, Hq, Hq / Hk, D,
                               Hk * D, 0, scale, bf16, tiles};
  plan p = plan_for(&base, table_pos0, row_seq, T, Hk, threads);
  const int64_t states = p.states, size = 2 * states + states * D; /* a stored partial's floats */
  float* parts = p.split ? (float*)malloc(sizeof(float) * p.items * p.runs * size) : NULL;
  /* one item (a decode row of under CHUNK keys): no team to wake for it */
#pragma omp parallel num_threads(threads) if (p.items * p.runs > 1)
  {
    scratch s = scratch_for(states, D, p.kvh);
    if (tiles) configure_score_tiles();
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t i = 0; i < p.items * p.runs; ++i) {
      attention_args a;
      work_item w;
      item_of(&p, &base, table, L, table_pos0, row_seq, i, &a, &w);
      attend_item(&a, &w, &s, p.split ? parts + i * size : NULL);
    }
    if (tiles) _tile_release();
#pragma omp barrier
    if (p.split) { /* each block's partials merged in chunk order */
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < p.blocks * p.runs; ++i) {
        const int64_t b = i % p.blocks, run = i / p.blocks;
        attention_args a;
        work_item w;
        item_of(&p, &base, table, L, table_pos0, row_seq, run * p.items + p.first_item[b], &a, &w);
        merge_parts(&a, &w, parts + (run * p.items + p.first_item[b]) * size, p.first_item[b + 1] - p.first_item[b],
                    size, &s);
      }
    }
  }
  free(parts);
  free(p.first_item);
  free(p.starts);
}

/* Every row from its table's entry 0, no sinks (full attention; the one-call decode step). */
void xl_paged_attention(const void* q, int64_t q_stride, int64_t T, int64_t Hq, int64_t Hk, int64_t D,
                        const void* k_cache, const void* v_cache, const int64_t* table, int64_t L,
                        const int64_t* row_seq, const int64_t* row_len, float scale, void* out, int bf16,
                        int threads) {
  xl_paged_attention_windowed(q, q_stride, T, Hq, Hk, D, k_cache, v_cache, table, L, NULL, row_seq, NULL, row_len,
                              NULL, scale, out, bf16, threads);
}
