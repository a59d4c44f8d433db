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
 * fp32 or bf16 queries, cache and output (bf16 widened exactly, fp32 math, the output
 * rounded once). Parallel over (row, head) pairs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "bf16.h"
#include "vec_portable.h"

#define KT 16 /* keys per tile: one rescale of the running sum per tile */

static inline vf load_lanes(const void* p, int64_t i, int bf16) {
  return bf16 ? vload_bf16((const uint16_t*)p + i) : vload((const float*)p + i);
}

/* One (row, head): q [D] fp32 in qf; keys/values at ``slots[0 .. len)`` of the cache, head kh. */
static inline __attribute__((always_inline)) void attend(const float* qf, const void* k_cache, const void* v_cache,
                                                         const int64_t* slots, int64_t len, int64_t slot_stride,
                                                         int64_t kh, int64_t D, float scale, int bf16, float* acc) {
  float m = -INFINITY, l = 0.0f, s[KT], p[KT];
  for (int64_t d = 0; d < D; d += VW) vstore(acc + d, vzero());
  for (int64_t j0 = 0; j0 < len; j0 += KT) {
    const int n = len - j0 < KT ? (int)(len - j0) : KT;
    float tile_max = -INFINITY;
    for (int i = 0; i < n; ++i) {
      const int64_t at = slots[j0 + i] * slot_stride + kh * D;
      vf dot = vzero();
      for (int64_t d = 0; d < D; d += VW) dot = vfma(vload(qf + d), load_lanes(k_cache, at + d, bf16), dot);
      s[i] = vsum(dot) * scale;
      tile_max = s[i] > tile_max ? s[i] : tile_max;
    }
    for (int i = n; i < KT; ++i) s[i] = -INFINITY;
    const float m_new = tile_max > m ? tile_max : m, rescale = expf(m - m_new);
    for (int i = 0; i < KT; i += VW) vstore(p + i, vexp(vsub(vload(s + i), vset1(m_new))));
    float tile_sum = 0.0f;
    for (int i = 0; i < n; ++i) tile_sum += p[i];
    l = l * rescale + tile_sum;
    const vf r = vset1(rescale);
    for (int64_t d = 0; d < D; d += VW) {
      vf a = vmul(vload(acc + d), r);
      for (int i = 0; i < n; ++i)
        a = vfma(vset1(p[i]), load_lanes(v_cache, slots[j0 + i] * slot_stride + kh * D + d, bf16), a);
      vstore(acc + d, a);
    }
    m = m_new;
  }
  const float inv = 1.0f / l;
  for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
}

/* q: [T, Hq, D] with row stride q_stride (elements); caches: [slots, Hk, D]; table: [S, L]
 * slot tables; row_seq[t] its table, row_len[t] the keys it sees (its own included);
 * out: [T, Hq, D] contiguous. D a multiple of 16, Hq a multiple of Hk. */
void xl_paged_attention(const void* q, int64_t q_stride, int64_t T, int64_t Hq, int64_t Hk, int64_t D,
                        const void* k_cache, const void* v_cache, const int64_t* table, int64_t L,
                        const int64_t* row_seq, const int64_t* row_len, float scale, void* out, int bf16,
                        int threads) {
  const int64_t group = Hq / Hk, slot_stride = Hk * D;
#pragma omp parallel num_threads(threads)
  {
    float* qf = (float*)aligned_alloc(64, sizeof(float) * D);
    float* acc = (float*)aligned_alloc(64, sizeof(float) * D);
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < T * Hq; ++i) {
      const int64_t t = i / Hq, h = i % Hq, at = t * q_stride + h * D;
      for (int64_t d = 0; d < D; d += VW) vstore(qf + d, load_lanes(q, at + d, bf16));
      const int64_t* slots = table + row_seq[t] * L;
      if (bf16) attend(qf, k_cache, v_cache, slots, row_len[t], slot_stride, h / group, D, scale, 1, acc);
      else attend(qf, k_cache, v_cache, slots, row_len[t], slot_stride, h / group, D, scale, 0, acc);
      if (bf16) {
        for (int64_t d = 0; d < D; ++d) ((uint16_t*)out)[i * D + d] = f32_to_bf16(acc[d]);
      } else {
        for (int64_t d = 0; d < D; ++d) ((float*)out)[i * D + d] = acc[d];
      }
    }
    free(qf);
    free(acc);
  }
}
