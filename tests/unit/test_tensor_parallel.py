"""Tensor parallelism over real processes (gloo): two ranks, each with half of every layer's
heads, MLP and expert columns (or half the experts) and half the vocabulary, give rank 0
the tokens one process gives (greedy, and seeded sampling's draws) —
batched prompts of mixed lengths, prefilled in chunks, asked again for prefix hits — and
logits within float32 rounding of a single process; what cannot be split is refused clearly
and leaves no process behind."""

import psutil
import pytest
import torch

from xlserve import LLM, SamplingParams
from xlserve.parallel import tensor_parallel

DENSE = ["llama", "llama3", "qwen2", "qwen3", "mistral", "gemma3"]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "llama4", "gpt_oss"]  # deepseek_v3: MLA too
_SINGLE: dict[str, list] = {}


def _run(path: str, check=None, dtype: str = "float32", **options) -> list:
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 320, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 320, (n,), generator=gen).tolist() for n in (3, 17, 30)] + [shared[:9]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    with LLM(path, dtype=dtype, kv_cache_tokens=2048, max_num_batched_tokens=32, **options) as llm:
        first = llm.generate(prompts, params)
        again = llm.generate(prompts[:2], params)  # prefix-cache hits
        seeded = llm.generate(prompts[1:3], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=11,
                                                           ignore_eos=True, logprobs=0))  # rank 0 draws
        if options.get("data_parallel_attention"):
            assert min(llm.engine.scheduler.placed) >= 3  # each rank ran requests of its own
        if check is not None:
            check(llm)
        return first + again + seeded


@pytest.mark.parametrize("arch,expert_parallel,data_parallel_attention",
                         [(a, False, False) for a in DENSE + MOE] + [(a, True, False) for a in MOE]
                         + [(a, True, True) for a in MOE])
def test_two_ranks_equal_one(tiny_model_dirs, arch, expert_parallel, data_parallel_attention):
    """MoE layers split each expert's columns, or with expert parallelism give each rank
    half the experts; latent attention splits its heads and keeps the latent whole. With
    data-parallel attention each rank runs its own requests (both ranks get some: the
    batch's prompts are spread) and tokens travel to their experts' rank and back."""
    path = tiny_model_dirs[arch]
    if arch not in _SINGLE:
        _SINGLE[arch] = _run(path)
    single = _SINGLE[arch]
    split = _run(path, tensor_parallel_size=2, expert_parallel=expert_parallel,
                 data_parallel_attention=data_parallel_attention)
    for a, b in zip(single, split):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(x["logprob"] - y["logprob"]) <= 1e-4
    assert tensor_parallel.current().size == 1  # closing left the group


def test_data_parallel_attention_with_speculation_equals_one_rank(tiny_model_dirs):
    """Proposals checked on each rank's own rows (several rows a request), sampled on rank 0."""
    path = tiny_model_dirs["qwen3_moe"]
    single = _SINGLE.get("qwen3_moe") or _run(path)

    def proposed(llm) -> None:
        assert llm.engine.speculation.stats.proposed > 0 and llm.engine.speculation.stats.accepted > 0
    split = _run(path, check=proposed, tensor_parallel_size=2, expert_parallel=True, data_parallel_attention=True,
                 speculative="ngram", num_speculative_tokens=3)
    assert [a.outputs[0].token_ids for a in single] == [b.outputs[0].token_ids for b in split]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_data_parallel_attention_in_bfloat16_gives_one_process_bits(tiny_model_dirs, arch):
    """Under data-parallel attention no reduction is split across ranks (attention and the dense
    layers whole on each, an expert's rows computed on one rank, its results added in expert
    order), so with --deterministic bfloat16 output is one process's, bit for bit: tokens,
    seeded draws and logprobs."""
    options = dict(dtype="bfloat16", deterministic=True)
    single = _run(tiny_model_dirs[arch], **options)
    split = _run(tiny_model_dirs[arch], tensor_parallel_size=2, expert_parallel=True, data_parallel_attention=True,
                 **options)
    assert [(o.outputs[0].token_ids, [lp["logprob"] for lp in o.outputs[0].logprobs]) for o in single] == \
        [(o.outputs[0].token_ids, [lp["logprob"] for lp in o.outputs[0].logprobs]) for o in split]


def test_each_rank_holds_its_share(tiny_model_dirs, caplog):
    """... and reads only that share of the checkpoint (the norms are read whole)."""
    import re
    caplog.set_level("INFO", logger="xlserve.loader.model_loader")
    with LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_tokens=256, tensor_parallel_size=2) as llm:
        read, total = map(float, re.search(r"rank 0 read ([\d.]+) MiB of the checkpoint's ([\d.]+) MiB",
                                           caplog.text).groups())
        assert 0.45 * total < read < 0.55 * total
        runner = llm.engine.runner
        attn = runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # of 4 and 2
        assert runner.kv_caches[0][0].shape[1] == 1  # this rank's KV heads only
        assert runner.model.lm_head.weight.shape[0] == 160  # of 320 tokens
        children = psutil.Process().children()
        assert len(children) == 1 and children[0].is_running()
        listening = [c.laddr.ip for p in (psutil.Process(), *children) for c in p.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and set(listening) <= {"127.0.0.1", "::1"}  # one machine: nothing off loopback
    children[0].wait(timeout=30)


def test_data_parallel_attention_ranks_hold_every_layer_whole_but_half_the_experts(tiny_model_dirs, caplog):
    """... (each reading its slices of the memory-mapped files); each rank's KV pool holds every head."""
    caplog.set_level("INFO", logger="xlserve.loader.model_loader")
    with LLM(tiny_model_dirs["qwen3_moe"], dtype="float32", kv_cache_tokens=256, tensor_parallel_size=2,
             expert_parallel=True, data_parallel_attention=True) as llm:
        assert "rank 0 read" in caplog.text
        runner = llm.engine.runner
        layer = runner.model.model.layers[0]
        assert (layer.self_attn.num_heads, layer.self_attn.num_kv_heads) == (4, 2)  # all of them
        assert runner.kv_caches[0][0].shape[1] == 2 and runner.model.lm_head.weight.shape[0] == 320
        assert layer.mlp.local_experts * 2 == layer.mlp.num_experts
        assert llm.engine.kv.num_blocks == 2 * llm.engine.num_blocks  # a pool on each rank


@pytest.mark.parametrize("arch,size,match", [("llama", 3, "attention heads \\(4\\) does not divide over 3"),
                                             ("deepseek_v3", 3, "attention heads \\(4\\) does not divide over 3")])
def test_what_cannot_be_split_is_refused_and_no_rank_is_left(tiny_model_dirs, arch, size, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_dirs[arch], dtype="float32", kv_cache_tokens=256, tensor_parallel_size=size)
    assert not [p for p in psutil.Process().children() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert tensor_parallel.current().size == 1


def test_kv_hand_off_between_one_and_two_ranks(tiny_model_dirs):
    """A payload carries every KV head whatever the ranks hold: two ranks' export (rank 0
    gathers the other's heads) equals one process's, and either imports into the other
    layout (rank 0 scatters the other's heads) with a prefix hit and the same tokens."""
    hand_off_between_one_and_two(tiny_model_dirs["llama"], "tensor_parallel_size")


def hand_off_between_one_and_two(path: str, split: str) -> None:
    """Export from one process and from two (``split``: the option that makes it two), compare
    the payloads, and import each into the other layout: a prefix hit and the same tokens."""
    import numpy as np
    prompt = list(range(20, 90))  # 70 tokens: 4 full blocks
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    payloads, answers = {}, {}
    for size in (1, 2):
        with LLM(path, dtype="float32", kv_cache_tokens=1024, **{split: size}) as llm:
            answers[size] = llm.generate(prompt, greedy)[0].outputs[0].token_ids
            payloads[size] = llm.engine.kv.export(llm.engine.prompt_block_hashes(prompt))
    one, two, reference = payloads[1], payloads[2], answers[1]
    assert answers[2] == reference
    assert one.layout == two.layout and len(two.block_hashes) == 4
    np.testing.assert_allclose(np.frombuffer(two.data, np.float32), np.frombuffer(one.data, np.float32), atol=1e-4)
    for size, payload in ((1, two), (2, one)):
        with LLM(path, dtype="float32", kv_cache_tokens=1024, **{split: size}) as llm:
            assert llm.engine.kv.import_blocks(payload) == 4
            out = llm.generate(prompt, greedy)[0]
            assert out.cached_tokens == 64 and out.outputs[0].token_ids == reference


def test_kv_hand_off_from_and_into_each_data_parallel_rank(tiny_model_dirs):
    """Each rank's own pool exports (rank 0 receives rank 1's blocks point to point) what one
    process exports, and an import into rank 1's pool gives the request that follows a prefix
    hit there (it is placed on the rank that holds its prefix) and the same tokens; a pin is
    taken on the rank that holds the prefix."""
    import numpy as np
    path = tiny_model_dirs["deepseek_v3"]
    prompts = [list(range(20, 90)), list(range(100, 170))]  # 70 tokens each: 4 full blocks
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(path, dtype="float32", kv_cache_tokens=1024) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        single = [llm.engine.kv.export(llm.engine.prompt_block_hashes(p)) for p in prompts]
    options = dict(dtype="float32", kv_cache_tokens=1024, tensor_parallel_size=2, expert_parallel=True,
                   data_parallel_attention=True)
    with LLM(path, **options) as llm:
        engine = llm.engine
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == reference
        assert engine.scheduler.placed == [1, 1]
        for prompt, one in zip(prompts, single):
            hashes = engine.prompt_block_hashes(prompt)
            payload = engine.kv.export(hashes)
            assert payload.layout == one.layout and len(payload.block_hashes) == 4
            np.testing.assert_allclose(np.frombuffer(payload.data, np.float32), np.frombuffer(one.data, np.float32),
                                       atol=1e-4)
        grant = engine.kv.pin(engine.prompt_block_hashes(prompts[1]), 30)
        assert engine.kv.owner_of(grant.pin_id) == 1 and engine.kv.num_pins == 1
        assert engine.kv.export_pinned(grant.pin_id, grant.secret, grant.block_hashes).data == payload.data
        assert engine.kv.unpin(grant.pin_id) and engine.kv.num_pins == 0
    with LLM(path, **options) as llm:
        assert llm.engine.kv.pools[1].import_blocks(single[0]) == 4
        out = llm.generate(prompts[0], greedy)[0]
        assert out.cached_tokens == 64 and out.outputs[0].token_ids == reference[0]
        assert llm.engine.scheduler.placed == [0, 1]


@pytest.mark.parametrize("arch,split", [("llama", {"tensor_parallel_size": 2}),
                                        ("llama", {"pipeline_parallel_size": 2}),
                                        ("qwen3_moe", {"tensor_parallel_size": 2, "expert_parallel": True,
                                                       "data_parallel_attention": True})])
def test_a_dead_rank_stops_the_engine_within_the_timeout(tiny_model_dirs, arch, split):
    """Rank 1 (the other half of every layer, the second stage, or the other half of the
    experts and its own requests) killed between steps: rank 0's next collective or transfer
    fails, which is fatal (the ranks can no longer stay in step), well before
    --distributed-timeout."""
    import signal
    import time

    from xlserve.engine.errors import EngineFatal
    llm = LLM(tiny_model_dirs[arch], dtype="float32", kv_cache_tokens=256, distributed_timeout=20, **split)
    try:
        llm.generate(list(range(10, 20)), SamplingParams(max_tokens=2, temperature=0))
        (rank,) = psutil.Process().children()
        rank.send_signal(signal.SIGKILL)
        rank.wait(timeout=10)
        start = time.monotonic()
        with pytest.raises(EngineFatal, match="out of step"):
            llm.generate(list(range(10, 20)), SamplingParams(max_tokens=2, temperature=0))
        assert time.monotonic() - start < 20
    finally:
        llm.close()
    assert tensor_parallel.current().size == 1


def test_a_plan_towards_a_rank_that_stopped_reading_fails_within_the_timeout(tiny_model_dirs):
    """The plan group never times out (idle ranks wait on it), so rank 0's sends carry their own
    bound: a plan larger than the socket's buffers towards a rank that stopped reading fails
    the worker within --distributed-timeout instead of blocking it for good."""
    import signal
    import time

    from xlserve.engine.errors import EngineFatal
    from xlserve.parallel.rank_plan import PlanKind, RankPlan
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_tokens=256, distributed_timeout=3,
              tensor_parallel_size=2)
    (rank,) = psutil.Process().children()
    try:
        llm.generate(list(range(10, 20)), SamplingParams(max_tokens=2, temperature=0))
        rank.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineFatal, match="out of step"):
            llm.engine.ranks.broadcast(RankPlan(kind=PlanKind.KV_EXPORT, block_ids=list(range(4_000_000))))
        assert time.monotonic() - start < 15
    finally:
        rank.kill()
        llm.close()


def test_the_parallel_benchmark_runs(tiny_model_dirs):
    """``xlserve bench parallel`` end to end on a tiny model (its figures go to docs/benchmarks.md)."""
    from xlserve.bench.parallel_bench import ParallelBenchOptions, parallel_table, run_parallel_bench
    results = run_parallel_bench(ParallelBenchOptions(model=tiny_model_dirs["llama"], layouts=("1x1", "2x1", "1x2"),
                                                      repeats=1, dtype="float32"))
    assert results["summary"]["1x1"]["decode_b1"]["collective_share"] == 0
    for layout in ("2x1", "1x2"):
        split = results["summary"][layout]
        assert 0 < split["decode_b1"]["collective_share"] < 1 and split["load_s"]["median"] > 0
    assert "raw read of the files" in parallel_table(results)


def test_the_parallel_benchmark_runs_a_moe_with_data_parallel_attention(tiny_model_dirs):
    from xlserve.bench.parallel_bench import ParallelBenchOptions, parse_layout, run_parallel_bench
    assert parse_layout("2x1dp")[2] == {"expert_parallel": True, "data_parallel_attention": True}
    with pytest.raises(ValueError, match="2x1ep or 2x1dp"):
        parse_layout("2x1xp")
    results = run_parallel_bench(ParallelBenchOptions(model=tiny_model_dirs["qwen3_moe"], layouts=("2x1ep", "2x1dp"),
                                                      repeats=1, dtype="float32"))
    for layout in ("2x1ep", "2x1dp"):
        assert 0 < results["summary"][layout]["decode_b8"]["collective_share"] < 1


@pytest.mark.parametrize("arch,per_rank", [("llama", 0.5), ("deepseek_v3", 1.0)])
def test_a_pool_of_so_many_gib_per_rank(tiny_model_dirs, arch, per_rank):
    """--kv-cache-memory is per rank: split KV heads fit twice the tokens in it, MLA's latent
    (whole on every rank) the same number."""
    from xlserve.config import EngineConfig
    from xlserve.engine.llm_engine import pool_blocks
    from xlserve.loader.model_loader import load_model
    loaded = load_model(EngineConfig.from_kwargs(model=tiny_model_dirs[arch], dtype="float32").model)
    one, two = (pool_blocks(EngineConfig.from_kwargs(model="x", kv_cache_memory=0.01, tensor_parallel_size=n),
                            loaded) for n in (1, 2))
    assert one / two == pytest.approx(per_rank, rel=0.01)
