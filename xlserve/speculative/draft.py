"""A draft model (``--speculative draft --draft-model PATH``): a smaller model with the same
tokenizer proposes greedily, k tokens in k of its own forward passes, each pass batched
over every request that proposes.

The draft keeps its own paged KV per request (a pool of as many tokens as the target's),
valid for the tokens it has seen confirmed; each proposal first catches up on the tokens
accepted since the last one (their KV is recomputed from the first unconfirmed position,
so a rejected guess's KV is overwritten, and after a prefill/decode hand-off the draft
simply computes the prompt it has not seen). A request the draft has no room for gets no
proposal; nothing is preempted for a guess.
"""

from __future__ import annotations

import dataclasses

from xlserve.engine.block_pool import BlockPool, KVBlock
from xlserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from xlserve.sampling_params import SamplingParams
from xlserve.speculative.proposer import Proposer

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class DraftProposer(Proposer):
    name = "draft"

    @classmethod
    def create(cls, config, loaded) -> DraftProposer:
        return cls(config, loaded.arch.vocab_size, loaded.tokenizer)

    def __init__(self, config, target_vocab: int, target_tokenizer=None):
        from xlserve.engine.llm_engine import pool_blocks
        from xlserve.engine.model_runner import ModelRunner
        from xlserve.loader.model_loader import load_model
        spec = config.speculative
        if not spec.draft_model:
            raise ValueError("--speculative draft needs --draft-model: a smaller model with the same tokenizer")
        if config.parallel.world_size > 1:
            raise ValueError("--speculative draft runs on one process; use ngram or suffix with tensor or pipeline "
                             "parallelism")
        self.loaded = load_model(dataclasses.replace(config.model, model=spec.draft_model, cuda_graphs=False))
        _check_same_tokenizer(self.loaded, target_vocab, target_tokenizer)
        self.block_size = config.cache.block_size
        num_blocks = pool_blocks(config, self.loaded)
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.runner = ModelRunner(self.loaded, num_blocks, self.block_size)
        self.blocks: dict[str, list[KVBlock]] = {}
        self.seen: dict[str, int] = {}  # request -> tokens whose draft KV is valid
        self.max_len = self.loaded.arch.max_position_embeddings

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        return self.propose_all([(request_id, tokens, k)])[0]

    def propose_all(self, asks: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """Catch up and guess the first token in one batched pass, then one more token per pass."""
        out: dict[str, list[int]] = {rid: [] for rid, _, _ in asks}
        live = [(rid, tokens, k) for rid, tokens, k in asks if k > 0 and self._room(rid, len(tokens) + k)]
        # from the first token the draft has not confirmed (at least the last: its logits give the guess)
        starts = {rid: min(self.seen.get(rid, 0), len(tokens) - 1) for rid, tokens, _ in live}
        step = [self._chunk(rid, tokens[starts[rid]:], starts[rid]) for rid, tokens, _ in live]
        for rid, tokens, _ in live:
            self.seen[rid] = len(tokens)
        for j in range(max((k for _, _, k in live), default=0)):
            if not step:
                break
            sampled = self.runner.execute(SchedulerOutput(step, sum(len(s.token_ids) for s in step))).sampled
            for rid in sampled:
                out[rid] += sampled[rid]
            step = [self._chunk(rid, out[rid][-1:], len(tokens) + j) for rid, tokens, k in live
                    if rid in sampled and j + 1 < k]
        return [out[rid] for rid, _, _ in asks]

    def reset(self) -> None:
        """Nothing is shared across requests (the draft's weights are not learned here)."""

    def forget(self, request_id: str, output: list[int]) -> None:
        self.pool.free(list(reversed(self.blocks.pop(request_id, []))))
        self.seen.pop(request_id, None)

    def _room(self, request_id: str, tokens: int) -> bool:
        """Blocks for ``tokens`` positions (allocated now), within the draft's context."""
        if tokens > self.max_len:
            return False
        held = self.blocks.setdefault(request_id, [])
        need = -(-tokens // self.block_size) - len(held)
        if need > self.pool.num_free_blocks:
            return False
        if need > 0:
            held += self.pool.allocate(need)
        return True

    def _chunk(self, request_id: str, token_ids: list[int], start: int) -> ScheduledRequest:
        return ScheduledRequest(request_id, token_ids, start, [b.block_id for b in self.blocks[request_id]], True,
                                GREEDY, None, 0)


def _check_same_tokenizer(draft, vocab: int, tokenizer) -> None:
    if draft.arch.vocab_size != vocab:
        raise ValueError(f"the draft model's vocabulary ({draft.arch.vocab_size}) is not the target's ({vocab}): "
                         "a draft must share the target's tokenizer")
    if tokenizer is not None and draft.tokenizer is not None and \
            draft.tokenizer.backend.get_vocab() != tokenizer.backend.get_vocab():
        raise ValueError("the draft model's tokenizer maps tokens to other ids than the target's")
