"""What goes wrong on the far side of the router, as exceptions the dispatcher acts on."""

import json


def error_of(body: bytes) -> dict:
    """The ``error`` object of a server's OpenAI-shaped error body; else its first bytes as
    the message."""
    try:
        error = json.loads(body)["error"]
        if isinstance(error, dict):
            return error
    except (ValueError, KeyError, TypeError):
        pass
    return {"message": body[:200].decode("utf-8", "replace")}


def describe(e: BaseException) -> str:
    """An exception for a log line: its type, then its message (httpx's timeouts have none)."""
    return f"{type(e).__name__} {e}".rstrip()


class WorkerFailed(Exception):
    """A worker failed (unreachable, 5xx, broken stream, no progress in time): marked down."""


class NoWorker(WorkerFailed):
    """No healthy worker of a stage is left to try."""
