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
#include <omp.h>
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
 * each product and the sum rounded to the activation dtype (torch's three ops), VW values at a
 * time where half a head is whole vectors (the same operations: -x * s is -(x * s) exactly). */
static void rope(void* qkv, const void* cs, const void* sn, int64_t B, int64_t row, int64_t heads, int64_t D,
                 int bf16) {
  const int64_t half = D / 2, step = half % VW ? 1 : VW;
  float tmp[2048];
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = b * row + h * D;
      for (int64_t d = 0; d < D && step == VW; d += VW) {
        const vf x = load_lanes(qkv, at + d, bf16), c = load_lanes(cs, b * D + d, bf16);
        const vf turned = d < half ? vmul(load_lanes(qkv, at + d + half, bf16), vset1(-1.0f))
                                   : load_lanes(qkv, at + d - half, bf16);
        const vf cos_part = round_lanes(vmul(x, c), bf16);
        const vf sin_part = round_lanes(vmul(turned, load_lanes(sn, b * D + d, bf16)), bf16);
        vstore(tmp + d, round_lanes(vadd(cos_part, sin_part), bf16));
      }
      for (int64_t d = 0; d < D && step == 1; ++d) {
        const float x = ld(qkv, at + d, bf16), turned = d < half ? -ld(qkv, at + d + half, bf16)
                                                                 : ld(qkv, at + d - half, bf16);
        tmp[d] = rnd(rnd(x * ld(cs, b * D + d, bf16), bf16) + rnd(turned * ld(sn, b * D + d, bf16), bf16), bf16);
      }
      int64_t d = 0;
      for (; d + VW <= D && step == VW; d += VW) store_lanes(qkv, at + d, vload(tmp + d), bf16);
      for (; d < D; ++d) st(qkv, at + d, tmp[d], bf16);
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

/* What a layer's row stages read and write. */
typedef struct {
  const int64_t* l;
  void* x;
  const step_shape* s;
  const scratch* w;
} layer_rows;

typedef void (*row_stage)(const layer_rows* c, int64_t r0, int64_t n);

/* The step's rows [0, B) through ``stage``, split between the threads in one parallel region
 * once there are ROWS_TO_SHARE rows (fewer: this thread, no region to open). Each row's
 * operations are the same either way: a row stage touches its own rows only.
 * Why: run on one thread, the row stages (norms, rope, SiLU, the projections' epilogues) took
 * ~6% of the default model's 32-sequence decode samples while the other thread spun as long
 * (AMX Xeon, perf). Shared, with rope in vectors, the engine's decode with either build in one
 * process, 8 alternating rounds (2-core AMX Xeon): 32 sequences 1,068 -> 1,196 tok/s (ratio of
 * each round 0.99-1.30, median 1.12), 8 sequences 1.05, batch 1 1.08 (rope alone changes it). */
#define ROWS_TO_SHARE 4
static void over_rows(row_stage stage, const layer_rows* c) {
  const int64_t B = c->s->B;
  const int threads = B < ROWS_TO_SHARE ? 1 : c->s->threads;
  if (threads <= 1) {
    stage(c, 0, B);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t share = (B + omp_get_num_threads() - 1) / omp_get_num_threads(), r0 = share * omp_get_thread_num();
    if (r0 < B) stage(c, r0, r0 + share < B ? share : B - r0);
  }
}

/* row r of a [B, width] activation-dtype buffer */
static void* row_at(const layer_rows* c, void* buf, int64_t r, int64_t width) {
  return (char*)buf + r * width * (c->s->bf16 ? 2 : 4);
}

/* norm 1 of x into the QKV projection's fp32 input */
static void qkv_input(const layer_rows* c, int64_t r0, int64_t n) {
  const int64_t H = c->s->H;
  xl_row_rmsnorm(row_at(c, c->x, r0, H), (const void*)c->l[LN1], row_at(c, c->w->h, r0, H), n, H, c->s->eps,
                 c->s->bf16, 1);
  widen(row_at(c, c->w->h, r0, H), c->w->xf + r0 * H, n * H, c->s->bf16);
}

/* q, k, v (+ bias) rotated, the new k and v into the cache */
static void qkv_output(const layer_rows* c, int64_t r0, int64_t n) {
  const step_shape* s = c->s;
  const int64_t qd = s->Hq * s->D, kd = s->Hk * s->D, row = qd + 2 * kd, es = s->bf16 ? 2 : 4;
  char* qkv = row_at(c, c->w->qkv, r0, row);
  finish(c->w->y + r0 * row, (const void*)c->l[QKV_BIAS], NULL, qkv, n, row, s->bf16);
  rope(qkv, (const char*)s->cs + r0 * s->D * es, (const char*)s->sn + r0 * s->D * es, n, row, s->Hq + s->Hk, s->D,
       s->bf16);
  for (int64_t b = 0; b < n; ++b) {
    memcpy((char*)c->l[K_CACHE] + s->new_slots[r0 + b] * kd * es, qkv + (b * row + qd) * es, kd * es);
    memcpy((char*)c->l[V_CACHE] + s->new_slots[r0 + b] * kd * es, qkv + (b * row + qd + kd) * es, kd * es);
  }
}

/* the attention's output into the O projection's fp32 input */
static void o_input(const layer_rows* c, int64_t r0, int64_t n) {
  const int64_t qd = c->s->Hq * c->s->D;
  widen(row_at(c, c->w->attn, r0, qd), c->w->xf + r0 * qd, n * qd, c->s->bf16);
}

/* x2 = x + O(attn) (+ bias); norm 2 of it into the gate/up projection's fp32 input */
static void mlp_input(const layer_rows* c, int64_t r0, int64_t n) {
  const int64_t H = c->s->H;
  const int bf16 = c->s->bf16;
  finish(c->w->y + r0 * H, (const void*)c->l[O_BIAS], row_at(c, c->x, r0, H), row_at(c, c->w->x2, r0, H), n, H,
         bf16);
  xl_row_rmsnorm(row_at(c, c->w->x2, r0, H), (const void*)c->l[LN2], row_at(c, c->w->h, r0, H), n, H, c->s->eps,
                 bf16, 1);
  widen(row_at(c, c->w->h, r0, H), c->w->xf + r0 * H, n * H, bf16);
}

/* SiLU(gate) * up into the down projection's fp32 input */
static void down_input(const layer_rows* c, int64_t r0, int64_t n) {
  const int64_t I = c->s->I;
  const int bf16 = c->s->bf16;
  finish(c->w->y + r0 * 2 * I, NULL, NULL, row_at(c, c->w->gate_up, r0, 2 * I), n, 2 * I, bf16);
  xl_row_silu_mul(row_at(c, c->w->gate_up, r0, 2 * I), row_at(c, c->w->act, r0, I), n, I, bf16, 1);
  widen(row_at(c, c->w->act, r0, I), c->w->xf + r0 * I, n * I, bf16);
}

/* x = x2 + down(act) */
static void layer_output(const layer_rows* c, int64_t r0, int64_t n) {
  const int64_t H = c->s->H;
  finish(c->w->y + r0 * H, NULL, row_at(c, c->w->x2, r0, H), row_at(c, c->x, r0, H), n, H, c->s->bf16);
}

static void decode_layer(const int64_t* l, void* x, const step_shape* s, const scratch* w) {
  const int64_t B = s->B, H = s->H, qd = s->Hq * s->D, row = qd + 2 * s->Hk * s->D;
  const layer_rows c = {l, x, s, w};
  over_rows(qkv_input, &c);
  project(l + QKV, w->xf, B, row, H, w->y, s->threads);
  over_rows(qkv_output, &c);
  xl_paged_attention(w->qkv, row, B, s->Hq, s->Hk, s->D, (const void*)l[K_CACHE], (const void*)l[V_CACHE], s->table,
                     s->L, s->row_seq, s->row_len, s->scale, w->attn, s->bf16, s->threads);
  over_rows(o_input, &c);
  project(l + O, w->xf, B, H, qd, w->y, s->threads);
  over_rows(mlp_input, &c);
  project(l + GATE_UP, w->xf, B, 2 * s->I, H, w->y, s->threads);
  over_rows(down_input, &c);
  project(l + DOWN, w->xf, B, H, s->I, w->y, s->threads);
  over_rows(layer_output, &c);
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
