"""How a failure inside the engine is scoped: one request, or the whole engine.

A step runs many requests at once. Whatever one request brings on itself (logits that
are not finite, a grammar that allows no token, a bug its parameters reach) ends that
request with a ``RequestError`` and the engine serves the rest. Only failures that leave
the device or the engine's own state unusable are fatal: the worker then exits with a
non-zero code, so a supervisor restarts it, instead of answering 5xx forever.
"""

from __future__ import annotations

import torch


class RequestError(Exception):
    """One request cannot go on; the engine keeps serving the others."""


class EngineFatal(Exception):
    """The engine cannot continue (its process should exit and be restarted)."""


# A CUDA error (illegal access, device assert) poisons the context for every later
# kernel; an exhausted host leaves nothing to recover with.
FATAL_ERRORS: tuple[type[BaseException], ...] = (torch.AcceleratorError, MemoryError, EngineFatal)


def describe(error: BaseException) -> str:
    """A one-line message for the client: the error's type and its first line."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"[:500] if text else type(error).__name__
