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

/* Bytes of one block of the 32-value formats the 8-bit kernels take (Q4_0, Q4_1, Q8_0). */
static inline int block_bytes(int type) { return type == Q8_0 ? 34 : type == Q4_0 ? 18 : 20; }

/* f rounded to float16 and back (round to nearest even), as ggml stores a block's scale. */
static inline float half_round(float f) { return _cvtsh_ss(_cvtss_sh(f, 0)); }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* 32 values to 8 bits by llama.cpp's rule (its Q8_0 / Q8_1 activation blocks): d = max|x| /
 * 127, q = round-to-nearest-even(x * 127 / max|x|); values 0-15 in *q0's lanes, 16-31 in
 * *q1's, their sum in *sum; returns d (not yet rounded to float16). */
static inline float quantize_block32(const float* x, __m512i* q0, __m512i* q1, int* sum) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  *q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
  *q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(*q0, *q1));
  return amax / 127.0f;
}

/* The same into 32 bytes q, in order. */
static inline float quantize_q8_block(const float* x, int8_t* q, int* sum) {
  __m512i q0, q1;
  const float d = quantize_block32(x, &q0, &q1, sum);
  _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(q1));
  return d;
}
#else
/* The same rule in AVX2 (ggml's AVX2 quantize_row_q8_1): 32 bytes q in order, their sum in
 * *sum; returns d (not yet rounded to float16). */
static inline float quantize_q8_block(const float* x, int8_t* q, int* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
  __m256i n[4];
  for (int i = 0; i < 4; ++i)
    n[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  *sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1)));
  /* the packs work within 128-bit halves: the permute puts the 32 bytes back in order */
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return amax / 127.0f;
}
#endif

/* xlserve's own block types, never in a file: Q4_0, Q4_1 and Q8_0 interleaved 16 rows at a
 * time for the 8-bit kernel (dot_q8_x16.c) or the bfloat16 one (on AMX tiles, gemm_amx_quant.c;
 * elsewhere its twin in FMAs, gemm_tile_order.c), X16 | the format's type */
enum { X16 = 256 };

int xl_q8_handles(int type);
void xl_linear_x16(int base, const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K,
                   int64_t ldo, int threads);
int xl_amx_quant_ready(void);
void xl_linear_amx_quant(int base, const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K,
                         int64_t ldo, int threads);
int xl_tile_order_ready(void);
void xl_linear_tile_order(int base, const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K,
                          int64_t ldo, int threads);
void x16_row(int base, const uint8_t* w, int64_t blocks, int64_t n, uint8_t* row);
void xl_linear_q8(int type, const float* x, const uint8_t* w, int64_t row_bytes, float* out, int64_t M, int64_t N,
                  int64_t K, int64_t ldo, int threads);
#endif
