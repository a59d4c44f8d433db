"""Rows a grammar decides alone skip the head (``RequestSampling.grammar_rows``): which rows,
the matcher left as it was, and the same greedy answers as with the head on every row."""

import pytest
import torch

from xlserve import LLM
from xlserve.engine import request_sampling
from xlserve.engine.guided import GuidedDecoding
from xlserve.engine.request_sampling import GrammarRows, RequestSampling
from xlserve.engine.scheduler import ScheduledRequest
from xlserve.loader.tokenizer import load_model_tokenizer
from xlserve.sampling_params import GuidedSpec, SamplingParams

REGEX = GuidedSpec("regex", "(cat|dog) says hello[0-9]+")


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_tokenizer("default")


def _row(request_id, params, proposed, seed=None):
    return ScheduledRequest(request_id, [0, *proposed], 0, [0], True, params, seed, 0, num_proposed=len(proposed))


def test_the_rows_a_grammar_decides_alone_are_fixed_and_the_matcher_is_left_as_it_was(tokenizer):
    dog, says, hello, seven = (tokenizer.encode(w)[0] for w in ("dog", " says", " hello", "7"))
    assert tokenizer.decode([dog, says, hello, seven]) == "dog says hello7"
    guided = GuidedDecoding(tokenizer, tokenizer.vocab_size)
    sampling = RequestSampling(guided)
    greedy = SamplingParams(max_tokens=8, temperature=0, guided=REGEX)
    requests = [_row("landing", greedy, [dog, says, hello, seven]),  # rows 0-4
                _row("refused", greedy, [dog, hello, seven]),  # rows 5-8: " hello" is forbidden after "dog"
                _row("logprobs", SamplingParams(max_tokens=8, temperature=0, guided=REGEX, logprobs=2), [dog, says]),
                _row("sampled", SamplingParams(max_tokens=8, temperature=1.0, guided=REGEX), [dog, says], seed=3)]
    before = {s.request_id: sampling._matcher(s).compute_bitmask() for s in requests}
    rows = sampling.grammar_rows(requests)
    # " says" and " hello" are the only tokens after "dog" and "dog says"; the first row may be
    # "cat", "dog" or their prefixes, a digit row any digit; past a refused proposal nothing is read
    assert rows.fixed == {1: says, 2: hello, 6: says, 7: 0, 8: 0, 13: says, 14: hello}  # a draw too
    assert [len(rows.masks[r]) for r in ("landing", "refused", "sampled")] == [5, 2, 3]
    assert "logprobs" not in rows.masks  # logprobs need the head
    assert all(sampling._matcher(s).compute_bitmask() == before[s.request_id] for s in requests)

    # the stand-ins and the head's rows pick the same tokens, greedy (from the masks walked
    # before the head) and drawn alike
    logits = torch.randn(15, tokenizer.vocab_size, generator=torch.Generator().manual_seed(0))
    logits[0, dog] = logits[3, seven] = logits[5, dog] = logits[9, dog] = logits[12, dog] = 30.0
    stand_in = logits.clone()
    stand_in[list(rows.fixed)] = float("-inf")
    stand_in[list(rows.fixed), list(rows.fixed.values())] = 0.0
    picked = []
    for grammar, scores in ((None, logits), (rows, stand_in)):
        out, fresh = {}, RequestSampling(guided)
        fresh.sample(scores, requests, out, {}, {}, grammar)
        picked.append(out)
    assert picked[0] == picked[1]
    assert picked[1]["landing"][:4] == [dog, says, hello, seven] and picked[1]["refused"] == [dog, says]
    assert picked[1]["sampled"] == [dog, says, hello]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}])
def test_a_forced_tool_call_skips_the_head_where_the_grammar_decides_and_answers_the_same(monkeypatch, sampling):
    """The default model in its default configuration: forced tool calls batched and alone give
    the same answers with the head skipped where the grammar admits one token as with the head
    on every row (greedy, and seeded draws), and most rows skip it (the envelope, the keys, the
    separators)."""
    from xlserve.bench.spec_bench import tool_call_grammar, workloads
    answers, head_rows = [], []
    with LLM("default") as llm:
        prompts = workloads(llm.tokenizer, 4)["tool_calls"]
        params = SamplingParams(max_tokens=40, guided=tool_call_grammar(llm.tokenizer), **sampling)
        model = llm.engine.runner.model
        compute_logits = model.compute_logits

        def counted(hidden):
            head_rows[-1] += len(hidden)
            return compute_logits(hidden)
        monkeypatch.setattr(model, "compute_logits", counted)
        for skip in (True, False):
            if not skip:
                monkeypatch.setattr(request_sampling.RequestSampling, "grammar_rows",
                                    lambda self, requests: GrammarRows())
            head_rows.append(0)
            answers.append([[o.outputs[0].token_ids for o in llm.generate(prompts, params)],
                            [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]])
        skipped = llm.engine.stats()["head_rows_skipped"]  # counted while the skip was on
    assert answers[0] == answers[1]
    assert answers[0][0] == answers[0][1]
    assert head_rows[0] < 0.5 * head_rows[1], head_rows
    assert skipped == head_rows[1] - head_rows[0]  # what /metrics reports as xlserve_head_rows_skipped


def test_a_grammar_that_fails_in_the_walk_ends_only_its_request(tokenizer):
    """A matcher that cannot be built is left to ``sample``, which ends that request with the
    reason; the other request's rows are still fixed and it gets its tokens."""
    dog, says = (tokenizer.encode(w)[0] for w in ("dog", " says"))
    guided = GuidedDecoding(tokenizer, tokenizer.vocab_size)
    sampling = RequestSampling(guided)
    broken = GuidedSpec("regex", "broken")
    build = guided.matcher

    def matcher(spec):
        if spec == broken:
            raise ValueError("the regex constraint does not compile")
        return build(spec)
    guided.matcher = matcher
    requests = [_row("broken", SamplingParams(max_tokens=8, temperature=0, guided=broken), [dog]),
                _row("fine", SamplingParams(max_tokens=8, temperature=0, guided=REGEX), [dog, says])]
    rows = sampling.grammar_rows(requests)
    assert rows.fixed == {3: says, 4: tokenizer.encode(" hello")[0]} and set(rows.masks) == {"fine"}
    logits = torch.zeros(5, tokenizer.vocab_size)
    logits[:, dog] = 1.0
    sampled, errors = {}, {}
    sampling.sample(logits, requests, sampled, {}, errors, rows)
    assert "does not compile" in errors["broken"] and "broken" not in sampled
    assert sampled["fine"][:2] == [dog, says]
