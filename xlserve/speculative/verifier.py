"""Checking proposed tokens against the model (speculative decoding's accept rule).

A request that carried k proposed tokens gets k + 1 rows of logits from one forward pass:
row i is the model's distribution after the request's tokens and the first i proposals.
Walking the rows in order, a proposal is kept when the model would have produced it;
the first one it would not have is replaced by a token drawn from the model, and the rest
are dropped; when all are kept, the last row gives one more token. So a step emits 1 to
k + 1 tokens, each distributed exactly as without speculation:

- greedy: a proposal is kept when it is the row's argmax;
- sampled: our proposers give one token with certainty (q is a point mass), so the
  standard rule min(1, p/q) keeps it with probability p(proposal); a rejected position
  draws from p with the proposal removed and renormalized — the normalized residual
  max(0, p - q).

Each row is first prepared as the request's sampling sees it after the tokens before it
(logit bias, penalties over the output so far, a grammar's mask: a proposal the grammar
forbids has probability 0 and is rejected).
"""

from __future__ import annotations

from typing import Callable

import torch

from xlserve.engine.sampler import Sampler, greedy_token
from xlserve.sampling_params import SamplingParams


def verify(rows: torch.Tensor, proposed: list[int], params: SamplingParams,
           generator: Callable[[int], torch.Generator], sampler: Sampler,
           prepare: Callable[[torch.Tensor, list[int]], torch.Tensor] = lambda row, before: row,
           emitted: Callable[[int], None] = lambda token: None) -> list[int]:
    """The tokens a step emits: the kept proposals, then the model's own token.
    ``rows``: [len(proposed) + 1, vocab] float32 logits; ``generator(i)``: the draws of the
    request's i-th token of this step (seeded by its output position); ``prepare(row,
    before)``: the row after the step's tokens ``before``; ``emitted(token)``: called for
    each token in order (a grammar consumes it)."""
    out: list[int] = []
    for i, token in enumerate(proposed):
        row = prepare(rows[i], out)
        probs = None if params.greedy else sampler.probabilities(row, params)
        if probs is None:  # greedy, or the defined greedy fallback when the math overflows
            best = greedy_token(row)
            if best != token:
                return _emit(out, best, emitted)
        else:
            gen = generator(i)  # one stream per position: the test draw, then the residual's
            if not float(torch.rand((), generator=gen)) < float(probs[token]):
                return _emit(out, _residual(probs, token, gen, row), emitted)
        _emit(out, token, emitted)
    last = len(proposed)
    draws = None if params.greedy else generator(last)  # greedy draws nothing: no generator to seed
    return _emit(out, sampler.sample_row(prepare(rows[last], out), params, draws, None, None), emitted)


def _emit(out: list[int], token: int, emitted: Callable[[int], None]) -> list[int]:
    emitted(token)
    out.append(token)
    return out


def _residual(probs: torch.Tensor, rejected: int, gen: torch.Generator, row: torch.Tensor) -> int:
    """A draw from ``probs`` without ``rejected``, renormalized."""
    rest = probs.clone()
    rest[rejected] = 0.0
    if not float(rest.sum()) > 0.0:  # p(rejected) rounded to 1 yet the draw missed it: nothing else is allowed
        return greedy_token(row)
    return int(torch.multinomial(rest, 1, generator=gen))
