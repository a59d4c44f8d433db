"""EAGLE-style proposals: a head trained here on a tiny model's own answers proposes, the
engine checks, and the output is the model's; serving attends as training did; the file
round-trips and is refused for another model."""

import dataclasses

import pytest
import torch

from xlserve import LLM, SamplingParams
from xlserve.bench.agentic import ASKS
from xlserve.bench.spec_bench import FREE_TEXT
from xlserve.speculative import eagle_training
from xlserve.speculative.eagle import EagleProposer
from xlserve.speculative.eagle_head import EagleHead, EagleHeadConfig, _guess_mask


def _prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, 300, (10,), generator=gen).tolist()
    return [phrase * 2 + torch.randint(3, 300, (int(n),), generator=gen).tolist()
            for n in torch.randint(3, 30, (count,), generator=gen)]


@pytest.fixture(scope="module")
def trained_head(tiny_model_dirs, tmp_path_factory):
    """A head trained for a few seconds on the tiny llama's greedy answers to 48 prompts."""
    path = str(tmp_path_factory.mktemp("eagle") / "head.safetensors")
    cfg = eagle_training.EagleTrainingConfig(epochs=20, unroll=3, pack_tokens=512)
    with LLM(tiny_model_dirs["llama"], dtype="float32", enable_prefix_caching=False) as llm:
        samples = eagle_training.answer_with_states(llm, [(p, None) for p in _prompts(48, 1)], 32)
        loaded = llm.engine.loaded
        vocab = eagle_training.draft_vocabulary(samples, 200)
        to_draft = torch.full((loaded.arch.vocab_size,), -100, dtype=torch.long)
        to_draft[vocab] = torch.arange(vocab.numel())
        torch.manual_seed(0)
        head = EagleHead(EagleHeadConfig.for_target(loaded.arch, "tiny-llama", vocab.numel(), 64))
        head.draft_to_target = vocab
        head.bind_target(loaded.model)
        packs = eagle_training.make_packs(samples, to_draft, cfg.pack_tokens)
        embed = eagle_training._frozen_embedding(loaded.model)
        before = eagle_training.accuracy(head, embed, packs[:1], cfg.unroll)
        after = eagle_training.train_head(head, embed, packs[1:], packs[:1], cfg)
    head.save(path)
    return path, before, after


def test_training_learns_the_models_next_tokens(trained_head):
    _, before, after = trained_head
    assert after[0] > before[0] + 0.1, (before, after)
    assert after[2] > before[2] + 0.05, (before, after)  # deeper guesses, from predicted states, learn too


def _generate(path: str, prompts, dtype: str = "float32", **options):
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=0)
    with LLM(path, dtype=dtype, kv_cache_tokens=2048, max_num_batched_tokens=40, **options) as llm:
        out = llm.generate(prompts, params) + llm.generate(prompts[:1], params)  # the second: a prefix hit
        assert llm.engine.kv.num_used_blocks == 0
        return [o.outputs[0].token_ids for o in out], llm.engine.stats()


@pytest.mark.parametrize("k", [0, 4])
def test_greedy_tokens_are_the_same_with_eagle(tiny_model_dirs, trained_head, k):
    """Batched, chunked prefill (a 40-token budget), a prefix hit; k=0: adaptive lengths. On
    prompts the head was trained on: a random model's answers elsewhere are noise, and here
    its acceptance shows the states reach the head at the right positions."""
    prompts = _prompts(48, 1)[:6]
    plain, _ = _generate(tiny_model_dirs["llama"], prompts)
    spec, stats = _generate(tiny_model_dirs["llama"], prompts, speculative="eagle", eagle_head=trained_head[0],
                            num_speculative_tokens=k)
    assert spec == plain
    assert stats["spec_accepted_tokens"] > 0.2 * stats["spec_proposed_tokens"] > 0, stats


def test_greedy_tokens_are_the_same_with_eagle_in_bfloat16(tiny_model_dirs, trained_head):
    """bfloat16: with --deterministic the rows that check proposals are computed as one-token
    steps are, so the output does not move (the head itself runs in bfloat16 too)."""
    prompts = _prompts(48, 1)[:6]
    plain, _ = _generate(tiny_model_dirs["llama"], prompts, "bfloat16", deterministic=True)
    spec, stats = _generate(tiny_model_dirs["llama"], prompts, "bfloat16", deterministic=True, speculative="eagle",
                            eagle_head=trained_head[0])
    assert spec == plain
    assert stats["spec_accepted_tokens"] > 0


def test_serving_attends_as_training_did(tiny_model_dirs, trained_head):
    """The proposer's catch-up and guess steps (caches, masks) give the states the training's
    unrolled pass gives at the same positions, fed the same tokens."""
    with LLM(tiny_model_dirs["llama"], dtype="float32", enable_prefix_caching=False,
             speculative="eagle", eagle_head=trained_head[0]) as llm:
        proposer = llm.engine.speculation.proposer
        samples = eagle_training.answer_with_states(llm, [(_prompts(1, 3)[0], None)], 16)
    tokens, states = samples[0]
    head = proposer.head
    m = len(tokens) - 6  # confirmed through m; guesses at m + 1, m + 2
    n = states.shape[0] - 1
    ids, positions = torch.tensor(tokens), torch.arange(n)
    with torch.no_grad():
        unrolled = head.unrolled(states[:n], proposer.embed(ids[1:n + 1]), positions, torch.zeros(n), 3)
    proposer.observe("r", 0, states[:m + 1])
    state = proposer._catch_up([("r", tokens[:m + 2], 3)])
    torch.testing.assert_close(state[0], unrolled[0][m], atol=1e-5, rtol=1e-5)
    for step in range(2):  # fed the true next tokens, as the training feeds them
        state = proposer.guess_step(["r"], state, ids[m + 2 + step:m + 3 + step], torch.tensor([m + 1 + step]),
                                    step)
        torch.testing.assert_close(state[0], unrolled[step + 1][m + 1 + step], atol=1e-5, rtol=1e-5)


def test_guess_mask_reads_true_states_then_each_guess_once():
    positions, sequence = torch.tensor([0, 1, 2, 3, 0, 1]), torch.tensor([0, 0, 0, 0, 1, 1])
    mask = _guess_mask(positions, sequence, 3)  # guess 3: step-1 keys up to j - 2, guess 2 at j - 1, own at j
    row = mask[3].view(3, 6)  # the query at position 3 of the first sequence
    assert row[0].tolist() == [True, True, False, False, False, False]
    assert row[1].tolist() == [False, False, True, False, False, False]
    assert row[2].tolist() == [False, False, False, True, False, False]
    assert not mask[5].view(3, 6)[:, :4].any()  # nothing across sequences


def test_head_file_round_trips_and_is_refused_for_another_model(trained_head, tiny_model_dirs, tmp_path):
    head = EagleHead.load(trained_head[0], torch.float32, torch.device("cpu"))
    assert head.config.target == "tiny-llama" and head.draft_to_target.dtype == torch.long
    with LLM(tiny_model_dirs["llama"], dtype="float32") as llm:
        arch = llm.engine.loaded.arch
    for other_arch in (dataclasses.replace(arch, hidden_size=96), dataclasses.replace(arch, vocab_size=330)):
        with pytest.raises(ValueError, match="trained for hidden size 64 and a vocabulary of 320"):
            head.config.check_target(other_arch)
    other = tmp_path / "plain.safetensors"
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(other))
    with pytest.raises(ValueError, match="not an EAGLE head"):
        EagleHead.load(str(other), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("options,match", [
    (dict(speculative="ngram", eagle_head="x.safetensors"), "--eagle-head goes with --speculative eagle"),
    (dict(speculative="eagle"), "needs --eagle-head for a model other than the default"),
    (dict(speculative="eagle", eagle_head="x", tensor_parallel_size=2), "runs on one process")])
def test_eagle_options_are_checked(tiny_model_dirs, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_dirs["llama"], dtype="float32", **options)


def test_training_prompts_are_not_the_benchmarks():
    tools, texts = eagle_training.training_asks(480, 0)
    assert len(set(tools)) == 240 and len(set(texts)) == 240
    assert not set(tools) & set(ASKS) and not set(texts) & set(FREE_TEXT)


def test_recorder_refuses_states_with_a_gap():
    recorder = eagle_training.StateRecorder()
    recorder.observe("r", 0, torch.zeros(3, 4))
    recorder.observe("r", 4, torch.zeros(1, 4))
    with pytest.raises(RuntimeError, match="expected 3"):
        recorder.take("r")


def test_proposer_is_registered():
    from xlserve.speculative.proposer import PROPOSERS
    assert PROPOSERS["eagle"] == ("xlserve.speculative.eagle", "EagleProposer")
    assert EagleProposer.wants_hidden
