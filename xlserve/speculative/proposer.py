"""Proposers for speculative decoding: each guesses a running request's next tokens from
what it has seen, and the engine checks the guesses in the next step's forward pass
(``speculative/verifier.py``), keeping the ones the model would have produced.

A proposer runs on the engine thread between steps, so it must be cheap next to a step
(its cost is in ``xlserve bench``'s figures). Registered by name (``--speculative``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the router imports this module and never loads torch
    import torch


class Proposer(ABC):
    """Invariants: ``propose`` returns at most ``k`` token ids, each one the proposer saw in
    some request's tokens (so always in the vocabulary); it never changes ``tokens``. State
    kept per request is dropped by ``forget``."""

    name: str
    wants_hidden = False  # the engine hands it the target's hidden states (``observe``)
    # it may guess after tokens the target has not computed yet (a grammar's forced tokens
    # about to be checked): a lookup over tokens, not a model that needs their states or KV
    guesses_ahead = False
    guesses = True  # False: it proposes nothing of its own, only the chains' forced runs (``grammar``)

    @classmethod
    def create(cls, config, loaded) -> Proposer:
        """The proposer for this engine (``loaded``: the target model); most need neither."""
        return cls()

    def observe(self, request_id: str, position: int, states: torch.Tensor) -> None:  # noqa: B027 - optional
        """The target's final hidden states of a request's confirmed positions ``position ..``
        (only called where ``wants_hidden``; most proposers read tokens only)."""

    @abstractmethod
    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens`` (the request's prompt and output so far)."""

    def propose_scored(self, request_id: str, tokens: list[int], k: int) -> tuple[list[int], int]:
        """``propose``, with the evidence for the guesses: how many of the latest tokens the
        context they continue matched (0: the proposer does not say). A lookup's guesses after
        a long match land far more often than after two tokens, whatever request asks, so the
        engine learns how often guesses land per evidence (``engine/speculation.py``)."""
        return self.propose(request_id, tokens, k), 0

    @abstractmethod
    def reset(self) -> None:
        """Forget what was learned across requests (a benchmark run starts from nothing)."""

    def propose_all(self, asks: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """``propose`` for each (request id, tokens, k) of a step; a proposer that runs a model
        batches them."""
        return [self.propose(request_id, tokens, k) for request_id, tokens, k in asks]

    @abstractmethod
    def forget(self, request_id: str, output: list[int]) -> None:
        """The request ended (or moved) with ``output``: drop what was kept for it (a
        proposer may learn from the answer)."""


PROPOSERS = {
    "ngram": ("xlserve.speculative.ngram", "NgramProposer"),
    "suffix": ("xlserve.speculative.suffix", "SuffixProposer"),
    "draft": ("xlserve.speculative.draft", "DraftProposer"),
    "eagle": ("xlserve.speculative.eagle", "EagleProposer"),
    "grammar": ("xlserve.speculative.grammar", "GrammarProposer"),
}


def make_proposer(config, loaded) -> Proposer | None:
    """The proposer ``config.speculative.speculative`` names (None for "none"), for the target
    model ``loaded``."""
    name = config.speculative.speculative
    if name == "none":
        return None
    module, cls = PROPOSERS[name]
    return getattr(importlib.import_module(module), cls).create(config, loaded)
