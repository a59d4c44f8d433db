"""The engine: one model replica serving many requests.

``step()`` = ``schedule() -> SchedulerOutput -> ModelRunner -> RunnerOutput -> update()``,
then detokenization and stop strings. Not thread-safe: one thread drives it (the
server's engine thread, or ``LLM.generate``).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import time
from typing import Sequence

from xlserve.config import EngineConfig
from xlserve.engine.detokenizer import Detokenizer
from xlserve.engine.errors import FATAL_ERRORS, describe
from xlserve.engine.guided import GuidedDecoding
from xlserve.engine.kv_blocks import DTYPE_NAMES, KVLayout
from xlserve.engine.kv_groups import plan_groups
from xlserve.engine.model_runner import ModelRunner, RunnerOutput
from xlserve.engine.outputs import CompletionOutput, RequestOutput
from xlserve.engine.rank_schedulers import RankSchedulers
from xlserve.engine.request import FinishReason, HandOff, Request
from xlserve.engine.scheduler import Scheduler, SchedulerOutput
from xlserve.engine.speculation import Speculation
from xlserve.hashing import BlockHash, block_hashes
from xlserve.kvstore.tiered import build_tiers
from xlserve.loader.model_loader import LoadedModel, load_model
from xlserve.loader.tokenizer import prompt_token_ids
from xlserve.parallel.pipeline_parallel import balanced_stages
from xlserve.parallel.ranks import WorkerRanks, agree
from xlserve.parallel.tensor_parallel import TensorParallel
from xlserve.sampling_params import SamplingParams
from xlserve.speculative.proposer import make_proposer

log = logging.getLogger(__name__)


def pool_blocks(config: EngineConfig, loaded: LoadedModel) -> int:
    """The KV pool's block count, the same on every rank: each holds its share of the KV heads
    (so --kv-cache-memory GiB per rank hold that many times more tokens), or all of a shared
    entry (MLA's latent), for its pipeline stage's layer slots (the fullest stage sets the count);
    with data-parallel attention every head of its own requests."""
    p, arch = config.parallel, loaded.arch
    heads_split = 1 if p.data_parallel_attention else p.tensor_parallel_size  # each rank its own requests' KV
    rank = TensorParallel(size=heads_split).kv_cache_spec(arch.kv_cache_spec)
    slots = max(len(s) for s in stage_slots(arch, p.pipeline_parallel_size))
    return config.cache.total_blocks(rank.bytes_per_token(slots, loaded.dtype.itemsize))


def stage_slots(arch, stages: int) -> list[list[int]]:
    """The KV layer slots each pipeline stage's pool holds."""
    plan = plan_groups(arch)
    return [plan.slots_of(layers) for layers in balanced_stages(arch, stages)]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.ranks = None  # tensor / pipeline parallel: this process is rank 0 of these
        if config.parallel.world_size > 1:
            self.ranks = WorkerRanks(config)
        try:
            self._start(config, loaded)
        except BaseException:
            self.close()
            raise

    def _start(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        self.loaded = loaded or load_model(config.model)
        self.tokenizer = self.loaded.tokenizer
        if config.model.chat_template and self.tokenizer is not None:
            self.tokenizer.use_chat_template(config.model.chat_template)
        arch = self.loaded.arch
        self.max_model_len = min(config.model.max_model_len or arch.max_position_embeddings,
                                 arch.max_position_embeddings)
        self.block_size = config.cache.block_size
        self.num_blocks = pool_blocks(config, self.loaded)
        if self.ranks is not None:
            agree(self.loaded, self.num_blocks, self.block_size)
            self.ranks.stage_slots = stage_slots(arch, config.parallel.pipeline_parallel_size)
        self.kv_plan = plan_groups(arch)
        self.scheduler = self._scheduler(config)
        self.guided = GuidedDecoding(self.tokenizer, arch.vocab_size) if self.tokenizer else None
        self.runner = ModelRunner(self.loaded, self.num_blocks, self.block_size, self.guided,
                                  config.model.cuda_graphs, self.max_model_len,
                                  self.ranks.send_step if self.ranks else None)
        # Anything that changes the KV of a token sequence goes into the block hash.
        self.extra_key = hashlib.blake2b(
            f"{self.loaded.source.path}|{self.loaded.dtype}".encode(), digest_size=8).digest()
        self.model_name = config.model.served_model_name or self.loaded.source.name
        self.kv = self.scheduler.kv  # the pool's one owner; the engine goes through it
        spec = arch.kv_cache_spec  # a hand-off carries every KV head, whatever the ranks hold
        self.kv.attach(self.runner.kv_caches, KVLayout(
            self.kv_plan.width, self.block_size, spec.heads, spec.dim, DTYPE_NAMES[self.loaded.dtype],
            self.extra_key.hex(), spec.parts, self.kv_plan.windows()), self.ranks)
        tiers = build_tiers(config.tiers, self.kv.layout)
        if tiers is not None:
            try:
                self.kv.attach_tiers(tiers)
            except BaseException:
                tiers.close()
                raise
        proposer = make_proposer(config, self.loaded)
        if proposer is not None and proposer.wants_hidden and config.parallel.data_parallel_attention:
            raise ValueError("--speculative eagle reads hidden states on rank 0; with --data-parallel-attention they "
                             "are on every rank: choose ngram, suffix or draft")
        self.runner.keep_hidden = proposer is not None and proposer.wants_hidden
        self.speculation = Speculation(proposer, config.speculative.num_speculative_tokens)
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else set()
        self._detokenizers: dict[str, Detokenizer | None] = {}
        self.num_steps = 0
        self.steps_by_path: collections.Counter = collections.Counter()  # DecodePath -> steps taken
        self.head_rows_skipped = 0  # sampling rows whose token a grammar decided without the head
        self.num_failed_requests = 0

    def _scheduler(self, config: EngineConfig) -> Scheduler | RankSchedulers:
        """One scheduler for the pool; with data-parallel attention one per rank's pool, all here."""
        def one() -> Scheduler:
            return Scheduler(config.scheduler, config.cache, self.num_blocks, self.max_model_len, self.kv_plan.groups)
        if config.parallel.data_parallel_attention:
            return RankSchedulers([one() for _ in range(config.parallel.world_size)])
        return one()

    def between_steps(self) -> None:
        """What the engine does between steps, also while idle: notice an exited rank
        (``EngineFatal``) and drop expired KV pins. Expiry used to run only inside ``step``,
        so on an idle prefill worker a pin no decode worker pulled held its blocks (and the
        pins gauge) until the next request came; the soak found one after 60 idle seconds."""
        self.check_ranks()
        self.kv.expire_pins()

    def check_ranks(self) -> None:
        """``EngineFatal`` when another tensor-parallel rank has exited (checked between steps,
        so an idle worker notices too)."""
        if self.ranks is not None:
            self.ranks.check()

    def close(self) -> None:
        """Stop the other ranks (a no-op with one); the engine is unusable after."""
        if getattr(self, "kv", None) is not None and (tiers := self.kv.detach_tiers()) is not None:
            tiers.close()
        if self.ranks is not None:
            ranks, self.ranks = self.ranks, None
            ranks.close()

    # -- requests -----------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        return prompt_token_ids(self.tokenizer, prompt)

    def validate_request(self, ids: list[int], params: SamplingParams, handoff: HandOff | None = None) -> None:
        """Refuse what can never run; reads only immutable state, so any thread may call it."""
        vocab = self.loaded.arch.vocab_size
        resumed = list(handoff.resume) if handoff else []
        bad = [t for t in ids + resumed if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids must be in [0, {vocab}); got {bad[:5]}")
        biased = [t for t, _ in params.logit_bias if t >= vocab]
        if biased:
            raise ValueError(f"logit_bias names token ids outside [0, {vocab}): {biased[:5]}")
        if len(resumed) >= params.max_tokens:
            raise ValueError(f"{len(resumed)} resumed output tokens leave nothing to generate under "
                             f"max_tokens={params.max_tokens}")
        if resumed and len(ids) + len(resumed) >= self.max_model_len:
            raise ValueError(f"prompt ({len(ids)}) + resumed output ({len(resumed)}) tokens fill this "
                             f"model's context of {self.max_model_len}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is "
                             f"{self.max_model_len} tokens, so a prompt may have at most "
                             f"{self.max_model_len - 1}")
        need = min(len(ids) + params.max_tokens, self.max_model_len)
        blocks = self.kv.blocks_for(need, self.config.scheduler.max_num_batched_tokens)
        if blocks > self.num_blocks:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) needs {need} "
                             f"tokens of KV cache ({blocks} blocks); the pool holds {self.num_blocks} blocks of "
                             f"{self.block_size} tokens")
        if (params.stop or params.guided) and self.tokenizer is None:
            raise ValueError("stop strings and guided decoding need a tokenizer; this model has none")
        if params.guided is not None:
            self.guided.validate(params.guided)

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    handoff: HandOff | None = None, checked: bool = False) -> Request:
        """Queue a request. ``handoff`` splits one answer over two workers (see ``HandOff``);
        ``checked``: ``validate_request`` already passed (on another thread)."""
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        if not checked:
            self.validate_request(ids, params, handoff)
        request = Request(request_id, ids, params, self.eos_token_ids, self.block_size, self.extra_key, handoff)
        detok = Detokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                            params.skip_special_tokens) if self.tokenizer else None
        resumed = handoff.resume if handoff else ()
        if resumed and params.guided is not None:
            self.runner.sampling.resume_guided(request_id, params, resumed)
        for token in resumed if detok else ():
            detok.add(token)  # the same held-back state the first worker ended with; its text was sent there
        request.num_resumed_chars = detok.emitted if detok else 0
        self._detokenizers[request_id] = detok
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.finish(request_id, FinishReason.ABORT)
        if req is None:
            return None
        return self._output(req, "", [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the step -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. A failure that one request brings on ends that request (its
        output carries ``error``); only ``FATAL_ERRORS`` and broken engine state raise."""
        step_started = time.monotonic()
        self.kv.expire_pins()
        outputs = self._refuse_overdue()
        sched_out = self.scheduler.schedule()
        if not sched_out.scheduled:
            self.scheduler.wait_for_loads(0.01)  # only tier loads are pending: don't spin
        started = time.monotonic()
        runner_out = self._execute(sched_out)
        forward_seconds = time.monotonic() - started
        if self.kv.tiers is not None:  # what computing a prompt token costs, against what loading it does
            prompt_tokens = sum(len(s.token_ids) for s in sched_out.scheduled if len(s.token_ids) > 1)
            self.kv.tiers.costs.computed(prompt_tokens, time.monotonic() - started)
        if runner_out.decode_path is not None:
            self.steps_by_path[runner_out.decode_path] += 1
        self.head_rows_skipped += runner_out.head_rows_skipped
        outputs += [out for rid, why in runner_out.errors.items() if (out := self._fail(rid, why))]
        speculation = self.speculation
        speculation.record(sched_out, runner_out.sampled)
        speculation.observe(sched_out, runner_out.hidden, runner_out.sampled, runner_out.errors)
        advanced = self.scheduler.update(sched_out, runner_out.sampled, runner_out.logprobs)
        self.num_steps += 1
        for req, count in advanced:
            try:
                new_text, count = self._detokenize(req, count)
            except FATAL_ERRORS:
                raise
            except Exception as e:  # noqa: BLE001 - a tokenizer fault is this request's alone
                outputs.append(self._fail(req.request_id, f"detokenizing failed: {describe(e)}"))
                continue
            outputs.append(self._output(req, new_text, req.output_token_ids[-count:]))
        proposing = speculation.propose(self.scheduler.running, self.max_model_len,
                                        self.runner.sampling.grammar_continuation)
        speculation.time_step(sched_out, forward_seconds, time.monotonic() - step_started, proposing)
        return outputs

    def _execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        """Run the step; if the batch fails, run each request alone to find the ones that
        fail (rewriting a chunk's KV slots is harmless: the step did not advance them)."""
        try:
            return self.runner.execute(sched_out)
        except FATAL_ERRORS:
            raise
        except Exception as e:  # noqa: BLE001 - attributed below
            scheduled = sched_out.scheduled
            if len(scheduled) == 1:
                log.warning("request %s failed in a step: %s", scheduled[0].request_id, describe(e))
                return RunnerOutput(errors={scheduled[0].request_id: describe(e)})
            log.warning("a step of %d requests failed (%s); running each alone", len(scheduled), describe(e))
        merged = RunnerOutput()
        for s in scheduled:
            try:
                merged.merge(self.runner.execute(SchedulerOutput([s], len(s.token_ids))))
            except FATAL_ERRORS:
                raise
            except Exception as e:  # noqa: BLE001 - this request's own failure
                log.warning("request %s failed in a step: %s", s.request_id, describe(e))
                merged.errors[s.request_id] = describe(e)
        return merged

    def _refuse_overdue(self) -> list[RequestOutput]:
        """Requests past ``--queue-timeout`` in the queue end as busy (never run, nothing lost)."""
        timeout = self.config.scheduler.queue_timeout
        if not timeout:
            return []
        refused = []
        for request_id in self.scheduler.overdue(timeout, time.monotonic()):
            req = self.scheduler.finish(request_id, FinishReason.ABORT)
            req.error = f"the request waited more than {timeout:g} s in the queue (--queue-timeout); retry later"
            out = self._output(req, "", [])
            out.retry_after = 1.0
            refused.append(out)
        return refused

    def _fail(self, request_id: str, why: str) -> RequestOutput | None:
        req = self.scheduler.finish(request_id, FinishReason.ERROR)
        if req is None:
            return None
        req.error = why
        self.num_failed_requests += 1
        return self._output(req, "", [])

    def _detokenize(self, req: Request, count: int) -> tuple[str, int]:
        """The text of the request's ``count`` new tokens, one at a time; a stop string ends the
        answer at its token (later ones of the step are dropped). Returns the text and how
        many tokens stay."""
        detok = self._detokenizers.get(req.request_id)
        if detok is None:
            return "", count
        first = req.num_output_tokens - count
        text = ""
        for i in range(count):
            last = i == count - 1
            # A paused request's answer goes on elsewhere: what is held back stays held back.
            text += detok.add(req.output_token_ids[first + i],
                              final=last and req.is_finished and req.finish_reason != FinishReason.PAUSED)
            if detok.stopped:
                req.drop_output_after(first + i + 1)
                if not req.is_finished:
                    self.scheduler.finish(req.request_id, FinishReason.STOP)
                return text, i + 1
        return text, count

    def _output(self, req: Request, new_text: str, new_ids: list[int]) -> RequestOutput:
        detok = self._detokenizers.get(req.request_id)
        if req.is_finished:
            self._detokenizers.pop(req.request_id, None)
            self.speculation.forget(req)
        text = detok.text[req.num_resumed_chars:detok.emitted] if detok else ""
        finish = req.finish_reason.value if req.finish_reason else None
        completion = CompletionOutput(0, text, req.output_token_ids[req.num_resumed_tokens:], finish,
                                      list(req.output_logprobs) if req.params.logprobs is not None else None)
        metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                   "finished_time": time.monotonic() if req.is_finished else None,
                   "num_preemptions": req.num_preemptions}
        return RequestOutput(req.request_id, req.prompt_token_ids, [completion], req.is_finished,
                             max(req.num_cached_tokens, 0), new_text, new_ids, metrics, req.error)

    # -- KV blocks by hash (disaggregation, tiers) ---------------------------------
    def prompt_block_hashes(self, prompt_ids: Sequence[int]) -> list[BlockHash]:
        return block_hashes(list(prompt_ids), self.block_size, self.extra_key)

    def kv_events(self, since: int, epoch: str) -> dict:
        return self.kv.events_since(since, epoch)

    # -- counters -----------------------------------------------------------------
    def stats(self) -> dict:
        kv = self.kv
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_used": kv.num_used_blocks,
            "kv_blocks_total": kv.num_blocks,
            "prefix_cache_queried_tokens": kv.stats.queried_tokens,
            "prefix_cache_hit_tokens": kv.stats.hit_tokens,
            "prefix_cache_hit_ratio": kv.stats.hit_ratio,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_pins": self.kv.num_pins,
            "num_steps": self.num_steps,
            "num_failed_requests": self.num_failed_requests,
            "head_rows_skipped": self.head_rows_skipped,
            "spec_method": self.config.speculative.speculative,
            "spec_proposed_tokens": self.speculation.stats.proposed,
            "spec_accepted_tokens": self.speculation.stats.accepted,
            "spec_acceptance_lengths": dict(self.speculation.stats.lengths),
            "num_loading": len(self.scheduler.loading),
            "kv_tier_timeouts": self.scheduler.num_tier_timeouts,
            "kv_tiers": kv.tiers.stats() if kv.tiers is not None else {},
            "dp_ranks": self.scheduler.shares() if isinstance(self.scheduler, RankSchedulers) else [],
        }
