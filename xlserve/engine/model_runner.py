"""Model runner: owns the model, the paged KV cache and the sampler.

Takes a ``SchedulerOutput`` (plain data), builds the flat batch and the attention
metadata, runs the forward, samples, and returns a ``RunnerOutput`` (plain data).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from xlserve.engine.cuda_graph import DecodeGraphs
from xlserve.engine.decode_plan import DecodePath, StepShape, plan_decode
from xlserve.engine.guided import GuidedDecoding
from xlserve.engine.kv_groups import KVGroup, plan_groups
from xlserve.engine.request_sampling import GrammarRows, RequestSampling
from xlserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from xlserve.kernels import cpu_ops, portable_library
from xlserve.layers.attention import AttentionMetadata, PrefillChunk, additive_mask, host_decode_context
from xlserve.layers.moe import SparseMoE
from xlserve.loader.model_loader import LoadedModel
from xlserve.models.arch import FEATURES
from xlserve.parallel import expert_exchange, pipeline_parallel, tensor_parallel
from xlserve.parallel.pipeline_parallel import micro_batches
from xlserve.parallel.ranks import out_of_step


@dataclass(frozen=True)
class RunnerOutput:
    # request id -> the tokens it emits: one, or under speculation the accepted proposals and one more
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict]] = field(default_factory=dict)  # one per emitted token
    errors: dict[str, str] = field(default_factory=dict)  # request id -> why it cannot go on
    decode_path: DecodePath | None = None  # the path the step's forward took
    # request id -> the final hidden state of each token it computed (only with ``keep_hidden``)
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)
    head_rows_skipped: int = 0  # sampling rows the head did not compute (``GrammarRows.fixed``)

    def merge(self, other: "RunnerOutput") -> None:
        self.sampled.update(other.sampled)
        self.logprobs.update(other.logprobs)
        self.errors.update(other.errors)
        self.hidden.update(other.hidden)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int,
                 guided: GuidedDecoding | None = None, cuda_graphs: bool = False, max_context: int = 0,
                 announce: Callable[[SchedulerOutput, DecodePath, bool], None] | None = None):
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = block_size
        # several ranks, rank 0: tells the others each step before running its own part
        self.announce = announce
        self.tp, self.stage = tensor_parallel.current(), pipeline_parallel.current()
        self.exchange = expert_exchange.current()  # data-parallel attention: each rank runs its own rows
        # what a rank without rows of its own still runs: its experts, for the others' tokens
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, SparseMoE)] if self.exchange.active else []
        arch = self.arch = loaded.arch
        self.dtype = loaded.dtype
        self.deterministic = loaded.deterministic
        num_slots = num_blocks * block_size
        # one more block than the pool hands out: the scratch block that padding rows of a
        # CUDA graph write to; this rank's KV heads only
        spec = self.kv_spec = self.tp.kv_cache_spec(arch.kv_cache_spec)
        self.kv_plan = plan_groups(arch)
        shape = (num_slots + block_size, spec.heads, spec.dim)
        # One tensor per part and layer slot of a block (every layer, unless windowed layer
        # groups share the slots: engine/kv_groups.py); a pipeline stage only its layers'
        # slots (None: another stage's). torch.empty: pages of an untouched pool are never
        # faulted in on the CPU.
        held = set(self.kv_plan.slots_of(self.stage.layers(arch.num_layers)))
        self.kv_caches = [tuple(torch.empty(shape, dtype=loaded.dtype, device=self.device) for _ in range(spec.parts))
                          if slot in held else None for slot in range(self.kv_plan.width)]
        placement = self.kv_plan.placement(arch.num_layers)
        self.model.bind_kv_cache([self.kv_caches[slot] for _, slot in placement], [g for g, _ in placement])
        self.kv_bytes = num_slots * spec.bytes_per_token(len(held), loaded.dtype.itemsize)
        self.fused_shapes = cpu_ops.supports_shape(arch.num_heads, arch.num_kv_heads, arch.head_dim)
        # a model that does not say which features it uses may use all of them: no fast CPU path
        self.features = getattr(self.model, "features", FEATURES)
        self.sampling = RequestSampling(guided)  # each request's generator and grammar matcher
        self.keep_hidden = False  # an EAGLE head reads the hidden states: each step returns them
        self.graphs = None
        # graphs do not capture the ranks' collectives
        single = self.single_rank = self.tp.size == 1 and self.stage.count == 1 and not self.exchange.active
        if cuda_graphs and self.device.type == "cuda" and not self.kv_plan.windowed and single:  # group 0 only
            self.graphs = DecodeGraphs(self.model, self.device, self.dtype, block_size, num_blocks,
                                       max_context or arch.max_position_embeddings)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _kernels_apply(self) -> bool:
        """Whether this step can use the CPU kernels; checked per step, as they can be
        switched off (``cpu_ops.set_enabled``). Not under tensor or pipeline parallelism: the
        fused layer kernels hold whole layers, not slices, and the one-call decode every layer."""
        return (self.fused_shapes and self.tp.size == 1 and self.stage.count == 1 and self.device.type == "cpu"
                and not self.deterministic  # the fused decode kernels reduce a decode row unlike a prompt row
                and cpu_ops.kernels() is not None and self.dtype in (torch.bfloat16, torch.float32))

    def _portable_step_applies(self) -> bool:
        """The portable one-call decode step takes this model: one rank on the CPU, the kernels
        built, every layer one it computes as the eager path does (weights kept quantized, or
        dense under ``--deterministic``; the AVX-512 one-call layer, where it applies, comes
        first: ``plan_decode``). Allowed under ``--deterministic``: the same bits. On a 2-core
        AVX-512 Xeon, the default model (Q4_1 kept) decodes at 17.9 ms a step at batch 1 on it,
        24.6 per layer from Python with the AVX-512 decode kernels."""
        fits = getattr(self.model, "step_fits", None)
        return (self.tp.size == 1 and self.stage.count == 1 and self.device.type == "cpu" and fits is not None
                and self.dtype in (torch.bfloat16, torch.float32)
                and portable_library.kernels() is not None and fits())

    def _contiguous_start(self, block_ids: list[int], tokens: int) -> int | None:
        """First slot of the first ``tokens`` positions when they lie in consecutive blocks
        (then attention reads the cache in place instead of gathering it), else None."""
        used = -(-tokens // self.block_size)
        first = block_ids[0]
        if block_ids[:used] == list(range(first, first + used)):
            return first * self.block_size
        return None

    def plan(self, scheduled: list[ScheduledRequest], cpu_kernels: bool) -> DecodePath:
        """The path of this step's forward, decided once (see ``engine/decode_plan.py``);
        ``cpu_kernels``: ``_kernels_apply()`` for this step."""
        decode_only = all(len(s.token_ids) == 1 for s in scheduled)
        rows = len(scheduled)
        one_call = getattr(self.model, "one_call_fits", None)
        step = StepShape(decode_only, rows, graph_fits=self._graph_fits(scheduled), cpu_kernels=cpu_kernels,
                         one_call_fits=decode_only and one_call is not None and one_call(rows),
                         portable_fits=decode_only and self._portable_step_applies())
        return plan_decode(step, self.features, cpu_ops.MAX_ROWS, cpu_ops.PORTABLE_MAX_ROWS)

    def _build_metadata(self, scheduled: list[ScheduledRequest], path: DecodePath,
                        cpu_kernels: bool) -> AttentionMetadata:
        slot_parts, decode, prefills = [], [], []
        row = 0
        for s in scheduled:
            n, start = len(s.token_ids), s.start_position
            if n == 1:
                decode.append((row, s))
                row += 1
                continue
            slot_parts.append(self._slots(s.block_ids, start, start + n))
            if start == 0:
                prefills.append(PrefillChunk(row, row + n))
            else:
                prefills.append(PrefillChunk(row, row + n, self._slots(s.block_ids, 0, start + n).to(self.device),
                                             self._contiguous_start(s.block_ids, start)))
            row += n
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), prefills=prefills,
                                 cpu_kernels=cpu_kernels, decode_path=path)
        if decode:
            self._decode_metadata(meta, decode)
        # rows in batch order: decode rows carry one slot each, at their place among the chunks
        meta.slot_mapping = self._ordered_slots(scheduled, slot_parts, meta).to(self.device)
        for g, group in enumerate(self.kv_plan.groups[1:], start=1):
            meta.groups[g] = self._window_metadata(scheduled, g, group, meta)
        return meta

    def _window_metadata(self, scheduled: list[ScheduledRequest], g: int, group: KVGroup,
                         base: AttentionMetadata) -> AttentionMetadata:
        """A windowed layer group's metadata: its own table, contexts from the window's first
        position (the blocks before it are freed), and decode rows over their window only."""
        window, slots, prefills, decode = group.window, [], [], []
        row = 0
        for s in scheduled:
            table, n, start = s.window_block_ids[g - 1], len(s.token_ids), s.start_position
            slots.append(self._slots(table, start, start + n))
            first = window.first_key(start)  # the earliest key this step's queries read
            if n == 1:
                decode.append((table, start + 1, first))
            else:
                context = None if start == 0 else self._slots(table, first, start + n).to(self.device)
                prefills.append(PrefillChunk(row, row + n, context, context_start=first))
            row += n
        meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(self.device), prefills=prefills,
                                 decode_rows=base.decode_rows, decode_lens=base.decode_lens)
        if decode:  # each row over its window only: from its first kept position to the new token
            firsts = [f for _, _, f in decode]
            table, real, _ = host_decode_context([t for t, _, _ in decode], [n for _, n, _ in decode],
                                                 self.block_size, firsts)
            meta.decode_slots = torch.from_numpy(table).to(self.device)
            meta.decode_firsts = torch.tensor(firsts, device=self.device)
            meta.decode_mask = additive_mask(torch.from_numpy(real).view(len(decode), 1, 1, -1).to(self.device),
                                             self.dtype)
            meta.window_masks[window] = meta.decode_mask  # every slot listed is inside the window
        return meta

    def _decode_metadata(self, meta: AttentionMetadata, decode: list) -> None:
        """Context slots of every one-token sequence, built on the host (``host_decode_context``)."""
        lens = [s.start_position + 1 for _, s in decode]
        slots, real, new_slots = host_decode_context([s.block_ids for _, s in decode], lens, self.block_size)
        meta.decode_new_slots = torch.from_numpy(new_slots)
        meta.decode_rows = torch.tensor([r for r, _ in decode], device=self.device)
        meta.decode_lens = torch.tensor(lens, device=self.device)
        meta.decode_slots = torch.from_numpy(slots).to(self.device)
        if meta.masks_decode:
            meta.decode_mask = additive_mask(torch.from_numpy(real).view(len(decode), 1, 1, -1).to(self.device),
                                             self.dtype)

    @staticmethod
    def _ordered_slots(scheduled: list[ScheduledRequest], chunk_slots: list, meta: AttentionMetadata) -> torch.Tensor:
        if meta.decode_rows is None:
            return torch.cat(chunk_slots)
        if not chunk_slots:
            return meta.decode_new_slots
        parts, chunks, decodes = [], iter(chunk_slots), iter(meta.decode_new_slots.split(1))
        for s in scheduled:
            parts.append(next(decodes) if len(s.token_ids) == 1 else next(chunks))
        return torch.cat(parts)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        for request_id in output.finished_request_ids:
            self.sampling.forget(request_id)
        if not output.scheduled:
            return RunnerOutput()
        # rows that check proposals take the CPU kernels too: each writes every row's K/V before
        # any row attends (decode_attention.c, decode_step.c), and a row reads up to its own position
        cpu_kernels = self._kernels_apply()
        if self.exchange.active:  # every rank runs its own rows (or none) and rank 0 samples them all
            with out_of_step():
                self.announce(output, DecodePath.EAGER, cpu_kernels)
                logits, sampling, path = self._forward_own_rows(output.scheduled, cpu_kernels)
            return RunnerOutput(decode_path=path) if logits is None else self._sample(logits, sampling, path)
        rows = as_rows(output.scheduled)
        path = self.plan(rows, cpu_kernels)
        if path is DecodePath.CUDA_GRAPH:
            logits = self.graphs.logits([s.token_ids[0] for s in rows], [s.start_position for s in rows],
                                        [s.block_ids for s in rows])
            return self._sample(logits[:len(rows)], output.scheduled, path)
        # rows a grammar decides alone skip the head, on one rank: with several, rank 0 alone
        # holds the matchers and the others would compute other head rows
        grammar = self.sampling.grammar_rows([s for s in output.scheduled if s.sample]) \
            if self.single_rank else GrammarRows()
        if self.announce is not None:  # every rank runs the forward, or none can go on
            with out_of_step():
                self.announce(output, path, cpu_kernels)
                logits, sampling = self._forward(output.scheduled, path, cpu_kernels, grammar.fixed)
        else:
            logits, sampling = self._forward(output.scheduled, path, cpu_kernels, grammar.fixed)
        out = RunnerOutput(decode_path=path) if logits is None else self._sample(logits, sampling, path, grammar)
        if self.keep_hidden:
            rows = torch.tensor([0] + [len(s.token_ids) for s in output.scheduled]).cumsum(0).tolist()
            out.hidden.update({s.request_id: self.last_hidden[start:end]
                               for s, start, end in zip(output.scheduled, rows, rows[1:])})
        return out

    @torch.inference_mode()
    def follow(self, scheduled: list[ScheduledRequest], path: DecodePath, cpu_kernels: bool) -> None:
        """A rank other than 0: rank 0's step on this rank's part (logits included where it
        computes them: they go to rank 0, which samples)."""
        if self.exchange.active:
            self._forward_own_rows(scheduled, cpu_kernels)
        else:
            self._forward(scheduled, path, cpu_kernels)

    def _forward_own_rows(self, scheduled: list[ScheduledRequest],
                          cpu_kernels: bool) -> tuple[torch.Tensor | None, list[ScheduledRequest], DecodePath]:
        """Data-parallel attention: this rank's chunks through the model on the path it plans for
        them, or only its experts for the others' tokens when it has none; the sampling rows'
        logits of every rank to rank 0 (with the chunks they belong to, in rank order)."""
        exchange, path, logits = self.exchange, DecodePath.EAGER, None
        mine = [s for s in scheduled if s.dp_rank == exchange.rank]
        if mine:
            path = self.plan(as_rows(mine), cpu_kernels)
            logits, _ = self._forward(mine, path, cpu_kernels)
        else:
            for moe in self.moe_layers:  # the same exchanges, in the same order, as a forward makes
                moe(torch.empty(0, self.arch.hidden_size, dtype=self.dtype, device=self.device))
        sampling = [[s for s in scheduled if s.dp_rank == r and s.sample] for r in range(exchange.size)]
        counts = [sum(1 + s.num_proposed for s in chunks) for chunks in sampling]
        logits = exchange.gather_logits(logits, counts, self.arch.vocab_size, self.device)
        return logits, [s for chunks in sampling for s in chunks], path

    def _forward(self, scheduled: list[ScheduledRequest], path: DecodePath, cpu_kernels: bool,
                 fixed: dict[int, int] | None = None) -> tuple[torch.Tensor | None, list[ScheduledRequest]]:
        """The step's forward; the logits of the rows that sample (None: none does); ``fixed``:
        ``GrammarRows.fixed``, sampling rows that get a stand-in instead of the head's logits."""
        if self.stage.count > 1:
            return self._forward_stages(scheduled, path, cpu_kernels)
        hidden, sampling, rows = self._run_layers(scheduled, path, cpu_kernels)
        if self.keep_hidden:
            self.last_hidden = hidden
        if not sampling:
            return None, []
        return self._logits(hidden, rows, fixed or {}), sampling

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor, fixed: dict[int, int]) -> torch.Tensor:
        """The head on the sampling ``rows`` of ``hidden``, but where ``fixed`` gives a row's
        token: that row is 0 there and -inf elsewhere (its argmax, the grammar's one token), as
        the head's row would be after the grammar's mask."""
        if not fixed:
            return self.model.compute_logits(hidden[rows])
        logits = torch.full((len(rows), self.arch.vocab_size), float("-inf"), device=self.device)
        computed = [i for i in range(len(rows)) if i not in fixed]
        if computed:
            logits[computed] = self.model.compute_logits(hidden[rows[computed]])
        logits[list(fixed), list(fixed.values())] = 0.0
        return logits

    def _run_layers(self, scheduled: list[ScheduledRequest], path: DecodePath, cpu_kernels: bool,
                    hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, list[ScheduledRequest], torch.Tensor]:
        """This rank's layers over the chunks (from ``hidden``: the previous stage's output):
        their output, the requests that sample and their rows in it."""
        ids, positions, last_rows = [], [], []
        for s in scheduled:
            ids.extend(s.token_ids)
            positions.extend(range(s.start_position, s.start_position + len(s.token_ids)))
            last_rows.append(len(ids) - 1)
        meta = self._build_metadata(as_rows(scheduled), path, cpu_kernels)
        out = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), meta,
                         hidden)
        sampling = [(s, r) for s, r in zip(scheduled, last_rows) if s.sample]
        # a request checking k proposals samples from its last k + 1 rows
        rows = [row for s, last in sampling for row in range(last - s.num_proposed, last + 1)]
        return out, [s for s, _ in sampling], torch.tensor(rows, device=self.device)

    def _forward_stages(self, scheduled: list[ScheduledRequest], path: DecodePath,
                        cpu_kernels: bool) -> tuple[torch.Tensor | None, list[ScheduledRequest]]:
        """Pipeline parallel: the step's micro-batches through this stage, each passed on as
        soon as it is done, so the next stage works on it while this one computes the next.
        The last stage sends the sampling rows' logits to rank 0; rank 0 returns them."""
        stage, sends, sampled = self.stage, [], []
        for tag, batch in enumerate(micro_batches(scheduled, stage.count)):
            hidden = None if stage.first else stage.receive_hidden(
                sum(len(s.token_ids) for s in batch), self.arch.hidden_size, self.dtype, self.device, tag)
            out, sampling, rows = self._run_layers(batch, path, cpu_kernels, hidden)
            if not stage.last:
                sends.append(stage.send_hidden(out, tag))
            elif sampling:  # every rank of the last stage: the head's all-gather needs them all
                logits = self.model.compute_logits(out[rows])
                if stage.sends_logits:
                    sends.append(stage.send_logits(logits, tag))
            sampled.append(sampling)
        for work in sends:
            work.wait()
        if self.announce is None or not any(sampled):  # only rank 0 samples
            return None, []
        logits = [stage.receive_logits(sum(1 + r.num_proposed for r in s), self.arch.vocab_size, self.device, tag)
                  for tag, s in enumerate(sampled) if s]
        return torch.cat(logits), [s for batch in sampled for s in batch]

    def _graph_fits(self, scheduled: list[ScheduledRequest]) -> bool:
        """A decode-only step that a CUDA graph can replay."""
        return (self.graphs is not None and not self.keep_hidden  # a graph returns logits only
                and all(len(s.token_ids) == 1 and s.sample for s in scheduled)
                and self.graphs.supports(len(scheduled), max(s.start_position for s in scheduled) + 1))

    def _sample(self, logits: torch.Tensor, requests: list[ScheduledRequest],
                path: DecodePath | None = None, grammar: GrammarRows | None = None) -> RunnerOutput:
        out = RunnerOutput(decode_path=path, head_rows_skipped=len(grammar.fixed) if grammar is not None else 0)
        self.sampling.sample(logits, requests, out.sampled, out.logprobs, out.errors, grammar)
        return out


def as_rows(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The step as attention sees it: a chunk that checks proposals is a decode row per token
    (the batched decode attention, each row over the context up to itself: every row's K/V is
    written before any row reads), the same tokens in the same order."""
    if not any(s.num_proposed for s in scheduled):
        return scheduled
    rows = []
    for s in scheduled:
        rows += [dataclasses.replace(s, token_ids=[token], start_position=s.start_position + i, num_proposed=0)
                 for i, token in enumerate(s.token_ids)] if s.num_proposed else [s]
    return rows
