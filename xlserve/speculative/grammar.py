"""Forced runs only (``--speculative grammar``): no guesses. Under a grammar (a forced tool
call, a JSON schema) the tokens it forces from a request's state (a call's envelope, an
object's keys and separators) are proposed and checked in one step, as every proposer's
chains lead with them (``engine/speculation.py: ProposalChain``); what the grammar leaves
open is decoded a token a step. Requests without a grammar decode as with ``none``.

What is called jump-forward decoding elsewhere, through the same check as any proposal, so a
forced run that a grammar's tokenization would split otherwise is still the model's output.
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
