/* Scratch memory for activation rows: released with free() (xl_scratch), or kept by the thread
 * for the next call (xl_kept). */
#pragma once
#include <stdlib.h>

/* ``bytes`` rounded up to whole cache lines, starting on one. glibc's malloc returns 16-byte
 * aligned blocks, and a row that starts mid-line makes each of the kernels' 64-byte loads of it
 * straddle two lines: 30 layers of the default model's Q4_1 shapes on the AMX Xeon (minimum of
 * 10) took 9.6 ms against 6.6 at 6 rows, 12.8 against 8.1 at 8 and 12.4 against 10.9 at 10
 * with the rows 16 bytes off a line, which is where the one-call decode step's malloc put them. */
static inline void* xl_scratch(size_t bytes) { return aligned_alloc(64, (bytes + 63) & ~(size_t)63); }

/* At least ``bytes`` of scratch (cache-line aligned) that this thread keeps for call site
 * ``slot`` (0-7) of the including file: grown when a call needs more, never freed (at most the
 * largest call's, a long prefill's few MB). A decode token calls each kernel ~120 times;
 * allocating and freeing their scratch every time took ~2.5% of batch-1 decode (perf: glibc's
 * _int_free and malloc_consolidate). */
static inline void* xl_kept(int slot, size_t bytes) {
  static __thread struct {
    void* data;
    size_t size;
  } kept[8];
  if (kept[slot].size < bytes) {
    free(kept[slot].data);
    kept[slot].data = xl_scratch(bytes);
    kept[slot].size = bytes;
  }
  return kept[slot].data;
}
