"""Forced runs only (``--speculative grammar``): no guesses. Under a grammar (a forced tool
call, a JSON schema) the tokens it forces from a request's state (a call's envelope, an
object's keys and separators) are proposed and checked in one step, as every proposer's
chains lead with them (``engine/speculation.py: ProposalChain``); what the grammar leaves
open is decoded a token a step. Requests without a grammar decode as with ``none``.

Jump-forward decoding, through the same check as any proposal: a forced token lands where the
grammar admits it alone (the head skipped there: ``RequestSampling.grammar_rows``), and where
the grammar admits others too, the model's own choice among them decides, so the output is
the model's either way. On bench spec's tool calls it keeps up with the guessing proposers
(docs/benchmarks.md): the forced runs carry most of their speedup there.
"""

from __future__ import annotations

from xlserve.speculative.proposer import Proposer


class GrammarProposer(Proposer):
    name = "grammar"
    guesses = False  # the planner gives it no guess rows; forced runs alone

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        return []

    def reset(self) -> None:
        pass

    def forget(self, request_id: str, output: list[int]) -> None:
        pass
