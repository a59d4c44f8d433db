"""Prompt lookup (``--speculative ngram``): the tokens that followed the latest earlier
occurrence of the request's last n tokens (n from 4 down to 2) in its own prompt and
output. Agents repeat what is in their context — file contents, names, JSON keys — so a
match often runs for many tokens.

Each request keeps an index from every n-gram to where it last ended, extended by the new
tokens only, so a proposal costs a few dictionary lookups however long the context.
"""

from __future__ import annotations

from xlserve.speculative.proposer import Proposer

SIZES = (4, 3, 2)  # longest first: a longer match is likelier to continue the same way


class NgramProposer(Proposer):
    name = "ngram"
    guesses_ahead = True

    def __init__(self):
        self.indexes: dict[str, tuple[dict, list[int]]] = {}  # request -> (n-gram -> last end, [indexed])

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        return self.propose_scored(request_id, tokens, k)[0]

    def propose_scored(self, request_id: str, tokens: list[int], k: int) -> tuple[list[int], int]:
        """The guesses and the n of the n-gram they follow."""
        index, done = self.indexes.setdefault(request_id, ({}, [0]))
        end = len(tokens) - 1  # n-grams ending before the last token: the last one's own is no match
        for e in range(max(done[0], min(SIZES) - 1), end):
            for n in SIZES:
                if e >= n - 1:
                    index[tuple(tokens[e - n + 1:e + 1])] = e
        done[0] = max(done[0], end)
        for n in SIZES:
            if len(tokens) >= n:
                found = index.get(tuple(tokens[-n:]))
                if found is not None:
                    return tokens[found + 1:found + 1 + k], n
        return [], 0

    def reset(self) -> None:
        """Nothing is shared across requests."""

    def forget(self, request_id: str, output: list[int]) -> None:
        self.indexes.pop(request_id, None)
