"""``xlserve train-eagle``: train an EAGLE head (``speculative/eagle_head.py``) for a model on
this machine, from the model's own greedy answers.

1. **Prompts**: agent asks answered with one forced tool call (the four tools of the agentic
   workload, the model's tool-call format under its grammar, as ``tool_choice: required``)
   and free-text asks; made from templates and topics that are not the benchmark's prompts
   (``xlserve bench spec`` measures the head on prompts it never saw).
2. **Answers and states**: the engine answers them greedily in batches while a recorder
   keeps the final hidden state of every position (the states the head reads when serving).
3. **Draft vocabulary**: the ``--draft-vocab`` tokens the model writes most often.
4. **Training**: every position at once, ``--unroll`` guesses deep (each guess fed the
   previous guess's predicted state, attending as it will when serving); loss: the
   target's next token (cross-entropy over the draft vocabulary) plus a tenth of the
   distance to its next state, later guesses weighted 0.8x each. Sequences are packed
   ``--pack-tokens`` at a time; AdamW with a linear decay.
5. The held-out tenth's top-1 accuracy per guess depth is printed and stored in the file's
   metadata, the head written to ``--out``.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from xlserve.config import EagleTrainingConfig
from xlserve.layers.quantized import dense_float32
from xlserve.speculative.eagle_head import EagleHead, EagleHeadConfig
from xlserve.speculative.proposer import Proposer

log = logging.getLogger("xlserve.eagle")


TOOL_TEMPLATES = ["Look up {} in the documentation.", "Show me the file that defines {}.",
                  "Check whether the tests for {} pass.", "File a bug: {} breaks under load.",
                  "Where is {} documented?", "Open the source of {}.", "Test the {} package.",
                  "Report that {} leaks memory."]
TOOL_TOPICS = ["the block allocator", "prefix caching", "the tokenizer", "chunked prefill", "the router",
               "session affinity", "the KV hand-off", "tool-call parsing", "the sampler", "stop strings",
               "the metrics endpoint", "rotary embeddings", "the disk tier", "grammar masks", "the HTTP server",
               "logprobs", "the chat template", "request cancellation", "the health check", "the scheduler queue",
               "weight loading", "GGUF files", "the benchmark runner", "the load balancer", "the config parser",
               "the detokenizer", "API keys", "the event stream", "the pricing table", "CUDA graphs"]
TEXT_TEMPLATES = ["Write a short paragraph about {}.", "Explain {} to a child.", "List three facts about {}.",
                  "Write a haiku about {}.", "What are the pros and cons of {}?", "Describe {} in two sentences.",
                  "Give me a tip about {}.", "Why do people like {}?"]
TEXT_TOPICS = ["mountains", "coffee", "trains", "the ocean", "gardening", "chess", "rain", "libraries",
               "volcanoes", "jazz", "bread", "winter", "owls", "bridges", "the moon", "football", "museums",
               "honey", "deserts", "rivers", "clocks", "kites", "maps", "glaciers", "markets", "violins",
               "lanterns", "forests", "recycling", "planets"]


def training_asks(count: int, seed: int) -> tuple[list[str], list[str]]:
    """``count`` asks, half tool asks and half free-text asks, drawn without repeats."""
    rng = random.Random(seed)
    tools = [t.format(x) for t in TOOL_TEMPLATES for x in TOOL_TOPICS]
    texts = [t.format(x) for t in TEXT_TEMPLATES for x in TEXT_TOPICS]
    rng.shuffle(tools)
    rng.shuffle(texts)
    return tools[:count // 2], texts[:count - count // 2]


class StateRecorder(Proposer):
    """Proposes nothing; keeps each request's hidden states by position (``observe``)."""
    name = "recorder"
    wants_hidden = True

    def __init__(self):
        self.states: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def observe(self, request_id: str, position: int, states: torch.Tensor) -> None:
        self.states.setdefault(request_id, []).append((position, states.float().clone()))

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        return []

    def reset(self) -> None:
        self.states.clear()

    def forget(self, request_id: str, output: list[int]) -> None:
        """Kept until the trainer takes them."""

    def take(self, request_id: str) -> torch.Tensor:
        parts = sorted(self.states.pop(request_id), key=lambda p: p[0])
        position = 0
        for start, rows in parts:
            if start != position:
                raise RuntimeError(f"request {request_id}: states from {start}, expected {position}")
            position += rows.shape[0]
        return torch.cat([rows for _, rows in parts])


def answer_with_states(llm, prompts: list[tuple[list[int], object]], max_tokens: int,
                       batch: int = 32) -> list[tuple[list[int], torch.Tensor]]:
    """(prompt + greedy answer, the hidden state of every position but the last) per prompt."""
    from xlserve.sampling_params import SamplingParams
    engine = llm.engine
    recorder = engine.speculation.proposer = StateRecorder()
    engine.runner.keep_hidden = True
    samples = []
    with tqdm(total=len(prompts), desc="answering", unit="prompt") as bar:
        for first in range(0, len(prompts), batch):
            ids = {}
            for i, (prompt, guided) in enumerate(prompts[first:first + batch]):
                rid = f"eagle-train-{first + i}"
                engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, guided=guided))
                ids[rid] = prompt
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        tokens = ids[out.request_id] + list(out.outputs[0].token_ids)
                        states = recorder.take(out.request_id)
                        samples.append((tokens, states[:len(tokens) - 1]))
                        bar.update(1)
    return samples


def draft_vocabulary(samples: list[tuple[list[int], torch.Tensor]], size: int) -> torch.Tensor:
    """The ``size`` tokens that follow most often (ties by id), ascending ids."""
    counts = torch.zeros(max(max(t) for t, _ in samples) + 1, dtype=torch.long)
    for tokens, _ in samples:
        counts += torch.bincount(torch.tensor(tokens[1:]), minlength=counts.numel())
    top = torch.argsort(counts, descending=True, stable=True)[:size]
    return torch.sort(top[counts[top] > 0]).values


@dataclass
class Pack:
    """Sequences packed for one batch: the head's input at each row j (the state at j, the
    token at j + 1) and its targets (the state at j + 1, the token at j + 2 in draft ids, -100
    outside the vocabulary or past the end)."""
    states: torch.Tensor
    next_tokens: torch.Tensor
    positions: torch.Tensor
    sequence: torch.Tensor
    target_states: torch.Tensor
    target_tokens: torch.Tensor


def make_packs(samples, to_draft: torch.Tensor, pack_tokens: int) -> list[Pack]:
    packs, current, used = [], [], 0
    for tokens, states in samples:
        n = states.shape[0] - 1  # rows j with a state at j + 1
        if current and used + n > pack_tokens:
            packs.append(_pack(current, to_draft))
            current, used = [], 0
        current.append((tokens, states))
        used += n
    if current:
        packs.append(_pack(current, to_draft))
    return packs


def _pack(group, to_draft: torch.Tensor) -> Pack:
    parts = []
    for s, (tokens, states) in enumerate(group):
        n = states.shape[0] - 1
        ids = torch.tensor(tokens)
        label = torch.full((n,), -100, dtype=torch.long)
        ahead = ids[2:n + 2]
        label[:ahead.numel()] = to_draft[ahead]
        parts.append((states[:n], ids[1:n + 1], torch.arange(n), torch.full((n,), s), states[1:n + 1], label))
    return Pack(*(torch.cat(column) for column in zip(*parts)))


def pack_loss(head: EagleHead, embed, pack: Pack, unroll: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The weighted loss over every guess depth, and (right, counted) top-1 per depth."""
    embeds = embed(pack.next_tokens).float()
    outs = head.unrolled(pack.states, embeds, pack.positions, pack.sequence, unroll)
    total, hits = 0.0, []
    for s, out in enumerate(outs):
        valid = (pack.positions >= s) & (pack.target_tokens != -100)
        logits = head.logits(out[valid])
        labels = pack.target_tokens[valid]
        ce = F.cross_entropy(logits, labels)
        regression = F.smooth_l1_loss(out[valid], pack.target_states[valid])
        total = total + 0.8 ** s * (ce + 0.1 * regression)
        hits.append((int((logits.argmax(-1) == labels).sum()), int(labels.numel())))
    return total, hits


def training_prompts(llm, cfg: EagleTrainingConfig) -> list[tuple[list[int], object]]:
    """(prompt ids, grammar or None) per ask, through the model's chat template."""
    from xlserve.bench.agentic import TOOLS
    from xlserve.bench.spec_bench import TOOL_SYSTEM, tool_call_grammar
    tokenizer = llm.tokenizer
    tool_asks, text_asks = training_asks(cfg.prompts, cfg.seed)
    grammar = tool_call_grammar(tokenizer)
    system = [{"role": "system", "content": TOOL_SYSTEM}]
    return ([(tokenizer.encode_chat(system + [{"role": "user", "content": a}], tools=TOOLS), grammar)
             for a in tool_asks] +
            [(tokenizer.encode_chat([{"role": "user", "content": a}]), None) for a in text_asks])


def train_head(head: EagleHead, embed, train: list[Pack], held_out: list[Pack], cfg: EagleTrainingConfig,
               ) -> list[float]:
    """AdamW over the packs for ``cfg.epochs``; the held-out top-1 accuracy per guess depth."""
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    total = cfg.epochs * len(train)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: max(0.0, 1 - i / max(total, 1)))
    order = random.Random(cfg.seed)
    with tqdm(total=total, desc="training", unit="batch") as bar:
        for _ in range(cfg.epochs):
            for pack in order.sample(train, len(train)):
                loss, _ = pack_loss(head, embed, pack, cfg.unroll)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                schedule.step()
                bar.set_postfix(loss=f"{loss.item():.3f}")
                bar.update(1)
    return accuracy(head, embed, held_out, cfg.unroll)


@torch.no_grad()
def accuracy(head: EagleHead, embed, packs: list[Pack], unroll: int) -> list[float]:
    """Top-1 per guess depth over ``packs`` (guess s right given guesses 1..s-1 right)."""
    right, counted = [0] * unroll, [0] * unroll
    for pack in packs:
        _, hits = pack_loss(head, embed, pack, unroll)
        for s, (r, c) in enumerate(hits):
            right[s] += r
            counted[s] += c
    return [r / c if c else 0.0 for r, c in zip(right, counted)]


def train_eagle(cfg: EagleTrainingConfig) -> dict:
    """Answer, train, write; returns what was measured."""
    from xlserve import LLM
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    started = time.monotonic()
    with LLM(cfg.model, dtype=cfg.dtype, enable_prefix_caching=False) as llm:
        samples = answer_with_states(llm, training_prompts(llm, cfg), cfg.max_tokens)
        arch, model = llm.engine.loaded.arch, llm.engine.loaded.model
        answered = time.monotonic() - started
        vocab = draft_vocabulary(samples, cfg.draft_vocab)
        to_draft = torch.full((arch.vocab_size,), -100, dtype=torch.long)
        to_draft[vocab] = torch.arange(vocab.numel())
        head = EagleHead(EagleHeadConfig.for_target(arch, llm.engine.loaded.source.name, vocab.numel(),
                                                    cfg.intermediate_size))
        head.draft_to_target = vocab
        head.bind_target(model)
        head.float().train()
        rng = random.Random(cfg.seed)
        rng.shuffle(samples)
        split = max(1, len(samples) // 10)
        held_out = make_packs(samples[:split], to_draft, cfg.pack_tokens)
        train = make_packs(samples[split:], to_draft, cfg.pack_tokens)
        embed = _frozen_embedding(model)
        top1 = train_head(head, embed, train, held_out, cfg)
    head.save(cfg.out)
    report = {"answers": len(samples), "positions": sum(s.shape[0] for _, s in samples), "draft_vocab": vocab.numel(),
              "held_out_top1_per_guess": [round(a, 4) for a in top1], "answer_seconds": round(answered, 1),
              "total_seconds": round(time.monotonic() - started, 1), "out": cfg.out}
    log.info("EAGLE head written: %s", json.dumps(report))
    return report


def _frozen_embedding(model):
    """The target's token embedding as float32 rows, for lookups outside inference mode."""
    dense = dense_float32(model.model.embed_tokens.weight).clone()
    return lambda ids: F.embedding(ids, dense)
