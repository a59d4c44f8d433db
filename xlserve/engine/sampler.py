"""Token sampling: penalties, greedy, temperature / top-k / top-p / min-p, logprobs.

Random draws come from one ``torch.Generator`` per request, so a seeded request samples
the same tokens whatever else shares its batch. Every row is guarded: a draw whose
probabilities are not finite (extreme parameters) falls back to the greedy token of the
same logits, and a row with no allowed token ends its request with a ``RequestError``.
"""

from __future__ import annotations

import torch

from xlserve.engine.errors import RequestError
from xlserve.sampling_params import SamplingParams


def apply_penalties(row: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    device = row.device
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=device)
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / params.repetition_penalty,
                                    vals * params.repetition_penalty)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        ids = torch.tensor(output_ids, dtype=torch.long, device=device)
        counts = torch.zeros_like(row).scatter_add_(0, ids, torch.ones_like(ids, dtype=row.dtype))
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
    return row


def filter_logits(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masking; returns scaled logits."""
    row = row / params.temperature
    if params.top_k > 0 and params.top_k < row.numel():
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass before it already reaches top_p (keeps at least one)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[0] = False  # the top token always stays, whatever rounding does to the sums
        row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = row.softmax(-1)
        row = row.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return row


def greedy_token(row: torch.Tensor) -> int:
    if not bool((row > float("-inf")).any()):
        raise RequestError("no token is allowed next (every logit is masked)")
    return int(row.argmax())


class Sampler:
    def sample_row(self, row: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                   prompt_ids: list[int] | None, output_ids: list[int] | None) -> int:
        """One token from one row of finite (or masked: -inf) float32 logits."""
        if params.has_penalties:
            row = apply_penalties(row.clone(), params, prompt_ids or [], output_ids or [])
        if params.greedy:
            return greedy_token(row)
        probs = self.probabilities(row, params)
        if probs is None:
            return greedy_token(row)  # the defined fallback when the parameters overflow the math
        return int(torch.multinomial(probs, 1, generator=generator))

    @staticmethod
    def probabilities(row: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
        """The distribution a sampled token is drawn from (on the CPU, where the draws are);
        None when the parameters overflow the math."""
        probs = filter_logits(row, params).softmax(-1)
        if probs.device.type != "cpu":
            probs = probs.cpu()
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
            return None
        return probs

    @staticmethod
    def logprobs(logits_row: torch.Tensor, token_id: int, num_top: int) -> dict:
        logp = torch.log_softmax(logits_row, dim=-1)
        entry = {"token_id": token_id, "logprob": float(logp[token_id]), "top": []}
        if num_top:
            vals, ids = torch.topk(logp, num_top)
            # equal values in token id order, the order greedy picks them in (topk's is arbitrary)
            entry["top"] = sorted(zip(ids.tolist(), vals.tolist()), key=lambda pair: (-pair[1], pair[0]))
        return entry
