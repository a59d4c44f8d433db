/* Attention over the paged KV cache with one reduction order per query row, whatever the step:
 *
 *   out[t, h] = softmax(scale * q[t, h] . K[slots of t's sequence, 0 .. len(t))) V[same]
 *
 * A row's keys are visited in tiles of KT from position 0, with an online softmax (running
 * max and sum, rescaled per tile), each score a VW-lane dot product summed in a fixed order.
 * Nothing depends on which other rows are in the step, whether the earlier keys were
 * computed in this step or cached, how the prompt was chunked, or which thread runs it: a
 * prompt token and the same token decoded later, alone or in a batch, get the same bits.
 * (torch's fused attention splits and merges differently for each of those cases.)
 *
 * A work item is up to ROWS consecutive rows of one sequence times the query heads of one KV
 * head: each key tile is read from memory once and used by all of them while it is in L1.
 * Reading it once per (row, head) made a 5,000-token prefill of the default model memory-bound
 * (2.5 MB of K/V streamed per row and head). Each (row, head) still runs exactly the ops of
 * one tile after another, so the grouping changes no bit.
 *
 * Windowed layers (sliding: Gemma 3, gpt-oss; chunked: Llama 4) give each row a first key
 * too, and a table may start at any position. Tiles are cut where positions are multiples of
 * KT, whatever the table's start, and a row folds the part of each tile inside its window, so
 * its partition of keys into tiles depends on its positions alone. Attention sinks (gpt-oss)
 * are a key with a logit and no value: each (row, head)'s softmax starts from it.
 *
 * fp32 or bf16 queries, cache and output (bf16 widened exactly, fp32 math, the output
 * rounded once).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "bf16.h"
#include "vec_portable.h"

#define KT 16    /* keys per tile: one rescale of the running sum per tile */
#define ROWS 16  /* rows of one sequence per work item */
#define STATES 64 /* (row, head) pairs per work item at most: their q and sums stay in L2 */


/* The running softmax of one (row, head): max, sum, and the weighted values in acc [D]. */
typedef struct {
  float m, l;
} running_softmax;

/* The first n keys of a gathered tile (kt, vt: [KT, D] fp32) folded into one (row, head)'s
 * running softmax. */
static void fold_tile(const float* qf, const float* kt, const float* vt, int n, int64_t D, float scale,
                      running_softmax* st, float* acc) {
  float s[KT], p[KT], tile_max = -INFINITY;
  int i = 0;
  for (; i + 4 <= n; i += 4) {  /* four keys' dot products side by side: independent FMA chains */
    const float *k0 = kt + i * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
    vf d0 = vzero(), d1 = vzero(), d2 = vzero(), d3 = vzero();
    for (int64_t d = 0; d < D; d += VW) {
      const vf qv = vload(qf + d);
      d0 = vfma(qv, vload(k0 + d), d0);
      d1 = vfma(qv, vload(k1 + d), d1);
      d2 = vfma(qv, vload(k2 + d), d2);
      d3 = vfma(qv, vload(k3 + d), d3);
    }
    s[i] = vsum(d0) * scale, s[i + 1] = vsum(d1) * scale, s[i + 2] = vsum(d2) * scale, s[i + 3] = vsum(d3) * scale;
  }
  for (; i < n; ++i) {
    vf dot = vzero();
    for (int64_t d = 0; d < D; d += VW) dot = vfma(vload(qf + d), vload(kt + i * D + d), dot);
    s[i] = vsum(dot) * scale;
  }
  for (i = 0; i < n; ++i) tile_max = s[i] > tile_max ? s[i] : tile_max;
  for (i = n; i < KT; ++i) s[i] = -INFINITY;
  const float m_new = tile_max > st->m ? tile_max : st->m, rescale = expf(st->m - m_new);
  for (i = 0; i < KT; i += VW) vstore(p + i, vexp(vsub(vload(s + i), vset1(m_new))));
  float tile_sum = 0.0f;
  for (i = 0; i < n; ++i) tile_sum += p[i];
  st->l = st->l * rescale + tile_sum;
  const vf r = vset1(rescale);
  int64_t d = 0;
  for (; d + 4 * VW <= D; d += 4 * VW) {  /* four vectors of the output side by side, each in key order */
    vf a0 = vmul(vload(acc + d), r), a1 = vmul(vload(acc + d + VW), r);
    vf a2 = vmul(vload(acc + d + 2 * VW), r), a3 = vmul(vload(acc + d + 3 * VW), r);
    for (i = 0; i < n; ++i) {
      const float* v = vt + i * D + d;
      const vf w = vset1(p[i]);
      a0 = vfma(w, vload(v), a0);
      a1 = vfma(w, vload(v + VW), a1);
      a2 = vfma(w, vload(v + 2 * VW), a2);
      a3 = vfma(w, vload(v + 3 * VW), a3);
    }
    vstore(acc + d, a0), vstore(acc + d + VW, a1), vstore(acc + d + 2 * VW, a2), vstore(acc + d + 3 * VW, a3);
  }
  for (; d < D; d += VW) {
    vf a = vmul(vload(acc + d), r);
    for (i = 0; i < n; ++i)
      a = vfma(vset1(p[i]), vload(vt + i * D + d), a);
    vstore(acc + d, a);
  }
  st->m = m_new;
}

typedef struct {
  int64_t row, rows, head, heads; /* rows [row, row + rows) of one sequence x query heads likewise */
} work_item;

typedef struct {
  const void *q, *k_cache, *v_cache;
  void* out;
  const int64_t *slots, *row_first, *row_len; /* row t sees table entries [row_first[t], row_len[t]) */
  const float* sinks;                          /* [Hq] or NULL */
  int64_t q_stride, Hq, kh, D, slot_stride, pos0; /* pos0: the position of the table's entry 0 */
  float scale;
  int bf16;
} attention_args;

/* Keys and values [j0, j0 + n) of the item's KV head, as fp32 rows of kt and vt (bf16 widened
 * exactly): read from the cache once per tile, not once per (row, head). */
static void gather_tile(const attention_args* a, int64_t j0, int n, float* kt, float* vt) {
  for (int i = 0; i < n; ++i) {
    const int64_t at = a->slots[j0 + i] * a->slot_stride + a->kh * a->D;
    for (int64_t d = 0; d < a->D; d += VW) {
      vstore(kt + i * a->D + d, load_lanes(a->k_cache, at + d, a->bf16));
      vstore(vt + i * a->D + d, load_lanes(a->v_cache, at + d, a->bf16));
    }
  }
}

/* One work item: its (row, head) pairs fold each key tile in turn, then are written out. */
static void attend_item(const attention_args* a, work_item w, float* qf, float* acc, running_softmax* st, float* kt,
                        float* vt) {
  const int64_t D = a->D;
  int64_t longest = 0, earliest = INT64_MAX;
  for (int64_t r = 0; r < w.rows; ++r) {
    const int64_t len = a->row_len[w.row + r], first = a->row_first ? a->row_first[w.row + r] : 0;
    longest = len > longest ? len : longest;
    earliest = first < earliest ? first : earliest;
    for (int64_t h = 0; h < w.heads; ++h) {
      const int64_t k = r * w.heads + h, at = (w.row + r) * a->q_stride + (w.head + h) * D;
      for (int64_t d = 0; d < D; d += VW) {
        vstore(qf + k * D + d, load_lanes(a->q, at + d, a->bf16));
        vstore(acc + k * D + d, vzero());
      }
      /* a sink: a key of logit sinks[head] and no value, folded before any other */
      st[k] = a->sinks ? (running_softmax){a->sinks[w.head + h], 1.0f} : (running_softmax){-INFINITY, 0.0f};
    }
  }
  /* tiles [j0, j1) end where the position is a multiple of KT */
  for (int64_t j0 = earliest, j1; j0 < longest; j0 = j1) {
    j1 = j0 + KT - (a->pos0 + j0) % KT;
    j1 = j1 < longest ? j1 : longest;
    gather_tile(a, j0, (int)(j1 - j0), kt, vt);
    for (int64_t r = 0; r < w.rows; ++r) {
      const int64_t first = a->row_first ? a->row_first[w.row + r] : 0, len = a->row_len[w.row + r];
      const int64_t lo = first > j0 ? first : j0, hi = len < j1 ? len : j1;
      if (hi <= lo) continue;
      for (int64_t k = r * w.heads; k < (r + 1) * w.heads; ++k)
        fold_tile(qf + k * D, kt + (lo - j0) * D, vt + (lo - j0) * D, (int)(hi - lo), D, a->scale, st + k,
                  acc + k * D);
    }
  }
  for (int64_t r = 0; r < w.rows; ++r)
    for (int64_t h = 0; h < w.heads; ++h) {
      const int64_t k = r * w.heads + h, o = ((w.row + r) * a->Hq + w.head + h) * D;
      const float inv = 1.0f / st[k].l;
      for (int64_t d = 0; d < D; ++d) {
        const float v = acc[k * D + d] * inv;
        if (a->bf16) ((uint16_t*)a->out)[o + d] = f32_to_bf16(v);
        else ((float*)a->out)[o + d] = v;
      }
    }
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
  const int64_t group = Hq / Hk;
  int64_t* starts = (int64_t*)malloc(sizeof(int64_t) * (T + 1));
  int64_t rows_per_item = STATES / group < 1 ? 1 : STATES / group;
  rows_per_item = rows_per_item > ROWS ? ROWS : rows_per_item;
  const int64_t blocks = row_blocks(row_seq, T, rows_per_item, starts);
  /* too few items to share among the threads (decode of a sequence or two): a head each */
  const int64_t heads = blocks * Hk >= threads ? group : 1, per_kv = group / heads;
#pragma omp parallel num_threads(threads)
  {
    const int64_t states = rows_per_item * heads;
    float* qf = (float*)aligned_alloc(64, sizeof(float) * states * D);
    float* acc = (float*)aligned_alloc(64, sizeof(float) * states * D);
    running_softmax* st = (running_softmax*)malloc(sizeof(running_softmax) * states);
    float* kt = (float*)aligned_alloc(64, sizeof(float) * KT * D);
    float* vt = (float*)aligned_alloc(64, sizeof(float) * KT * D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < blocks * Hk * per_kv; ++i) {
      const int64_t b = i / (Hk * per_kv), kh = i / per_kv % Hk, part = i % per_kv;
      const int64_t seq = row_seq[starts[b]];
      const attention_args a = {q, k_cache, v_cache, out, table + seq * L, row_first, row_len, sinks, q_stride, Hq,
                                kh, D, Hk * D, table_pos0 ? table_pos0[seq] : 0, scale, bf16};
      const work_item w = {starts[b], starts[b + 1] - starts[b], kh * group + part * heads, heads};
      attend_item(&a, w, qf, acc, st, kt, vt);
    }
    free(qf);
    free(acc);
    free(st);
    free(kt);
    free(vt);
  }
  free(starts);
}

/* Every row from its table's entry 0, no sinks (full attention; the one-call decode step). */
void xl_paged_attention(const void* q, int64_t q_stride, int64_t T, int64_t Hq, int64_t Hk, int64_t D,
                        const void* k_cache, const void* v_cache, const int64_t* table, int64_t L,
                        const int64_t* row_seq, const int64_t* row_len, float scale, void* out, int bf16,
                        int threads) {
  xl_paged_attention_windowed(q, q_stride, T, Hq, Hk, D, k_cache, v_cache, table, L, NULL, row_seq, NULL, row_len,
                              NULL, scale, out, bf16, threads);
}
