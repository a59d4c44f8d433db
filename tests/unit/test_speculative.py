"""Speculative decoding: the output is the model's, with or without proposals.

Greedy tokens are identical with and without each proposer (alone, batched, chunked,
with prefix hits, with a stop string inside a run of accepted tokens, with logprobs; tiny
models in float32, the default model in its default configuration, whose bfloat16 rows do
not depend on the batch), the proposals are really checked and accepted, no block is left behind, and the accept rule
draws each token from exactly the model's distribution (chi-square over 20,000 draws)."""

import json
import math

import pytest
import torch

from xlserve import LLM, SamplingParams
from xlserve.engine.sampler import Sampler
from xlserve.speculative.draft_budget import MAX_PROPOSALS, DraftLength, StepCosts, plan_lengths
from xlserve.speculative.ngram import NgramProposer
from xlserve.speculative.verifier import verify


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    phrase = torch.randint(3, 320, (12,), generator=gen).tolist()
    # repeated phrases: what agents' contexts look like, and what the proposer finds
    return [phrase * 4 + torch.randint(3, 320, (n,), generator=gen).tolist() + phrase[:5] for n in (3, 11, 25)]


def _generate(path: str, **options):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    with LLM(path, dtype="float32", kv_cache_tokens=2048, max_num_batched_tokens=48, **options) as llm:
        first = llm.generate(_prompts(), params)
        again = llm.generate(_prompts()[:1], params)  # a prefix hit
        assert llm.engine.kv.num_used_blocks == 0  # nothing held after rejections
        return first + again, llm.engine.stats()


_PLAIN: dict[str, list] = {}


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3", "gemma3"])
@pytest.mark.parametrize("method,k", [("ngram", 0), ("ngram", 3), ("suffix", 0)])
def test_greedy_tokens_are_the_same_with_proposals(tiny_model_dirs, arch, method, k):
    """Also with sliding windows (gemma3) and latent attention (deepseek_v3); k=0: adaptive lengths."""
    if arch not in _PLAIN:
        _PLAIN[arch] = _generate(tiny_model_dirs[arch])[0]
    plain = _PLAIN[arch]
    spec, stats = _generate(tiny_model_dirs[arch], speculative=method, num_speculative_tokens=k)
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [x["token_id"] for x in a.outputs[0].logprobs] == [x["token_id"] for x in b.outputs[0].logprobs]
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(x["logprob"] - y["logprob"]) <= 1e-4
    assert stats["spec_proposed_tokens"] > 0
    assert stats["spec_accepted_tokens"] > 0
    assert sum(stats["spec_acceptance_lengths"].values()) > 0


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_proposals_are_checked_across_ranks(tiny_model_dirs, layout):
    """The step plan carries how many proposals each chunk checks: every rank computes their rows."""
    plain, _ = _generate(tiny_model_dirs["deepseek_v3"])
    spec, stats = _generate(tiny_model_dirs["deepseek_v3"], speculative="ngram", **layout)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert stats["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("extra", [dict(frequency_penalty=0.05, presence_penalty=0.05, repetition_penalty=1.02),
                                   dict(logit_bias={20: 3.0, 40: -100.0})])
def test_penalties_and_bias_see_the_tokens_before_each_proposal(tiny_model_dirs, extra):
    """Penalties count the step's accepted proposals before the next row (greedy: the same tokens)."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **extra)
    outs = {}
    for method in ("none", "ngram"):
        with LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_tokens=2048, speculative=method) as llm:
            outs[method] = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]
            proposed = llm.engine.stats()["spec_proposed_tokens"]
    assert outs["ngram"] == outs["none"]
    assert method == "ngram" and proposed > 0


def test_a_stop_string_inside_a_run_of_accepted_tokens_ends_the_answer_there():
    """The default model in its default configuration asked to repeat a list: the stop string
    falls inside a step's run of accepted tokens, and the answer ends where it ends without
    proposals."""
    prompt = "Repeat exactly: red, green, blue, red, green, blue, red, green, blue, red, green, blue"
    stop = SamplingParams(max_tokens=16, temperature=0, stop=["blue"])
    runs = {}
    for method in ("none", "ngram"):
        with LLM("default", speculative=method, num_speculative_tokens=6) as llm:
            if method == "none":
                text = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0].outputs[0].text
            out = llm.generate(prompt, stop)[0].outputs[0]
            runs[method] = (out.text, out.token_ids, out.finish_reason)
            stats = llm.engine.stats()
    assert "blue" in text and runs["none"][0] == text[:text.index("blue")]
    assert runs["ngram"] == runs["none"]
    assert stats["spec_accepted_tokens"] > 0


def test_a_json_schema_answer_is_the_same_with_proposals():
    """Guided decoding, the default model in its default configuration: the grammar masks each
    row after the proposals before it; a proposal it forbids is rejected."""
    schema = {"type": "array", "minItems": 3, "items": {"type": "object", "required": ["name", "color"],
              "properties": {"name": {"type": "string"}, "color": {"type": "string"}}}}
    prompt = "Fruits and their colors as JSON: apple is red, banana is yellow, lime is green, plum is purple.\n"
    from xlserve.sampling_params import GuidedSpec
    params = SamplingParams(max_tokens=60, temperature=0, guided=GuidedSpec("json_schema", json.dumps(schema)))
    runs = {}
    for method in ("none", "ngram"):
        with LLM("default", speculative=method) as llm:
            out = llm.generate(prompt, params)[0].outputs[0]
            runs[method] = (out.text, out.token_ids)
            stats = llm.engine.stats()
    assert len(json.loads(runs["none"][0])) >= 3  # the keys repeat: proposals land
    assert runs["ngram"] == runs["none"]
    assert stats["spec_accepted_tokens"] > 0


def _batched_and_alone(llm, work) -> list:
    """For each (prompts, params) of ``work``: the answers batched, then one at a time, each as
    its tokens and, where the params ask for them, their logprobs."""
    def answer(out):
        return out.token_ids, [entry["logprob"] for entry in out.logprobs or []]
    return [[[answer(o.outputs[0]) for o in llm.generate(ids, params)],
             [answer(llm.generate([p], params)[0].outputs[0]) for p in ids]] for ids, params in work]


def test_tool_calls_are_the_same_with_chained_proposals():
    """A forced tool call in the default configuration: the grammar's envelope and an argument
    guessed from an earlier answer (suffix) checked in one step where each took one of its
    own; the answers are none's. A fixed length keeps the plan off the machine's timings."""
    from xlserve.bench.spec_bench import tool_call_grammar, workloads
    runs, chains = {}, []
    for method in ("none", "suffix"):
        with LLM("default", speculative=method, num_speculative_tokens=16) as llm:
            speculation, fill = llm.engine.speculation, llm.engine.speculation._fill

            def spy(planned_chains, planned, continuation, fill=fill):
                out = fill(planned_chains, planned, continuation)
                chains.extend((len(c.head), len(c.guesses), len(c.tail)) for c in planned_chains)
                return out
            speculation._fill = spy
            prompts = workloads(llm.tokenizer, 4)["tool_calls"]
            params = SamplingParams(max_tokens=48, temperature=0, guided=tool_call_grammar(llm.tokenizer))
            runs[method] = _batched_and_alone(llm, [(prompts, params)])[0]
            longest = max(speculation.stats.lengths, default=0)
    assert runs["suffix"] == runs["none"] and runs["none"][0] == runs["none"][1]
    assert any(head and guesses for head, guesses, _ in chains)  # guesses after a forced run were checked
    assert longest > 9  # more than the envelope's longest forced run landed at once


@pytest.fixture(scope="module")
def default_answers():
    """The default model without proposals, in its default configuration: tool calls under
    the forced-call grammar (without logprobs, so the rows the grammar decides skip the head)
    and free text with each token's logprob, which a checking row gives with the same bits,
    batched and one at a time."""
    from xlserve.bench.spec_bench import tool_call_grammar, workloads
    with LLM("default") as llm:
        prompts = workloads(llm.tokenizer, 4)
        work = [(prompts["tool_calls"], SamplingParams(max_tokens=40, temperature=0,
                                                       guided=tool_call_grammar(llm.tokenizer))),
                (prompts["free_text"], SamplingParams(max_tokens=40, temperature=0, logprobs=0))]
        return work, _batched_and_alone(llm, work)


@pytest.mark.parametrize("method,extra", [("ngram", {}), ("suffix", {}), ("eagle", {}),
                                          ("draft", {"draft_model": "default"}), ("grammar", {})])
def test_every_proposer_answers_as_none_in_the_default_configuration(default_answers, method, extra):
    """The promise users get: the default model in its default dtype, whose rows do not depend
    on the batch, answers the same with each proposer, batched and alone (the draft is the
    model itself, so its guesses land and long runs are checked; ``grammar`` checks only the
    tool calls' forced runs, which always land)."""
    work, expected = default_answers
    with LLM("default", speculative=method, **extra) as llm:
        assert _batched_and_alone(llm, work) == expected
        stats = llm.engine.stats()
    assert stats["spec_accepted_tokens"] > 0
    if method == "grammar":
        assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"]  # forced tokens, no guesses


def test_seeded_sampling_with_proposals_is_reproducible(tiny_model_dirs):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    outs = []
    for _ in range(2):
        with LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_tokens=2048, speculative="ngram") as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate(_prompts(), params)])
    assert outs[0] == outs[1]


def _chi_square_quantile(df: int, z: float = 3.09) -> float:
    """The 99.9% point of chi-square with ``df`` degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_the_accept_rule_draws_from_the_models_distribution():
    """With temperature 1 and top-p: the first token's law is row 0's whatever is proposed,
    and the second's, given the first was the proposal, is row 1's."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 12, generator=gen) * 1.5
    params = SamplingParams(temperature=1.0, top_p=0.95)
    sampler = Sampler()
    p0, p1 = sampler.probabilities(rows[0], params), sampler.probabilities(rows[1], params)
    proposed = [int(p0.argsort()[-2]), int(p1.argmax())]  # the second likeliest: rejected often
    firsts, seconds = torch.zeros(12), torch.zeros(12)
    draws = 20000
    for i in range(draws):
        g = torch.Generator()
        tokens = verify(rows, proposed, params, lambda j, g=g, i=i: g.manual_seed(i * 8 + j), sampler)
        firsts[tokens[0]] += 1
        if tokens[0] == proposed[0]:
            seconds[tokens[1]] += 1
    for counts, probs in ((firsts, p0), (seconds, p1)):
        expected = probs * counts.sum()
        kept = expected > 5
        statistic = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
        assert counts[~kept].sum() <= 5 * (~kept).sum() + 10  # (near-)impossible tokens stay rare
        assert statistic < _chi_square_quantile(int(kept.sum()) - 1)


def test_ngram_proposes_what_followed_the_latest_match():
    proposer = NgramProposer()
    tokens = [1, 2, 3, 4, 9, 9, 1, 2, 3, 4, 7, 8, 5, 1, 2, 3, 4]
    assert proposer.propose("a", tokens, 3) == [7, 8, 5]  # the latest earlier "1 2 3 4", not the first
    assert proposer.propose("a", tokens + [7], 2) == [8, 5]  # the index grew with the new token
    assert proposer.propose("b", [5, 6, 7], 4) == []
    proposer.forget("a", [])
    assert "a" not in proposer.indexes


@pytest.mark.parametrize("target,draft", [("llama", "llama"), ("qwen2", "llama")])
def test_a_draft_model_proposes_and_the_answer_stays_the_targets(tiny_model_dirs, target, draft):
    """The same model as its own draft: every greedy proposal is accepted; another model with
    the same vocabulary: some are, and the answer is still the target's."""
    if target not in _PLAIN:
        _PLAIN[target] = _generate(tiny_model_dirs[target])[0]
    spec, stats = _generate(tiny_model_dirs[target], speculative="draft", draft_model=tiny_model_dirs[draft],
                            num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in _PLAIN[target]]
    assert stats["spec_proposed_tokens"] > 0
    if target == draft:
        assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"]


def test_a_draft_model_is_checked_for_its_vocabulary(tiny_model_dirs, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY_COMMON
    other = tmp_path / "other-vocab"
    LlamaForCausalLM(LlamaConfig(**{**TINY_COMMON, "vocab_size": 256})).save_pretrained(other)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_tokens=256, speculative="draft",
            draft_model=str(other))
    with pytest.raises(ValueError, match="--draft-model"):
        LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_tokens=256, speculative="draft")


def test_suffix_follows_the_longest_matches_where_they_agree():
    from xlserve.speculative.suffix import SuffixProposer
    proposer = SuffixProposer()
    envelope = [50, 51, 52, 53]  # a JSON envelope the answers repeat
    tokens = [9, *envelope, 1, 9, *envelope, 2, 9, *envelope, 3, 9, *envelope[:3]]
    assert proposer.propose("a", tokens, 6) == [53]  # then 1, 2 and 3: no majority, no further
    assert proposer.propose("a", tokens + [53, 1, 9, 50], 6) == [51, 52, 53, 2, 9, 50]  # the best match leads
    assert proposer.propose("a", [7, 8], 4) == []  # too short to match
    proposer.forget("a", [30, 31, 32, 33, 34, 35])
    assert "a" not in proposer.requests
    assert proposer.propose("b", [5, 30, 31, 32], 3) == [33, 34, 35]  # an earlier answer
    assert proposer.propose("c", [5, 33, 34, 35], 3) == []  # its end: no token crosses into the next


def test_a_request_rate_follows_its_checks():
    length = DraftLength()
    for _ in range(8):
        length.record(4, 4)  # every guess landed
    assert length.rate > 0.95
    for _ in range(8):
        length.record(4, 0)  # the first guess missed each time
    assert length.rate < 0.1
    length.record(0, 0)  # nothing was proposed: nothing learned
    assert length.rate < 0.1


def _costs(seconds_by_rows: dict[int, float], rest: float = 0.0) -> StepCosts:
    costs = StepCosts()
    for rows, seconds in seconds_by_rows.items():
        costs.record(rows, seconds, seconds + rest)
    return costs


def test_proposals_go_where_rows_are_cheap_and_guesses_land():
    sure, unsure = DraftLength(rate=0.95), DraftLength(rate=0.2)
    flat = _costs({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    assert plan_lengths([sure], [100], 1, 1, flat) == [MAX_PROPOSALS]  # rows cost nothing: propose all
    linear = _costs({r: float(r) for r in range(1, 12)})
    assert plan_lengths([sure], [100], 1, 1, linear) == [0]  # a row costs a step: nothing pays
    # rows cost 10% each: the sure request gets guesses, the unsure one none
    gentle = _costs({r: 1 + 0.1 * (r - 1) for r in range(1, 20)})
    sure_k, unsure_k = plan_lengths([sure, unsure], [100, 100], 2, 2, gentle)
    assert sure_k >= 4 and unsure_k == 0
    # a jump at 5 rows (another kernel): three guesses, not one more
    jump = _costs({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 3.0, 6: 3.0, 7: 3.0, 8: 3.0, 9: 3.0})
    assert plan_lengths([sure], [100], 1, 1, jump) == [3]


def test_the_plan_keeps_rooms_fixed_lengths_and_unmeasured_rows():
    sure = DraftLength(rate=0.95)
    flat = _costs({1: 1.0, 2: 1.0})
    assert plan_lengths([sure], [2], 1, 1, flat) == [2]  # max_tokens leaves room for two
    assert plan_lengths([DraftLength(fixed=5)], [100], 1, 1, flat) == [5]  # the user's length
    assert plan_lengths([DraftLength(fixed=5)], [3], 1, 1, flat) == [3]
    assert plan_lengths([sure], [100], 1, 1, StepCosts()) == [MAX_PROPOSALS]  # nothing timed yet: try
    # rows never measured are estimated at the largest measured below: tried, then known
    assert plan_lengths([sure], [100], 1, 1, _costs({1: 1.0})) == [MAX_PROPOSALS]
    # forced rows already in the step count as rows (they cost) and tokens (they land)
    assert plan_lengths([sure], [100], 4, 4, _costs({r: float(r) for r in range(1, 12)})) == [0]


def test_a_proposer_that_costs_per_guess_guesses_less_deep():
    sure = DraftLength(rate=0.9)
    flat = _costs({1: 1.0, 8: 1.0})
    assert plan_lengths([sure], [100], 1, 1, flat) == [MAX_PROPOSALS]
    for depth in range(1, MAX_PROPOSALS + 1):  # each guess depth costs a quarter step
        flat.record(1, 1.0, 1.0 + 0.25 * depth, propose_seconds=0.25 * depth, depth=depth)
    k = plan_lengths([sure], [100], 1, 1, flat)[0]
    assert 0 < k < MAX_PROPOSALS
    # a grammar's forced tokens run no proposer: all of them still go
    assert plan_lengths([DraftLength(rate=1.0, most=12, forced=True)], [12], 1, 1, flat) == [12]


def test_step_costs_estimate_rows_and_the_rest_of_a_step():
    costs = _costs({1: 0.010, 4: 0.012}, rest=0.002)
    assert costs.estimate(1) == pytest.approx(0.012) and costs.estimate(4) == pytest.approx(0.014)
    assert costs.estimate(3) == pytest.approx(0.012)  # the most rows measured below
    assert costs.estimate(6) == pytest.approx(0.014)
    assert StepCosts().estimate(1) is None
    costs.record(1, 0.010, 0.015, propose_seconds=0.003, depth=3)
    assert costs.estimate(1, depth=3) == pytest.approx(costs.estimate(1) + 0.003)
    assert costs.estimate(1, depth=5) == costs.estimate(1, depth=3)  # the deepest measured below
    assert costs.estimate(1, depth=1) == costs.estimate(1, depth=3)  # none below: the cheapest known


def test_the_spec_benchmark_runs():
    """``xlserve bench spec`` end to end, small (its figures go to docs/benchmarks.md)."""
    from xlserve.bench.spec_bench import SpecBenchOptions, run_spec_bench, spec_table
    results = run_spec_bench(SpecBenchOptions(methods=("none", "ngram"), repeats=1, max_tokens=6, batches=(1, 2),
                                              prompts=2, dtype="float32"))
    for workload in ("tool_calls", "free_text"):
        for batch in ("1", "2"):
            row = results["summary"][workload][batch]
            assert row["none"]["speedup"] == 1.0 and row["ngram"]["tok_s"]["median"] > 0
            assert row["ngram"]["same_answers"] and row["none"]["tokens_per_request_step"] == 1.0
    assert "same answers" in spec_table(results)


def test_preemptions_and_aborts_in_the_middle_of_speculation_leave_nothing(tiny_model_dirs):
    """A pool too small for the batch preempts requests that carry proposals, and aborts land
    between a proposal and its check: the answers stay the model's, every block comes back
    and no pin is left."""
    path = tiny_model_dirs["llama"]
    small = dict(dtype="float32", kv_cache_tokens=144, block_size=4, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(path, **small) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]
    with LLM(path, speculative="ngram", num_speculative_tokens=4, **small) as llm:
        engine = llm.engine
        assert [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)] == plain
        stats = engine.stats()
        assert stats["num_preemptions"] > 0 and stats["spec_accepted_tokens"] > 0
        for i, prompt in enumerate(_prompts()):
            engine.add_request(f"cut-{i}", prompt, params)
        aborted = 0
        while engine.has_unfinished_requests():
            engine.step()
            carrying = [r for r in engine.scheduler.running if r.spec_token_ids]
            if carrying:  # abort one that holds proposals for the next step
                engine.abort_request(carrying[0].request_id)
                aborted += 1
        assert aborted > 0
        assert engine.kv.num_used_blocks == 0 and engine.kv.num_pins == 0
        assert not engine.speculation.draft_lengths and not engine.speculation.proposer.indexes


def test_the_engine_times_its_decode_steps_by_rows(tiny_model_dirs):
    """Decode steps (and only they) are timed for the planner, by the rows they computed."""
    with LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_tokens=512, speculative="ngram") as llm:
        llm.generate([[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]] * 2, SamplingParams(max_tokens=12, temperature=0,
                                                                                  ignore_eos=True))
        costs = llm.engine.speculation.step_costs
        assert costs.forward and min(costs.forward) >= 2 and costs.rest is not None
        assert all(seconds > 0 for seconds in costs.forward.values())


class _ScriptedGrammar:
    """A grammar over output positions: a listed token is forced there, None admits 50-59."""

    def __init__(self, script: list[int | None], start: int):
        self.script, self.start = script, start

    def continuation(self, request_id: str, tokens: list[int]) -> tuple[int, list[int]]:
        at = self.start
        for token in tokens:
            want = self.script[at] if at < len(self.script) else -1
            if want != token and not (want is None and 50 <= token < 60):
                break
            at += 1
        admitted, forced = at - self.start, []
        while at < len(self.script) and self.script[at] is not None:
            forced.append(self.script[at])
            at += 1
        return admitted, forced


class _Guesser(NgramProposer):
    """Guesses the same tokens whatever it is shown, and remembers what it was shown."""
    guesses_ahead = True

    def __init__(self, guesses: list[int], ahead: bool = True, evidence: int = 0):
        super().__init__()
        self.guesses, self.seen, self.guesses_ahead, self.evidence = guesses, [], ahead, evidence

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        return self.propose_scored(request_id, tokens, k)[0]

    def propose_scored(self, request_id: str, tokens: list[int], k: int) -> tuple[list[int], int]:
        self.seen.append(list(tokens))
        return self.guesses[:k], self.evidence


def _decoding_request(max_tokens: int = 64):
    from xlserve.engine.request import Request
    from xlserve.sampling_params import GuidedSpec
    params = SamplingParams(max_tokens=max_tokens, temperature=0, guided=GuidedSpec("regex", "[a-z]+"))
    req = Request("r", [1, 2, 3], params, set(), 16)
    req.append_token(7)
    req.num_computed_tokens = req.num_tokens - 1
    return req


def test_a_proposal_chains_forced_tokens_guesses_and_the_tokens_forced_after_them():
    """The grammar's forced tokens lead, a lookup proposer guesses after them (it is shown
    them), guesses the grammar forbids are cut, and the tokens it forces after the rest close
    the proposal when the guesses are likelier than not to land; the request's rate learns
    from its guesses alone."""
    from xlserve.engine.speculation import Speculation
    grammar = _ScriptedGrammar([7, 10, 11, 12, None, None, 20, 21, None], start=1)  # output 7 is sampled
    guesser, req = _Guesser([50, 51, 99]), _decoding_request()
    speculation = Speculation(guesser, 0)
    speculation.propose([req], 4096, grammar.continuation)
    assert guesser.seen == [[1, 2, 3, 7, 10, 11, 12]]
    assert req.spec_token_ids == [10, 11, 12, 50, 51]  # 99 cut: 20 is forced there; a new rate, 0.6^2: no tail
    speculation.draft_lengths["r"] = DraftLength(rate=0.9)  # guesses that have landed
    speculation.propose([req], 4096, grammar.continuation)
    assert req.spec_token_ids == [10, 11, 12, 50, 51, 20, 21]
    from xlserve.engine.scheduler import SchedulerOutput
    checked = SchedulerOutput([_scheduled(req)], 8)
    speculation.record(checked, {"r": [10, 11, 12, 50, 55]})  # the second guess missed
    expected = DraftLength(rate=0.9)
    expected.record(2, 1)
    assert speculation.draft_lengths["r"].rate == expected.rate
    # --num-speculative-tokens 4 bounds the whole chain; a model proposer guesses after none
    req.spec_token_ids = []
    fixed = Speculation(_Guesser([50, 51]), 4)
    fixed.propose([req], 4096, grammar.continuation)
    assert req.spec_token_ids == [10, 11, 12, 50]
    model = _Guesser([50, 51], ahead=False)
    Speculation(model, 0).propose([req], 4096, grammar.continuation)
    assert req.spec_token_ids == [10, 11, 12] and model.seen == []
    # max_tokens leaves room for 4 proposals: the chain stops there
    short = _decoding_request(max_tokens=6)
    Speculation(_Guesser([50, 51]), 0).propose([short], 4096, grammar.continuation)
    assert short.spec_token_ids == [10, 11, 12, 50]


def _scheduled(req):
    """The step that checks ``req``'s proposals."""
    return _checking_row(req.request_id, req.params, req.all_token_ids[-1], req.spec_token_ids,
                         req.num_computed_tokens, req.num_output_tokens)


def _checking_row(request_id, params, last, proposed, start=0, output_index=0):
    from xlserve.engine.scheduler import ScheduledRequest
    return ScheduledRequest(request_id, [last, *proposed], start, [0], True, params, None, output_index,
                            num_proposed=len(proposed))


def test_a_lookups_guesses_are_planned_at_the_rate_of_their_evidence():
    """A request whose guesses on novel values kept missing still guesses deep where the lookup
    matched a long context (a repeated call's arguments): the plan takes the rate that guesses
    on that much evidence had across requests, and that rate learns from the outcome. A
    proposer that gives no evidence is planned at the request's own rate."""
    from xlserve.engine.scheduler import SchedulerOutput
    from xlserve.engine.speculation import Speculation, evidence_class
    grammar = _ScriptedGrammar([7, *[None] * 12], start=1)  # any of 50-59 at every place
    guesses = [50, 51, 52, 53, 54, 55, 56, 57]

    def speculation_for(evidence):
        speculation = Speculation(_Guesser(guesses, evidence=evidence), 0)
        for rows in range(1, 10):  # a checked row costs a tenth of a step
            speculation.step_costs.record(rows, 1 + 0.1 * (rows - 1), 1 + 0.1 * (rows - 1))
        speculation.draft_lengths["r"] = DraftLength(rate=0.1)
        speculation.by_evidence[evidence_class(24)] = DraftLength(rate=0.95)
        return speculation
    long_match, req = speculation_for(24), _decoding_request()
    long_match.propose([req], 4096, grammar.continuation)
    assert req.spec_token_ids == guesses
    before = long_match.by_evidence[evidence_class(24)].rate
    long_match.record(SchedulerOutput([_scheduled(req)], 9), {"r": [50, 51, 52, 53, 54, 55, 56, 57, 58]})
    assert long_match.by_evidence[evidence_class(24)].rate > before
    assert evidence_class(3) not in long_match.by_evidence  # each class learns from its own guesses
    req.spec_token_ids = []
    speculation_for(0).propose([req], 4096, grammar.continuation)
    assert req.spec_token_ids == []  # at 0.1 a guess is not worth its row here
    speculation_for(3).propose([req], 4096, grammar.continuation)
    assert req.spec_token_ids == guesses[:3]  # a class never checked starts at 0.6: 3 guesses pay best


def test_a_new_request_starts_at_the_recent_rate_of_guesses():
    """Tool-call traffic whose guesses land lets a new request guess deep from its first step;
    a benchmark's reset starts from nothing."""
    from xlserve.engine.scheduler import SchedulerOutput
    from xlserve.engine.speculation import Speculation
    from xlserve.speculative.draft_budget import START_RATE
    grammar = _ScriptedGrammar([7, None, None, None, None], start=1)
    speculation, req = Speculation(_Guesser([50, 51, 52, 53]), 0), _decoding_request()
    for _ in range(6):  # every guess lands
        speculation.propose([req], 4096, grammar.continuation)
        speculation.record(SchedulerOutput([_scheduled(req)], 5), {"r": [50, 51, 52, 53, 54]})
    assert speculation.draft_lengths["r"].rate > 0.9
    assert speculation._new_length().rate == speculation.recent.rate > 0.9
    speculation.reset()
    assert speculation._new_length().rate == START_RATE


def test_proposals_never_take_a_later_running_requests_token():
    """A long proposal (a grammar can force a long run) rides on the budget that is left once
    every running request has its token: nobody's decode step is pushed out by a guess."""
    from xlserve.config import CacheConfig, SchedulerConfig
    from xlserve.engine.request import Request
    from xlserve.engine.scheduler import Scheduler
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=12), CacheConfig(block_size=16), 64, 512)
    for rid in "abc":
        sched.add_request(Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=64), set(), 16))
    sched.update(sched.schedule(), {rid: [5] for rid in "abc"}, {})  # prefills, a first token each
    sched.running[0].spec_token_ids = list(range(10, 40))
    step = sched.schedule().scheduled
    assert [(s.request_id, s.num_proposed) for s in step] == [("a", 9), ("b", 0), ("c", 0)]


def test_a_spike_in_a_step_time_does_not_keep_the_planner_off_its_row_count():
    costs = _costs({1: 1.0, 2: 1.1})
    costs.record(2, 9.0, 9.0)  # the VM stalled once
    assert costs.estimate(2) == pytest.approx(1.1)
    for _ in range(StepCosts.WINDOW):  # what the machine costs now, seen again and again
        costs.record(2, 1.5, 1.5)
    assert costs.estimate(2) == pytest.approx(1.5)


def test_greedy_under_a_grammar_masks_only_rows_whose_argmax_it_forbids():
    """The bit test (``GuidedDecoding.admits``, then ``best_allowed`` where it fails) and the
    masked row (``verify`` through ``_prepare``) pick the same tokens: rows whose argmax the
    grammar admits, rows whose argmax it forbids, ties, a rejected proposal and an accepted
    run."""
    from xlserve.engine.guided import GuidedDecoding
    from xlserve.engine.request_sampling import RequestSampling
    from xlserve.loader.tokenizer import load_model_tokenizer
    from xlserve.sampling_params import GuidedSpec
    tokenizer = load_model_tokenizer("default")
    guided = GuidedDecoding(tokenizer, tokenizer.vocab_size)
    params = SamplingParams(max_tokens=16, temperature=0, guided=GuidedSpec("regex", "(cat|dog)+[0-9]+"))
    ids = {word: tokenizer.encode(word) for word in ("cat", "dog", "7", "x")}
    assert all(len(v) == 1 for v in ids.values()), ids
    cat, dog, seven, x = (ids[w][0] for w in ("cat", "dog", "7", "x"))
    gen = torch.Generator().manual_seed(3)
    for proposed, tops in (([cat, dog], [cat, x, seven]),  # the second row's argmax is forbidden
                           ([cat, cat, dog], [cat, cat, dog, seven]),  # every proposal lands
                           ([dog], [x, cat])):  # the first row's argmax is forbidden: rejected
        rows = torch.randn(len(tops), tokenizer.vocab_size, generator=gen)
        for i, top in enumerate(tops):
            rows[i, top] = 50.0
            if top == x:  # below the forbidden argmax, a tie between two admitted tokens
                rows[i, cat] = rows[i, dog] = 40.0
        rows[0, cat] = rows[0, dog] = rows[0].max()  # a tie between two admitted tokens
        picked = []
        for fast in (True, False):
            sampling = RequestSampling(guided)
            s = _checking_row("g", params, 1, proposed)
            if fast:
                picked.append(sampling._sample_rows(rows, s, rows.argmax(-1).tolist()))
            else:
                matcher = sampling._matcher(s)
                picked.append(verify(rows, proposed, params, None, Sampler(),
                                     lambda row, before, sampling=sampling, s=s, matcher=matcher:
                                     sampling._prepare(row, s, matcher, before),
                                     matcher.consume_token))
        assert picked[0] == picked[1], (proposed, picked)
