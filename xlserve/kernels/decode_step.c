/* A whole decode step of a Llama-style model in one call, on the kernels built for every
 * x86-64 CPU (AVX2 or AVX-512): weights kept in their file's block format (gemm_quant.c) or
 * dense under --deterministic, attention over the paged cache (attention_paged.c).
 *
 * At batch 1 on the default model the matmuls take ~13 ms per token and the Python between
 * ~120 kernel calls as much again; this chains the same kernels in C. The row kernels below
 * (RMSNorm, SiLU-and-multiply) are also what the eager path calls on these CPUs, and every
 * rounding happens where the eager torch code rounds, so a decode row gets the same bits on
 * either path, and the step stays batch-invariant.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "scratch.h"
#include "vec_portable.h"

void xl_linear_quant(int type, const float* x, const uint8_t* w, int64_t row_bytes, float* out, int64_t M,
                     int64_t N, int64_t K, int64_t ldo, int eight_bit, int threads);
void xl_linear_dense(const float* x, const void* w, int bf16, float* out, int64_t M, int64_t N, int64_t K,
                     int64_t ldo, int threads);
void xl_paged_attention(const void* q, int64_t q_stride, int64_t T, int64_t Hq, int64_t Hk, int64_t D,
                        const void* k_cache, const void* v_cache, const int64_t* table, int64_t L,
                        const int64_t* row_seq, const int64_t* row_len, float scale, void* out, int bf16,
                        int threads);

static inline float ld(const void* p, int64_t i, int bf16) {
  return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}
static inline void st(void* p, int64_t i, float v, int bf16) {
  if (bf16) ((uint16_t*)p)[i] = f32_to_bf16(v);
  else ((float*)p)[i] = v;
}
static inline float rnd(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* Llama's RMSNorm of T rows of H (norm.py:RMSNorm): x * 1/sqrt(mean(x^2) + eps) in fp32,
 * rounded to the activation dtype, times the weight (rounded again). The squares are summed
 * in VW lanes, then the lanes, then a tail: one order per row whatever the batch. */
void xl_row_rmsnorm(const void* x, const void* w, void* out, int64_t T, int64_t H, float eps, int bf16,
                    int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T > 8)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t base = t * H;
    vf acc = vzero();
    int64_t i = 0;
    for (; i + VW <= H; i += VW) {
      const vf v = load_lanes(x, base + i, bf16);
      acc = vfma(v, v, acc);
    }
    float sum = vsum(acc);
    for (; i < H; ++i) sum += ld(x, base + i, bf16) * ld(x, base + i, bf16);
    const float inv = 1.0f / sqrtf(sum / (float)H + eps);
    for (i = 0; i + VW <= H; i += VW)
      store_lanes(out, base + i, vmul(round_lanes(vmul(load_lanes(x, base + i, bf16), vset1(inv)), bf16),
                                      load_lanes(w, i, bf16)), bf16);
    for (; i < H; ++i) st(out, base + i, rnd(ld(x, base + i, bf16) * inv, bf16) * ld(w, i, bf16), bf16);
  }
}

/* SiLU(gate) * up for T rows of [gate | up] (2I values each): gate / (1 + exp(-gate)) in fp32,
 * rounded to the activation dtype, times up, rounded (torch's silu, then the product). */
void xl_row_silu_mul(const void* gate_up, void* out, int64_t T, int64_t I, int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T > 8)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t g0 = t * 2 * I, u0 = g0 + I;
    float s[VW];
    /* exp(-gate) for gate < -88 would overflow the exponent trick: silu is -0 there anyway */
    int64_t i = 0;
    for (; i + VW <= I; i += VW) { /* whole vectors: the tail's operations, VW at a time */
      const vf g = load_lanes(gate_up, g0 + i, bf16), e = vexp(vmin(vmul(g, vset1(-1.0f)), vset1(88.0f)));
      store_lanes(out, t * I + i, vmul(round_lanes(vdiv(g, vadd(vset1(1.0f), e)), bf16),
                                       load_lanes(gate_up, u0 + i, bf16)), bf16);
    }
    if (i < I) {
      const int n = (int)(I - i);
      for (int j = 0; j < VW; ++j) s[j] = j < n ? -ld(gate_up, g0 + i + j, bf16) : 0.0f;
      vstore(s, vexp(vmin(vload(s), vset1(88.0f))));
      for (int j = 0; j < n; ++j) {
        const float g = ld(gate_up, g0 + i + j, bf16);
        st(out, t * I + i + j, rnd(g / (1.0f + s[j]), bf16) * ld(gate_up, u0 + i + j, bf16), bf16);
      }
    }
  }
}

/* A projection's table entry: its parts (consecutive runs of output rows, in order), whether
 * its Q4_0 / Q4_1 / Q8_0 parts multiply 8-bit activations, then per part its block type
 * (DENSE_F32 / DENSE_BF16: a plain [rows, K] matrix for xl_linear_dense; DENSE_CALL: a bf16
 * one for the kernel at the address in the bytes-per-row field, the AMX library's
 * xl_linear_amx_dense, which this build has not), data address, bytes per row and rows. */
enum { DENSE_F32 = -1, DENSE_BF16 = -2, DENSE_CALL = -3, PART_FIELDS = 4, MAX_PARTS = 3,
       PROJ_FIELDS = 2 + PART_FIELDS * MAX_PARTS };
typedef void (*dense_call)(const float* x, const uint16_t* w, float* out, int64_t M, int64_t N, int64_t K,
                           int64_t ldo, int threads);
/* A layer's table entry (decode_step.py builds it): norms, biases (0: none), its KV cache,
 * then the four projections. */
enum { LN1, LN2, QKV_BIAS, O_BIAS, K_CACHE, V_CACHE, QKV, O = QKV + PROJ_FIELDS, GATE_UP = O + PROJ_FIELDS,
       DOWN = GATE_UP + PROJ_FIELDS, LAYER_FIELDS = DOWN + PROJ_FIELDS };

int64_t xl_decode_step_layer_fields(void) { return LAYER_FIELDS; }

/* out [M, N] fp32 = x [M, K] fp32 @ W.T, each part by its own kernel (QuantizedWeight.linear) */
static void project(const int64_t* p, const float* x, int64_t M, int64_t N, int64_t K, float* out, int threads) {
  int64_t start = 0;
  for (int64_t i = 0; i < p[0]; ++i) {
    const int64_t* part = p + 2 + PART_FIELDS * i;
    const int64_t type = part[0], rows = part[3];
    if (type >= 0)
      xl_linear_quant((int)type, x, (const uint8_t*)part[1], part[2], out + start, M, rows, K, N, (int)p[1], threads);
    else if (type == DENSE_CALL)
      ((dense_call)part[2])(x, (const uint16_t*)part[1], out + start, M, rows, K, N, threads);
    else
      xl_linear_dense(x, (const void*)part[1], type == DENSE_BF16, out + start, M, rows, K, N, threads);
    start += rows;
  }
}

/* quant_ops.finish: + bias in fp32, rounded to the activation dtype once; + residual, rounded */
static void finish(const float* y, const void* bias, const void* residual, void* dst, int64_t M, int64_t N,
                   int bf16) {
  for (int64_t m = 0; m < M; ++m) {
    int64_t n = 0;
    for (; n + VW <= N; n += VW) { /* the same operations, VW at a time */
      vf v = vload(y + m * N + n);
      if (bias) v = vadd(v, load_lanes(bias, n, bf16));
      v = round_lanes(v, bf16);
      if (residual) v = round_lanes(vadd(load_lanes(residual, m * N + n, bf16), v), bf16);
      store_lanes(dst, m * N + n, v, bf16);
    }
    for (; n < N; ++n) {
      float v = y[m * N + n];
      if (bias) v += ld(bias, n, bf16);
      v = rnd(v, bf16);
      if (residual) v = rnd(ld(residual, m * N + n, bf16) + v, bf16);
      st(dst, m * N + n, v, bf16);
    }
  }
}

static void widen(const void* x, float* out, int64_t count, int bf16) {
  int64_t i = 0;
  for (; i + VW <= count; i += VW) vstore(out + i, load_lanes(x, i, bf16));
  for (; i < count; ++i) out[i] = ld(x, i, bf16);
}

/* rotary.py, rotate-half: x * cos + rotate_half(x) * sin on the q and k heads of each row,
 * each product and the sum rounded to the activation dtype (torch's three ops). */
static void rope(void* qkv, const void* cs, const void* sn, int64_t B, int64_t row, int64_t heads, int64_t D,
                 int bf16) {
  const int64_t half = D / 2;
  float tmp[2048];
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = b * row + h * D;
      for (int64_t d = 0; d < D; ++d) {
        const float x = ld(qkv, at + d, bf16), turned = d < half ? -ld(qkv, at + d + half, bf16)
                                                                 : ld(qkv, at + d - half, bf16);
        tmp[d] = rnd(rnd(x * ld(cs, b * D + d, bf16), bf16) + rnd(turned * ld(sn, b * D + d, bf16), bf16), bf16);
      }
      for (int64_t d = 0; d < D; ++d) st(qkv, at + d, tmp[d], bf16);
    }
}

typedef struct {
  int64_t B, H, Hq, Hk, D, I, L;
  float eps, scale;
  int bf16, threads;
  const void *cs, *sn;
  const int64_t *new_slots, *table, *row_seq, *row_len;
} step_shape;

typedef struct { void *h, *qkv, *attn, *x2, *gate_up, *act; float *xf, *y; } scratch;

static void decode_layer(const int64_t* l, void* x, const step_shape* s, scratch* w) {
  const int64_t B = s->B, H = s->H, qd = s->Hq * s->D, kd = s->Hk * s->D, row = qd + 2 * kd;
  const int bf16 = s->bf16, es = bf16 ? 2 : 4;
  xl_row_rmsnorm(x, (const void*)l[LN1], w->h, B, H, s->eps, bf16, 1);
  widen(w->h, w->xf, B * H, bf16);
  project(l + QKV, w->xf, B, row, H, w->y, s->threads);
  finish(w->y, (const void*)l[QKV_BIAS], NULL, w->qkv, B, row, bf16);
  rope(w->qkv, s->cs, s->sn, B, row, s->Hq + s->Hk, s->D, bf16);
  for (int64_t b = 0; b < B; ++b) { /* the new K/V into the cache, then attention reads it */
    memcpy((char*)l[K_CACHE] + s->new_slots[b] * kd * es, (char*)w->qkv + (b * row + qd) * es, kd * es);
    memcpy((char*)l[V_CACHE] + s->new_slots[b] * kd * es, (char*)w->qkv + (b * row + qd + kd) * es, kd * es);
  }
  xl_paged_attention(w->qkv, row, B, s->Hq, s->Hk, s->D, (const void*)l[K_CACHE], (const void*)l[V_CACHE], s->table,
                     s->L, s->row_seq, s->row_len, s->scale, w->attn, bf16, s->threads);
  widen(w->attn, w->xf, B * qd, bf16);
  project(l + O, w->xf, B, H, qd, w->y, s->threads);
  finish(w->y, (const void*)l[O_BIAS], x, w->x2, B, H, bf16);
  xl_row_rmsnorm(w->x2, (const void*)l[LN2], w->h, B, H, s->eps, bf16, 1);
  widen(w->h, w->xf, B * H, bf16);
  project(l + GATE_UP, w->xf, B, 2 * s->I, H, w->y, s->threads);
  finish(w->y, NULL, NULL, w->gate_up, B, 2 * s->I, bf16);
  xl_row_silu_mul(w->gate_up, w->act, B, s->I, bf16, 1);
  widen(w->act, w->xf, B * s->I, bf16);
  project(l + DOWN, w->xf, B, H, s->I, w->y, s->threads);
  finish(w->y, NULL, w->x2, x, B, H, bf16);
}

/* Every layer on x [B, H] (activation dtype) in place. ``layers``: [n_layers, LAYER_FIELDS]
 * int64; cos/sin [B, D]; the new K/V go to ``new_slots`` [B]; row b attends to the first
 * ``row_len[b]`` slots of ``table`` [B, L]. D at most 2048. */
void xl_decode_step(void* x, int64_t B, int64_t H, int64_t n_layers, const int64_t* layers, float eps, int64_t Hq,
                    int64_t Hk, int64_t D, int64_t I, const void* cs, const void* sn, const int64_t* new_slots,
                    const int64_t* table, int64_t L, const int64_t* row_len, float scale, int bf16, int threads) {
  int64_t* row_seq = (int64_t*)malloc(sizeof(int64_t) * B); /* row b reads table row b */
  for (int64_t b = 0; b < B; ++b) row_seq[b] = b;
  const step_shape s = {B, H, Hq, Hk, D, I, L, eps, scale, bf16, threads, cs, sn, new_slots, table, row_seq, row_len};
  const int64_t es = bf16 ? 2 : 4, row = (Hq + 2 * Hk) * D, widest = row > 2 * I ? row : 2 * I;
  const int64_t inputs = H > Hq * D ? (H > I ? H : I) : (Hq * D > I ? Hq * D : I);
  scratch w = {xl_scratch(B * H * es), xl_scratch(B * row * es), xl_scratch(B * Hq * D * es),
               xl_scratch(B * H * es), xl_scratch(B * 2 * I * es), xl_scratch(B * I * es),
               xl_scratch(B * inputs * 4), xl_scratch(B * widest * 4)};
  for (int64_t i = 0; i < n_layers; ++i) decode_layer(layers + i * LAYER_FIELDS, x, &s, &w);
  free(w.h);
  free(w.qkv);
  free(w.attn);
  free(w.x2);
  free(w.gate_up);
  free(w.act);
  free(w.xf);
  free(w.y);
  free(row_seq);
}
