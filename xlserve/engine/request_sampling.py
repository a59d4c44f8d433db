"""Each request's sampling state across steps: its seeded generator and its grammar matcher.

The model runner hands a step's sampling rows here; a request's tokens come back, or why
it cannot go on. Nothing here depends on the batch: a draw is seeded from (request seed,
output position), so a seeded answer is the same alone, batched, preempted, or split
over prefill and decode workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from xlserve.engine.errors import FATAL_ERRORS, RequestError, describe
from xlserve.engine.guided import GuidedDecoding
from xlserve.engine.sampler import Sampler, apply_penalties
from xlserve.engine.scheduler import ScheduledRequest
from xlserve.speculative.verifier import verify


@dataclass(frozen=True)
class GrammarRows:
    """What a step's grammars decide before the head runs (``RequestSampling.grammar_rows``).

    ``masks``: request id -> the masks of its rows in order (row i's after the step's first i
    proposals), walked while the proposals stand. ``fixed``: sampling row (its index among
    the step's logits) -> the one token that row can give, for rows that need no logits: the
    grammar admits a single token there, or the row lies past a proposal the grammar forbids
    and is never read. Holds only for requests without logprobs."""
    masks: dict[str, list[bytes]] = field(default_factory=dict)
    fixed: dict[int, int] = field(default_factory=dict)


class RequestSampling:
    def __init__(self, guided: GuidedDecoding | None = None):
        self.sampler = Sampler()
        self.guided = guided
        self.generators: dict[str, tuple[int, torch.Generator]] = {}
        self.matchers: dict[str, object] = {}  # request id -> grammar matcher

    def forget(self, request_id: str) -> None:
        """A finished request's state goes."""
        self.generators.pop(request_id, None)
        self.matchers.pop(request_id, None)

    def grammar_rows(self, requests: list[ScheduledRequest]) -> GrammarRows:
        """Before the head: the masks of each request under a grammar (without logprobs) along
        its proposals, and the rows whose token they fix alone. On the agentic workload's forced
        tool calls the default model's grammar admits one token at 75% of the answers' positions
        (the envelope, the keys, the separators), so those rows skip the head (49,152 x 576
        multiply-adds a row). Greedy or sampled alike: a row that admits one token gives it
        whatever the logits, bias, penalties or temperature, and skipping its draw moves no
        other draw (each is seeded by its own output position). A request whose walk fails is
        left to ``sample``, which reports it."""
        out, first = GrammarRows(), 0
        for s in requests:
            rows = range(first, first + 1 + s.num_proposed)
            first = rows.stop
            params = s.params
            if params.guided is None or params.logprobs is not None:
                continue
            matcher, consumed, walked = None, 0, []
            proposed = s.token_ids[len(s.token_ids) - s.num_proposed:]
            try:
                matcher = self._matcher(s)
                for i, row in enumerate(rows):
                    walked.append(matcher.compute_bitmask())
                    only = self.guided.only_token(walked[-1])
                    if only is not None:
                        out.fixed[row] = only
                    if i == len(proposed) or not self.guided.admits(walked[-1], proposed[i]):
                        out.fixed.update((r, 0) for r in rows[i + 1:])  # never read: the step ends at row i
                        break
                    if not matcher.consume_token(proposed[i]):
                        raise RequestError(f"the grammar refused the token {proposed[i]} it admitted")
                    consumed += 1
            except FATAL_ERRORS:
                raise
            except Exception:  # noqa: BLE001 - ``sample`` meets the same fault and attributes it
                for r in rows:
                    out.fixed.pop(r, None)
                continue
            finally:
                if consumed:
                    matcher.rollback(consumed)
            out.masks[s.request_id] = walked
        return out

    def sample(self, logits: torch.Tensor, requests: list[ScheduledRequest],
               sampled: dict[str, list[int]], logprobs: dict[str, list[dict]], errors: dict[str, str],
               grammar: GrammarRows | None = None) -> None:
        """Each request's tokens from its rows (one, or one more than its proposals) into
        ``sampled`` (and ``logprobs``); a row that fails ends only its own request (``errors``).
        ``grammar``: ``grammar_rows`` of these requests, when the head ran after it."""
        masks = grammar.masks if grammar is not None else {}
        greedy, finite = _greedy_tokens(logits)
        first = 0
        for s in requests:
            rows = range(first, first + 1 + s.num_proposed)
            first = rows.stop
            try:
                if not all(finite[i] for i in rows):
                    raise RequestError("the model produced non-finite logits for this request")
                tokens = self._sample_rows(logits[rows.start:rows.stop], s, greedy[rows.start:rows.stop],
                                           masks.get(s.request_id, []))
            except FATAL_ERRORS:
                raise
            except Exception as e:  # noqa: BLE001 - attributed to this request alone
                errors[s.request_id] = describe(e)
                continue
            sampled[s.request_id] = tokens
            if s.params.logprobs is not None:
                logprobs[s.request_id] = [self.sampler.logprobs(logits[i], token, s.params.logprobs)
                                          for i, token in zip(rows, tokens)]

    def _sample_rows(self, rows: torch.Tensor, s: ScheduledRequest, greedy: list[int],
                     masks: list[bytes] = ()) -> list[int]:
        """One token, or the proposals the rows confirm and the model's next (``verify``)."""
        proposed = s.token_ids[len(s.token_ids) - s.num_proposed:]
        params = s.params
        plain_greedy = params.greedy and not params.logit_bias and not params.has_penalties
        if plain_greedy and params.guided is None:
            kept = next((i for i, (p, g) in enumerate(zip(proposed, greedy)) if p != g), len(proposed))
            return proposed[:kept] + [greedy[kept]]  # the argmaxes are at hand
        matcher = self._matcher(s) if params.guided is not None else None
        if plain_greedy:
            return self._greedy_guided(rows, matcher, proposed, greedy, masks)
        return verify(rows, proposed, params, lambda i: self._generator(s, i), self.sampler,
                      lambda row, before: self._prepare(row, s, matcher, before, masks),
                      matcher.consume_token if matcher is not None else lambda token: None)

    def _greedy_guided(self, rows: torch.Tensor, matcher, proposed: list[int], greedy: list[int],
                       masks: list[bytes]) -> list[int]:
        """``verify``'s greedy rule under a grammar, masking only the rows that need it: where
        the grammar admits a row's argmax (at hand), that first maximum is also the first among
        the admitted tokens; where not, the first maximum among them (``best_allowed``). One
        mask a row (``compute_bitmask``, about 18 us), or the one ``grammar_rows`` walked: the
        same state, as this walk follows the same proposals."""
        out: list[int] = []
        for i, best in enumerate(greedy[:len(proposed) + 1]):
            bitmask = masks[i] if i < len(masks) else matcher.compute_bitmask()
            token = best if self.guided.admits(bitmask, best) else self.guided.best_allowed(bitmask, rows[i])
            matcher.consume_token(token)
            out.append(token)
            if i == len(proposed) or token != proposed[i]:
                return out
        return out

    def _prepare(self, row: torch.Tensor, s: ScheduledRequest, matcher, before: list[int],
                 masks: list[bytes] = ()) -> torch.Tensor:
        """A row as the request's sampling sees it after ``before`` (the step's tokens so far):
        logit bias, the grammar's mask, penalties over the output with those tokens. ``masks``:
        ``grammar_rows``' walk, whose i-th mask is the state after i proposals, and ``verify``
        prepares a row only while every proposal before it stands."""
        params = s.params
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            row = row.index_add(0, torch.tensor(ids, device=row.device),
                                torch.tensor(values, dtype=row.dtype, device=row.device))
        if matcher is not None:
            walked = masks[len(before)] if len(before) < len(masks) else None
            row = row.masked_fill(~self.guided.allowed(matcher, walked).to(row.device), float("-inf"))
        if params.has_penalties:
            row = apply_penalties(row.clone(), params, s.prompt_token_ids or [], (s.output_token_ids or []) + before)
        return row

    def _matcher(self, s: ScheduledRequest):
        matcher = self.matchers.get(s.request_id)
        if matcher is None:
            matcher = self.matchers[s.request_id] = self.guided.matcher(s.params.guided)
        return matcher

    def grammar_continuation(self, request_id: str, tokens: list[int]) -> tuple[int, list[int]]:
        """How many of ``tokens`` the request's grammar admits from its state, and the tokens it
        forces after those (llguidance's fast-forward tokens); the state is left as it was.
        Before the request's first sampled token it has no grammar state: all admitted, none
        forced."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return len(tokens), []
        admitted = matcher.try_consume_tokens(tokens) if tokens else 0
        forced = list(matcher.compute_ff_tokens())
        if admitted:
            matcher.rollback(admitted)
        return admitted, forced

    def resume_guided(self, request_id: str, params, tokens: tuple[int, ...]) -> None:
        """Bring a resumed request's grammar state past the output it already has."""
        matcher = self.matchers[request_id] = self.guided.matcher(params.guided)
        for token in tokens:
            if not matcher.consume_token(token):
                self.matchers.pop(request_id)
                raise ValueError(f"the resumed output token {token} is not allowed by the {params.guided.kind} "
                                 f"constraint")

    def _generator(self, s: ScheduledRequest, offset: int = 0) -> torch.Generator:
        """The generator for this draw, seeded from (request seed, output position; ``offset``:
        the token's place among those the step emits)."""
        entry = self.generators.get(s.request_id)
        if entry is None:
            base = s.seed if s.seed is not None else int(torch.randint(0, 2**62, (1,)))
            entry = self.generators[s.request_id] = (base, torch.Generator())
        base, gen = entry
        gen.manual_seed(_mix(base, s.output_index + offset))
        return gen


def _greedy_tokens(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Each row's first maximum (argmax's token) and whether that maximum is finite: a NaN or
    +inf anywhere in a row is its first maximum (both argmaxes take NaN as the largest), so
    this costs no extra pass over the vocabulary. On the CPU numpy's vectorized argmax: 3 us
    for one 49,152-token row where torch's max takes 44, 25 against 190 for 8 rows."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        values = logits.numpy()
        tokens = values.argmax(-1)
        return tokens.tolist(), np.isfinite(values[np.arange(len(values)), tokens]).tolist()
    top = logits.max(-1)
    return top.indices.tolist(), torch.isfinite(top.values).tolist()


def _mix(seed: int, index: int) -> int:
    """SplitMix64 finalizer of (seed, index): nearby positions get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
