"""Guided decoding: masks that keep a request's output inside a grammar.

Built on llguidance (the Rust engine behind several serving stacks' structured output):
it compiles JSON schemas, Lark grammars and regexes against our own tokenizer JSON,
with no dependency on transformers, and computes a vocabulary bitmask in microseconds.
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
import torch

from xlserve.engine.errors import RequestError
from xlserve.engine.sampler import greedy_token
from xlserve.json_schema import JSON_LAYOUT, closed_objects
from xlserve.loader.tokenizer import Tokenizer
from xlserve.sampling_params import GuidedSpec


class GuidedDecoding:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltok = None
        self._lock = threading.Lock()  # the tokenizer is built once, from any thread

    def _ll_tokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance
                eos = min(self.tokenizer.eos_token_ids) if self.tokenizer.eos_token_ids else None
                self._lltok = llguidance.LLTokenizer(self.tokenizer.backend.to_str(),
                                                     n_vocab=self.vocab_size, eos_token=eos)
            return self._lltok

    @staticmethod
    def grammar(spec: GuidedSpec) -> str:
        from llguidance import LLMatcher
        if spec.kind == "json_schema":
            try:
                schema = json.loads(spec.spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
            return LLMatcher.grammar_from_json_schema(closed_objects(schema), defaults=dict(JSON_LAYOUT))
        if spec.kind == "lark":
            return LLMatcher.grammar_from_lark(spec.spec)
        return LLMatcher.grammar_from_regex(spec.spec)

    def validate(self, spec: GuidedSpec) -> None:
        from llguidance import LLMatcher
        try:
            grammar = self.grammar(spec)
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._ll_tokenizer())
        except ValueError:
            raise
        except Exception as e:  # the compiler reports bad grammars with its own exception types
            raise ValueError(f"the {spec.kind} constraint does not compile: {e}") from e
        if is_error:
            raise ValueError(f"the {spec.kind} constraint does not compile: {'; '.join(messages)}")
        if spec.kind == "json_schema" and self._admits_only_the_end(grammar):
            raise ValueError("the JSON schema admits no JSON value (a $ref cycle with no way out?)")

    def _admits_only_the_end(self, grammar: str) -> bool:
        """Whether nothing but end-of-sequence may come first: the answer would be empty.
        A schema such as {"$ref": "#"} compiles, and then every request with it answered an
        empty message (found by the fuzz suite)."""
        from llguidance import LLMatcher
        allowed = self.allowed(LLMatcher(self._ll_tokenizer(), grammar)).nonzero().flatten().tolist()
        return set(allowed) <= set(self.tokenizer.eos_token_ids)

    def matcher(self, spec: GuidedSpec):
        from llguidance import LLMatcher
        return LLMatcher(self._ll_tokenizer(), self.grammar(spec))

    @staticmethod
    def admits(bitmask: bytes, token: int) -> bool:
        """Whether the grammar accepts ``token`` next: its bit of the matcher's
        ``compute_bitmask()`` (32-bit words in the machine's order). llguidance's
        ``validate_tokens`` is 50 times cheaper but not the same question: it admits
        tokenizations the mask forbids (``t`` where the grammar forces ``tool_call``)."""
        word = token >> 5
        return bool(int.from_bytes(bitmask[4 * word:4 * word + 4], sys.byteorder) >> (token & 31) & 1)

    def only_token(self, bitmask: bytes) -> int | None:
        """The token ``bitmask`` admits if it admits exactly one, else None: the grammar alone
        decides that position (a word scan, about 3 us for 49,152 tokens)."""
        words = np.frombuffer(bitmask, dtype=np.uint32)
        set_words = np.flatnonzero(words)
        if len(set_words) != 1:
            return None
        word = int(words[set_words[0]])
        token = 32 * int(set_words[0]) + word.bit_length() - 1
        return token if word & (word - 1) == 0 and token < self.vocab_size else None

    def allowed(self, matcher, bitmask: bytes | None = None) -> torch.Tensor:
        """Boolean [vocab_size] mask of the tokens the grammar accepts next (``bitmask``: the
        matcher's ``compute_bitmask()`` in its state, when at hand)."""
        return torch.from_numpy(self._bits(matcher.compute_bitmask() if bitmask is None else bitmask))

    def best_allowed(self, bitmask: bytes, row: torch.Tensor) -> int:
        """The first maximum of float32 ``row`` among the tokens ``bitmask`` admits (greedy's
        token under the grammar; a RequestError if it admits none). On the CPU in numpy,
        where the torch mask, fill, check and argmax took about 200 us a 49,152-token row."""
        bits = self._bits(bitmask)
        if row.device.type != "cpu":
            return greedy_token(row.masked_fill(~torch.from_numpy(bits).to(row.device), float("-inf")))
        values = np.where(bits, row.numpy(), -np.inf)
        best = int(values.argmax())
        if values[best] == -np.inf:
            raise RequestError("no token is allowed next (every logit is masked)")
        return best

    def _bits(self, bitmask: bytes) -> np.ndarray:
        """The bitmask's words as one bool per token (bit t of word w is token 32 w + t)."""
        little = np.frombuffer(bitmask, dtype=np.uint32).astype("<u4", copy=False).view(np.uint8)
        return np.unpackbits(little, bitorder="little", count=self.vocab_size).view(bool)
