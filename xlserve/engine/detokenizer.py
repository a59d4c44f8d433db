"""Incremental detokenization with stop strings.

Text is released only when it is final: never half a UTF-8 character (the decoder
yields U+FFFD until the rest of the bytes arrive), and never a prefix of a stop
string that may still complete, so a stop string never leaks into the output.
"""

from __future__ import annotations

from xlserve.loader.tokenizer import Tokenizer
from xlserve.markers import pending_marker_length

REPLACEMENT_CHAR = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], include_stop: bool,
                 skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all decoded text so far (may include a pending stop prefix)
        self.emitted = 0  # characters of self.text already released
        self.stopped = False

    def add(self, token_id: int, final: bool = False) -> str:
        """Feed one token; returns newly released text. ``final``: release everything."""
        self.token_ids.append(token_id)
        # Decode the new tokens together with the previous ones: tokenizers that mark word
        # starts (SentencePiece) only render the leading space in context.
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset], self.skip_special)
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset:], self.skip_special)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
        return self._release(final)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            search_from = max(0, self.emitted - max(len(s) for s in self.stop))
            hit = self._find_stop(search_from)
            if hit is not None:
                index, stop = hit
                self.stopped = True
                self.text = self.text[:index + (len(stop) if self.include_stop else 0)]
                final = True
        end = len(self.text)
        if not final and self.stop and not self.stopped:
            end = max(self.emitted, end - pending_marker_length(self.text, self.stop))
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

    def _find_stop(self, start: int):
        best = None
        for stop in self.stop:
            i = self.text.find(stop, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def flush(self) -> str:
        return self._release(final=True)
