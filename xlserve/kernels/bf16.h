/* bfloat16 <-> float32, exactly as torch converts: widening is a 16-bit shift, narrowing
 * rounds to nearest even. */
#ifndef XLSERVE_BF16_H
#define XLSERVE_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = (uint32_t)v << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}
#endif
