"""glibc malloc, set for processes that run for days.

glibc gives each new thread its own malloc arena, up to 8 per core, and an arena keeps
the holes that freed buffers leave. A worker's threads (engine, KV transfer, HTTP,
preprocessing) each allocate and free megabyte buffers, so its RSS climbs for as long as
their holes do not line up. Measured side by side (three `xlserve serve` stacks under the
soak's agentic load for 20 minutes, before a KV pull was received into one buffer): the
decode worker's RSS rose 12.0% between the first and last fifth with glibc's default
arenas, 2.9% with two, 1.4% under jemalloc (which a pip install cannot bring).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)
M_ARENA_MAX = -8  # mallopt's parameter number, from glibc's malloc.h
SERVER_ARENAS = 2


def limit_malloc_arenas(arenas: int = SERVER_ARENAS) -> bool:
    """At most ``arenas`` malloc arenas for this process (glibc's ``MALLOC_ARENA_MAX``),
    unless the environment sets that itself or this is not glibc. Call it before threads
    start: an arena, once made, stays. True when applied."""
    if os.environ.get("MALLOC_ARENA_MAX") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, arenas) == 1
    except (OSError, AttributeError) as e:  # a libc without mallopt: keep its defaults
        log.debug("mallopt: %s", e)
        return False
