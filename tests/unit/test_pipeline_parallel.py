"""Pipeline parallelism over real processes (gloo): two stages (each a run of layers, the
step cut into micro-batches that overlap), alone and with two tensor-parallel ranks per
stage, give rank 0 the tokens one process gives (greedy, and seeded sampling's draws) —
batched prompts of mixed lengths, prefilled in chunks, asked again for prefix hits — and
logits within float32 rounding; the stage split follows the layers' planned cost; the KV
hand-off moves every stage's layers. The micro-batch cut and the split are tested without
a model."""

import psutil
import pytest

from tests.unit.test_tensor_parallel import DENSE, MOE, _run, hand_off_between_one_and_two
from xlserve import LLM, SamplingParams
from xlserve.engine.scheduler import ScheduledRequest
from xlserve.parallel import pipeline_parallel, tensor_parallel
from xlserve.parallel.pipeline_parallel import micro_batches, split_evenly

_SINGLE: dict[str, list] = {}


def _same(single: list, split: list) -> None:
    for a, b in zip(single, split, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(x["logprob"] - y["logprob"]) <= 1e-4


@pytest.mark.parametrize("arch", DENSE + MOE)
def test_two_stages_equal_one(tiny_model_dirs, arch):
    """Every family: the windowed ones (gemma3, llama4, gpt_oss) keep their layer groups' slots per stage."""
    path = tiny_model_dirs[arch]
    if arch not in _SINGLE:
        _SINGLE[arch] = _run(path)
    _same(_SINGLE[arch], _run(path, pipeline_parallel_size=2))
    assert pipeline_parallel.current().count == 1  # closing left the group


@pytest.mark.parametrize("arch,expert_parallel", [("llama", False), ("deepseek_v3", True)])
def test_two_stages_of_two_ranks_equal_one(tiny_model_dirs, arch, expert_parallel):
    """Four processes: tensor parallel within each stage (experts split across its ranks), stages in a pipeline."""
    path = tiny_model_dirs[arch]
    if arch not in _SINGLE:
        _SINGLE[arch] = _run(path)
    _same(_SINGLE[arch], _run(path, pipeline_parallel_size=2, tensor_parallel_size=2, expert_parallel=expert_parallel))
    assert tensor_parallel.current().size == 1 and pipeline_parallel.current().count == 1


def test_each_stage_holds_its_layers(tiny_model_dirs, caplog):
    """The head counts on the last stage (a third of a layer's cost here): of three layers, the
    first stage takes two. Rank 0 builds and reads only its layers and the embedding."""
    import re

    from xlserve.parallel.pipeline_parallel import Elsewhere
    caplog.set_level("INFO", logger="xlserve.loader.model_loader")
    with LLM(tiny_model_dirs["deepseek_v3"], dtype="float32", kv_cache_tokens=256, pipeline_parallel_size=2) as llm:
        model = llm.engine.runner.model
        assert [isinstance(layer, Elsewhere) for layer in model.model.layers] == [False, False, True]
        assert model.lm_head is None and model.model.norm is None
        assert [slot is None for slot in llm.engine.runner.kv_caches] == [False, False, True]
        read, total = map(float, re.search(r"rank 0 read ([\d.]+) MiB of the checkpoint's ([\d.]+) MiB",
                                           caplog.text).groups())
        assert read < 0.7 * total
        children = psutil.Process().children()
        assert len(children) == 1
        out = llm.generate(list(range(10, 40)), SamplingParams(max_tokens=4, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 4
    children[0].wait(timeout=30)


def test_more_stages_than_layers_is_refused_and_no_rank_is_left(tiny_model_dirs):
    with pytest.raises(ValueError, match="3 pipeline stages for 2 layers"):
        LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_tokens=256, pipeline_parallel_size=3)
    assert not [p for p in psutil.Process().children() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert pipeline_parallel.current().count == 1


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_kv_hand_off_between_one_and_two_stages(tiny_model_dirs, arch):
    """A payload carries every layer whatever the stages hold: two stages' export (rank 0
    gathers the other stage's layers) equals one process's, and either imports into the
    other layout with a prefix hit and the same tokens."""
    hand_off_between_one_and_two(tiny_model_dirs[arch], "pipeline_parallel_size")


def _chunk(rid: str, tokens: int, start: int = 0, sample: bool = True) -> ScheduledRequest:
    from xlserve.sampling_params import SamplingParams as Params
    return ScheduledRequest(rid, list(range(tokens)), start, [0, 1, 2, 3], sample, Params(), None, 0)


def test_micro_batches_cut_the_rows_evenly_and_only_the_last_piece_samples():
    step = [_chunk("a", 1, 40), _chunk("b", 9, 0), _chunk("c", 1, 7), _chunk("d", 5, 16, sample=False)]
    batches = micro_batches(step, 2)
    assert [[(s.request_id, len(s.token_ids), s.start_position, s.sample) for s in b] for b in batches] == [
        [("a", 1, 40, True), ("b", 7, 0, False)],
        [("b", 2, 7, True), ("c", 1, 7, True), ("d", 5, 16, False)]]
    decode = [_chunk(str(i), 1, 9) for i in range(8)]
    assert micro_batches(decode, 2) == [decode]  # weight-bound: cutting would read every weight twice
    whole = micro_batches([_chunk("a", 64)], 4)
    assert [(b[0].start_position, len(b[0].token_ids), b[0].sample) for b in whole] == [
        (0, 16, False), (16, 16, False), (32, 16, False), (48, 16, True)]


def test_the_split_evens_the_costliest_stage():
    assert split_evenly([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert split_evenly([3, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]  # not two layers each
    assert split_evenly([1, 1, 1, 1, 5], 2) == [range(0, 4), range(4, 5)]  # a heavy head on the last layer
    assert split_evenly([2, 2, 2], 3) == [range(0, 1), range(1, 2), range(2, 3)]
