/* A whole decoder layer for a decode step of up to 64 sequences, in one call.
 *
 * The per-op kernels already move the bytes at memory speed; what remained was Python
 * between them (about a dozen calls per layer, 30 layers per token). This chains the
 * same kernels, with the same rounding, so a decode step costs one call per layer.
 * Llama-style layer: pre-norm attention (fused QKV, rotary) and a SwiGLU MLP.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "scratch.h"

void xl_rmsnorm(const void* x, const void* w, void* out, int64_t T, int64_t H, float eps, int bf16);
void xl_rope(void* qkv, const void* cs, const void* sn, int64_t T, int64_t row, int64_t Hq, int64_t Hk,
             int64_t D, int bf16);
void xl_silu_mul(const void* gate_up, void* out, int64_t T, int64_t I, int bf16);
void xl_decode_attention(const void* q, const void* k_new, const void* v_new, int64_t row,
                         const int64_t* new_slots, void* kc, void* vc, const int64_t* slots,
                         const int64_t* lens, void* out, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                         int64_t L, float scale, int bf16, int threads);
void xl_linear_bf16(const void* x, const uint16_t* w, const void* bias, const void* residual, void* out,
                    int64_t M, int64_t N, int64_t K, int bf16, int threads);
void xl_linear_amx(const uint16_t* x, const uint16_t* w, const void* bias, const void* residual, void* out,
                   int64_t M, int64_t N, int64_t K, int threads);
int xl_amx_ready(void);

/* A projection of B rows: AMX tiles wherever they apply, from one row (cpu_ops.use_amx is the
 * same rule, AMX_MIN_ROWS), else the row kernel (on vdpbf16ps, its batched blocks: each row
 * the bits it has alone, cpu_ops.batched_rows). */
static void project(const void* x, const uint16_t* w, const void* bias, const void* residual, void* out, int64_t B,
                    int64_t N, int64_t K, int bf16, int threads) {
  if (bf16 && N % 32 == 0 && K % 32 == 0 && xl_amx_ready())
    xl_linear_amx((const uint16_t*)x, w, bias, residual, out, B, N, K, threads);
  else
    xl_linear_bf16(x, w, bias, residual, out, B, N, K, bf16, threads);
}

/* x: [B, H] hidden states, updated in place. Weights bf16, [out, in]; norms and the
 * optional QKV bias in the activation dtype. cos/sin: [B, D]. */
void xl_decode_layer(void* x, int64_t B, int64_t H, const void* ln1, const void* ln2, float eps,
                     const uint16_t* w_qkv, const void* b_qkv, const uint16_t* w_o, const uint16_t* w_gate_up,
                     const uint16_t* w_down, int64_t Hq, int64_t Hk, int64_t D, int64_t I, const void* cs,
                     const void* sn, void* kc, void* vc, const int64_t* new_slots, const int64_t* slots,
                     const int64_t* lens, int64_t L, float scale, int bf16, int threads) {
  const int64_t es = bf16 ? 2 : 4, row = (Hq + 2 * Hk) * D;
  char* h = xl_scratch(B * H * es);
  char* qkv = xl_scratch(B * row * es);
  char* attn = xl_scratch(B * Hq * D * es);
  char* gate_up = xl_scratch(B * 2 * I * es);
  char* act = xl_scratch(B * I * es);
  char* x2 = xl_scratch(B * H * es);

  xl_rmsnorm(x, ln1, h, B, H, eps, bf16);
  project(h, w_qkv, b_qkv, NULL, qkv, B, row, H, bf16, threads);
  xl_rope(qkv, cs, sn, B, row, Hq, Hk, D, bf16);
  xl_decode_attention(qkv, qkv + Hq * D * es, qkv + (Hq + Hk) * D * es, row, new_slots, kc, vc, slots, lens,
                      attn, B, Hq, Hk, D, L, scale, bf16, threads);
  project(attn, w_o, NULL, x, x2, B, H, Hq * D, bf16, threads);
  xl_rmsnorm(x2, ln2, h, B, H, eps, bf16);
  project(h, w_gate_up, NULL, NULL, gate_up, B, 2 * I, H, bf16, threads);
  xl_silu_mul(gate_up, act, B, I, bf16);
  project(act, w_down, NULL, x2, x, B, H, I, bf16, threads);

  free(h);
  free(qkv);
  free(attn);
  free(gate_up);
  free(act);
  free(x2);
}

/* Every decoder layer of a decode step in one call (no Python between layers). Per layer,
 * ``ptrs`` holds 9 addresses: ln1, ln2, w_qkv, b_qkv (0: none), w_o, w_gate_up, w_down,
 * k_cache, v_cache. */
void xl_decode_layers(void* x, int64_t B, int64_t H, int64_t n_layers, const int64_t* ptrs, float eps,
                      int64_t Hq, int64_t Hk, int64_t D, int64_t I, const void* cs, const void* sn,
                      const int64_t* new_slots, const int64_t* slots, const int64_t* lens, int64_t L,
                      float scale, int bf16, int threads) {
  for (int64_t l = 0; l < n_layers; l++) {
    const int64_t* p = ptrs + 9 * l;
    xl_decode_layer(x, B, H, (const void*)p[0], (const void*)p[1], eps, (const uint16_t*)p[2], (const void*)p[3],
                    (const uint16_t*)p[4], (const uint16_t*)p[5], (const uint16_t*)p[6], Hq, Hk, D, I, cs, sn,
                    (void*)p[7], (void*)p[8], new_slots, slots, lens, L, scale, bf16, threads);
  }
}
