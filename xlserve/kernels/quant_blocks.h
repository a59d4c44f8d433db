/* Shared by the quantized-weight kernels: ggml's type numbers and its float16 scales. */
#ifndef XLSERVE_QUANT_BLOCKS_H
#define XLSERVE_QUANT_BLOCKS_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* BF16: plain bfloat16 values, kept as stored where the model computes in float32 (a CPU
 * without bf16 math), in "blocks" of 32 values (64 bytes) so every path below takes it */
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };

/* How far ahead of the block being multiplied a kernel prefetches its weight stream. The
 * hardware prefetcher alone leaves a streamed matmul latency-bound: on a 2-core AMD EPYC
 * (Zen 5) the default model's 30 layers and its Q8_0 LM head, 96 MB of weights read once per
 * token at batch 1, took 8.2-9.7 ms; prefetching 8 KiB ahead, 3.9-4.6 ms (~25 GB/s, the
 * machine's DRAM bandwidth); 2 KiB 8.1, 4 KiB 7.3, 16 KiB 4.6, 32 KiB 6.5 ms. */
#define PREFETCH_BYTES 8192
static inline void prefetch_ahead(const uint8_t* p) { _mm_prefetch((const char*)p + PREFETCH_BYTES, _MM_HINT_T0); }

static inline float half(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

/* f rounded to float16 and back (round to nearest even), as ggml stores a block's scale. */
static inline float half_round(float f) { return _cvtsh_ss(_cvtss_sh(f, 0)); }

int xl_q8_handles(int type);
void xl_linear_q8(int type, const float* x, const uint8_t* w, int64_t row_bytes, float* out, int64_t M, int64_t N,
                  int64_t K, int64_t ldo, int threads);
#endif
