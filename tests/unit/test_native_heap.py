"""The C heap's reading and trim (xlserve/native_heap.py): malloc's free pages go back to
the system, and the servers' /metrics show its bytes in use and free."""

import ctypes

import psutil
import pytest

from xlserve import native_heap
from xlserve.worker.metrics import WorkerMetrics

glibc = pytest.mark.skipif(native_heap.usage() is None, reason="the C library is not glibc 2.33+")


@glibc
def test_trim_hands_back_free_pages_kept_inside_the_heap():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(1024) for _ in range(40_000)]  # 40 MiB under the mmap threshold: in an arena
    for p in chunks:
        ctypes.memset(p, 1, 1024)  # touched: resident
    keeper = libc.malloc(1024)  # above them, so the heap's top cannot shrink past them
    before = native_heap.usage()
    for p in chunks:
        libc.free(p)
    freed = native_heap.usage()
    assert freed.free - before.free > 30 * 2**20  # kept by malloc, free for reuse
    me = psutil.Process()
    rss = me.memory_info().rss
    assert native_heap.trim()
    assert rss - me.memory_info().rss > 20 * 2**20  # the pages went back to the system
    libc.free(keeper)


@glibc
def test_metrics_show_the_heap():
    page = WorkerMetrics(None, "m").render().decode()
    assert "xlserve_native_heap_in_use_bytes " in page
    assert "xlserve_native_heap_free_bytes " in page
