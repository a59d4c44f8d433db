"""Text that streams out piece by piece must not release a tail that may still become a
marker (a stop string, a tool-call tag): the detokenizer and the tool-call and reasoning
parsers hold it back until the next piece decides."""

from __future__ import annotations


def pending_marker_length(text: str, markers) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers``."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest
