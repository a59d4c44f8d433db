"""The malloc arena limit every xlserve process sets at start (xlserve/allocator.py)."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc arenas")

# Six threads allocate at once; glibc's malloc_stats() prints one "Arena N:" block per arena.
PROBE = """
import ctypes, sys, threading
from xlserve.allocator import limit_malloc_arenas
applied = limit_malloc_arenas() if sys.argv[1] == "limit" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
start, hold = threading.Barrier(6), threading.Barrier(6)
def allocate():
    start.wait()
    blocks = [libc.malloc(4096) for _ in range(64)]
    hold.wait()
threads = [threading.Thread(target=allocate) for _ in range(6)]
[t.start() for t in threads]
[t.join() for t in threads]
print(applied)
libc.malloc_stats()
"""


def _arenas(mode: str, env: dict) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in {**os.environ, **env}.items() if v is not None})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), out.stderr.count("Arena ")


def test_a_process_keeps_to_two_arenas_however_many_threads_allocate():
    applied, arenas = _arenas("limit", {"MALLOC_ARENA_MAX": None})
    assert applied == "True" and arenas <= 2
    _, unlimited = _arenas("none", {"MALLOC_ARENA_MAX": None})
    assert unlimited > 2  # the probe does reach more arenas without the limit


def test_the_environment_wins():
    applied, arenas = _arenas("limit", {"MALLOC_ARENA_MAX": "4"})
    assert applied == "False" and 2 < arenas <= 4
