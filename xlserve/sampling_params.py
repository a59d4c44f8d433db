"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from pydantic import ConfigDict, TypeAdapter

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
GUIDED_KINDS = ("json_schema", "lark", "regex")
MAX_GRAMMAR_CHARS = 64 * 1024
# Numerically safe floors. Dividing float32 logits (|x| < ~1e3) by a temperature under
# 1e-5 can overflow to inf and softmax to NaN: below it the draw is greedy, as in vLLM
# (its _SAMPLING_EPS). A top_p under 1e-6 already keeps only the top token, so it is
# raised to 1e-6 (a float32 cumulative sum rounds 1e-300 to 0, which dropped every token).
# A repetition penalty under 0.01 divides positive logits by more than 100 and multiplies
# negative ones towards 0: refused, like any value outside its range.
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6
MIN_REPETITION_PENALTY = 0.01
SEED_RANGE = (-(2**63), 2**64)
MAX_PRIORITY = 1_000_000
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
# Messages between processes refuse unknown fields and loose types (never drop a field).
WIRE_CONFIG = ConfigDict(extra="forbid", strict=True)


@dataclass(frozen=True)
class GuidedSpec:
    """A constraint on the output: a JSON schema (as JSON text), a Lark grammar or a regex."""
    __pydantic_config__ = WIRE_CONFIG
    kind: str
    spec: str

    def __post_init__(self):
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided decoding kind {self.kind!r} is unknown; allowed: {', '.join(GUIDED_KINDS)}")
        if not isinstance(self.spec, str) or not self.spec or len(self.spec) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"a {self.kind} constraint must be non-empty text of at most "
                             f"{MAX_GRAMMAR_CHARS} characters")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``to_wire()`` / ``from_wire()`` are its one JSON form
    between processes, generated from the fields: a field added here travels as is."""
    __pydantic_config__ = WIRE_CONFIG
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives; 0 = only the chosen token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    guided: GuidedSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits
    priority: int = 0  # scheduling, not sampling: a lower value leaves the waiting queue first

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        self._validate()
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # greedy
        if self.top_p < MIN_TOP_P:
            object.__setattr__(self, "top_p", MIN_TOP_P)

    def _validate(self):
        def bad(what, allowed):
            raise ValueError(f"{what}; allowed: {allowed}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}", ">= 1")
        if not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature}", "0 (greedy) .. 100")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}", "0 < top_p <= 1")
        if self.top_k < -1:
            bad(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}", "-1, 0 or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}", "0 <= min_p <= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}", "-2 .. 2")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0:
            bad(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 10], got {self.repetition_penalty}",
                f"{MIN_REPETITION_PENALTY} .. 10")
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            bad(f"seed must be a 64-bit integer, got {self.seed!r}", "-2**63 <= seed < 2**64")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", f"0 .. {MAX_LOGPROBS}")
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings, got {self.stop!r}",
                "a string or a list of non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be non-negative, got {self.stop_token_ids}", "token ids >= 0")
        if not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            bad(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {self.priority}",
                f"-{MAX_PRIORITY} .. {MAX_PRIORITY}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or len({t for t, _ in self.logit_bias}) != len(self.logit_bias) \
                or any(t < 0 or not (math.isfinite(b) and -100 <= b <= 100) for t, b in self.logit_bias):
            bad(f"logit_bias must map at most {MAX_LOGIT_BIAS} distinct token ids >= 0 to biases in "
                f"[-100, 100]", "{token id: bias}")

    def to_wire(self) -> dict:
        return _WIRE.dump_python(self, mode="json")

    @staticmethod
    def from_wire(data: dict) -> "SamplingParams":
        """The inverse of ``to_wire``; unknown fields or wrong types raise ``ValueError``."""
        return _WIRE.validate_json(json.dumps(data))  # JSON mode: the strict types of the wire

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


_WIRE = TypeAdapter(SamplingParams)
