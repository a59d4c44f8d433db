"""Guided decoding: masks that keep a request's output inside a grammar.

Built on llguidance (the Rust engine behind several serving stacks' structured output):
it compiles JSON schemas, Lark grammars and regexes against our own tokenizer JSON,
with no dependency on transformers, and computes a vocabulary bitmask in microseconds.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import OrderedDict

import numpy as np
import torch

from xlserve.engine.errors import RequestError
from xlserve.engine.sampler import greedy_token
from xlserve.json_schema import JSON_LAYOUT, closed_objects
from xlserve.loader.tokenizer import Tokenizer
from xlserve.sampling_params import GuidedSpec

# Compiled grammars kept, most recently used first: an agent's requests repeat a handful (its
# tools' call grammar, a response schema). Compiling the default model's tool-call grammar took
# 2.5 ms to validate and 3.0 ms for each request's matcher; a copy of a compiled one takes 4 us.
COMPILED_GRAMMARS = 64


class GuidedDecoding:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltok = None
        self._lock = threading.Lock()  # the tokenizer is built once, from any thread
        # grammar text -> [a matcher compiled from it and never advanced (requests get copies),
        # whether validate() passed it]
        self._compiled: OrderedDict[str, list] = OrderedDict()
        self._compiled_lock = threading.Lock()  # validated on the API's threads, matched on the engine's

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
        """A ValueError if ``spec`` does not compile (or, a JSON schema, admits no value); a
        grammar compiled before passes at once."""
        from llguidance import LLMatcher
        try:
            grammar = self.grammar(spec)
            if self._entry(grammar, compile_missing=False)[1]:
                return
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._ll_tokenizer())
        except ValueError:
            raise
        except Exception as e:  # the compiler reports bad grammars with its own exception types
            raise ValueError(f"the {spec.kind} constraint does not compile: {e}") from e
        if is_error:
            raise ValueError(f"the {spec.kind} constraint does not compile: {'; '.join(messages)}")
        entry = self._entry(grammar)
        if spec.kind == "json_schema" and self._admits_only_the_end(entry[0]):
            raise ValueError("the JSON schema admits no JSON value (a $ref cycle with no way out?)")
        entry[1] = True

    def _admits_only_the_end(self, template) -> bool:
        """Whether nothing but end-of-sequence may come first: the answer would be empty.
        A schema such as {"$ref": "#"} compiles, and then every request with it answered an
        empty message (found by the fuzz suite)."""
        allowed = self.allowed(template.deep_copy()).nonzero().flatten().tolist()  # the kept one never moves
        return set(allowed) <= set(self.tokenizer.eos_token_ids)

    def _entry(self, grammar: str, compile_missing: bool = True) -> list:
        """``[matcher, validated]`` kept for ``grammar``, marked most recently used; compiled now
        if missing (``[None, False]`` instead when not ``compile_missing``)."""
        from llguidance import LLMatcher
        with self._compiled_lock:
            entry = self._compiled.get(grammar)
            if entry is not None:
                self._compiled.move_to_end(grammar, last=False)
                return entry
        if not compile_missing:
            return [None, False]
        entry = [LLMatcher(self._ll_tokenizer(), grammar), False]
        with self._compiled_lock:
            self._compiled[grammar] = entry
            self._compiled.move_to_end(grammar, last=False)
            while len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem()
        return entry

    def matcher(self, spec: GuidedSpec):
        """A request's own matcher at the grammar's start: a copy of the kept compiled one."""
        return self._entry(self.grammar(spec))[0].deep_copy()

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
