"""The C heap under Python's: what glibc's malloc holds in use and keeps free, and handing
its free pages back to the system.

Why: over 13,426 requests of the soak's load the router's bytes in use stayed at 32.9 MiB
while the free space malloc kept in its arenas grew by 2.2 MiB, the whole of its RSS's
rise. glibc returns memory on its own only from the top of a heap; ``malloc_trim(0)`` also
returns the free pages inside one (it gave the router back 8.7 MiB; docs/reliability.md).
Dask's workers trim for the same reason. Where the C library is not glibc (musl, macOS)
there is nothing to read or trim, and every function here says so by returning None/False.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)  # the symbols the process already has: its C library's
        libc.mallinfo2.restype = _MallInfo2  # glibc 2.33 and later
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _glibc()


@dataclass(frozen=True)
class HeapUsage:
    in_use: int  # bytes malloc handed out and not yet freed (arenas and mmapped chunks)
    free: int  # bytes free inside its arenas, resident or not: a trim returns their pages, not the count


def usage() -> HeapUsage | None:
    """malloc's bytes in use and free, summed over its arenas; None off glibc."""
    if _LIBC is None:
        return None
    info = _LIBC.mallinfo2()
    return HeapUsage(in_use=info.uordblks + info.hblkhd, free=info.fordblks)


def trim() -> bool:
    """Hand malloc's free pages back to the system; False when nothing was returned or off glibc."""
    return bool(_LIBC is not None and _LIBC.malloc_trim(0))


async def trim_every(interval: float) -> None:
    """Trim every ``interval`` seconds, on a thread: the walk over the arenas takes
    milliseconds, and the event loop waits for an arena's lock only while that one is walked."""
    while True:
        await asyncio.sleep(interval)
        started = time.perf_counter()
        returned = await asyncio.to_thread(trim)
        log.debug("malloc_trim: %s in %.1f ms", "pages returned" if returned else "nothing to return",
                  1e3 * (time.perf_counter() - started))
