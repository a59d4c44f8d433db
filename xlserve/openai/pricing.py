"""What a request costs: a price table with a discount for cached input tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PriceTable:
    """Prices in currency units per million tokens."""
    input: float = 0.60
    cached_input: float = 0.10
    output: float = 3.00
    currency: str = "USD"

    def __post_init__(self):
        if min(self.input, self.cached_input, self.output) < 0:
            raise ValueError(f"prices must be >= 0, got {self}")

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict:
        uncached = max(prompt_tokens - cached_tokens, 0)
        parts = {"input": uncached * self.input / 1e6, "cached_input": cached_tokens * self.cached_input / 1e6,
                 "output": completion_tokens * self.output / 1e6}
        return {**{k: round(v, 9) for k, v in parts.items()}, "total": round(sum(parts.values()), 9),
                "currency": self.currency}
