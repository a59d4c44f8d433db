/* AMX tile state shared by the tile kernels (gemm_amx.c, gemm_amx_quant.c, attention_tiles.h).
 * Built where the compiler targets AMX (-mamx-tile). */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 when the process may use AMX tiles: asks the kernel on the first call, then answers that. */
static inline int amx_permitted(void) {
  static int state = -1;
  if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return state;
}

typedef struct {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* This thread's tiles 0 .. count - 1 configured: tile t rows[t] rows of 64 bytes. */
static inline void load_tiles(int count, const uint8_t* rows) {
  tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < count; ++t) {
    cfg.rows[t] = rows[t];
    cfg.colsb[t] = 64;
  }
  /* Not _tile_loadconfig: GCC 12's declares a read of 8 bytes, so after inlining it dropped the
   * stores of rows and colsb as dead and ldtilecfg faulted on what was on the stack (seen in a
   * benchmark built around this file). The operand below is all 64 bytes. */
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}
