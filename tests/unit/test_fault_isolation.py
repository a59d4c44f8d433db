"""A request can only fail itself: extreme sampling parameters never produce NaN draws,
a failure inside one request's step ends that request alone, and only a fatal error
stops the engine (loudly, with every waiter told)."""

import asyncio
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xlserve import LLM, SamplingParams
from xlserve.engine.errors import EngineFatal
from xlserve.engine.sampler import Sampler
from xlserve.worker.async_engine import AsyncEngine, EngineDead, RequestFailed

PROMPT = [5, 17, 42, 99, 7, 250, 31]
NORMAL = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# Each of these stopped the engine thread for good (NaN probabilities in torch.multinomial).
KILLERS = [dict(temperature=5e-324), dict(temperature=1e-30, top_p=0.5), dict(top_p=1e-300),
           dict(top_p=5e-324, top_k=3), dict(temperature=100.0, min_p=1.0, top_p=1e-300)]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, kv_cache_tokens=2048)  # the default dtype of this CPU


@pytest.mark.parametrize("kwargs", KILLERS)
def test_engine_killing_parameters_sample_and_the_engine_serves_on(llm, kwargs):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True, seed=1, **kwargs))[0]
    assert out.error is None and out.outputs[0].finish_reason == "length"
    assert all(0 <= t < 320 for t in out.outputs[0].token_ids)
    assert llm.generate(PROMPT, NORMAL)[0].outputs[0].finish_reason == "length"
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_parameters_that_underflow_are_refused_with_a_clear_error():
    for kwargs, message in [(dict(repetition_penalty=1e-300), "repetition_penalty"),
                            (dict(temperature=float("nan")), "temperature"),
                            (dict(top_p=float("inf")), "top_p"), (dict(seed=2**70), "seed")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    assert SamplingParams(temperature=1e-9).greedy  # below the floor: greedy, as in the peers


SAMPLING = st.fixed_dictionaries({
    "temperature": st.one_of(st.just(0.0), st.floats(0, 100), st.floats(0, 1e-4)),
    "top_p": st.one_of(st.just(1.0), st.floats(5e-324, 1.0, exclude_min=False), st.floats(1e-320, 1e-6)),
    "top_k": st.integers(-1, 400),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.one_of(st.just(1.0), st.floats(0.01, 10)),
    "seed": st.integers(-(2**63), 2**64 - 1),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kwargs=SAMPLING)
def test_property_any_valid_parameters_generate_on_the_tiny_model(llm, kwargs):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2, **kwargs))[0]
    assert out.error is None and out.outputs[0].finish_reason == "length"
    assert all(0 <= t < 320 for t in out.outputs[0].token_ids)
    assert all(math.isfinite(e["logprob"]) or e["logprob"] == -math.inf for e in out.outputs[0].logprobs)


@settings(max_examples=300, deadline=None)
@given(kwargs=SAMPLING, scale=st.sampled_from([1.0, 1e4, 1e30, 3e38]), masked=st.integers(0, 63))
def test_property_sampler_rows_never_fail_on_finite_logits(kwargs, scale, masked):
    """Logits as large as float32 holds, most of them masked: always a token that is allowed."""
    row = torch.randn(64, generator=torch.Generator().manual_seed(masked)).clamp(-1, 1) * scale
    row[:masked] = float("-inf")
    params = SamplingParams(max_tokens=1, **kwargs)
    token = Sampler().sample_row(row, params, torch.Generator().manual_seed(0), [1, 2, 60], [3, 3, 60])
    assert masked <= token < 64


def _poison_forward(model, poison: int):
    """Test hook: the model raises inside any step whose batch holds ``poison``."""
    forward = model.forward

    def guarded(input_ids, positions, meta, hidden=None):
        if bool((input_ids == poison).any()):
            raise RuntimeError("injected fault")
        return forward(input_ids, positions, meta, hidden)
    model.forward = guarded
    return lambda: setattr(model, "forward", forward)


def _unused_token(*seen) -> int:
    return next(t for t in range(319, 0, -1) if all(t not in ids for ids in seen))


def test_injected_fault_ends_only_its_request_offline(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_tokens=2048)
    alone = llm.generate(PROMPT, NORMAL)[0].outputs[0].token_ids
    poison = _unused_token(PROMPT, alone)
    restore = _poison_forward(llm.engine.runner.model, poison)
    try:
        bad, good = llm.generate([[poison, 4, 5], PROMPT], NORMAL)
    finally:
        restore()
    assert bad.outputs[0].finish_reason == "error" and "injected fault" in bad.error
    assert good.error is None and good.outputs[0].token_ids == alone
    assert llm.engine.stats()["kv_blocks_used"] == 0


async def _collect(stream):
    return [out async for out in stream]


def test_injected_fault_in_a_step_ends_that_request_while_a_concurrent_one_completes(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_tokens=2048)
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPT, long)[0].outputs[0].token_ids
    poison = _unused_token(PROMPT, alone)
    fatal = []
    engine = AsyncEngine(llm.engine, max_waiting=8, on_fatal=fatal.append)
    restore = _poison_forward(llm.engine.runner.model, poison)

    async def run():
        good = engine.submit("good", PROMPT, long)
        await good.accepted()
        await good.__anext__()  # running: the poisoned request joins its batch
        bad = engine.submit("bad", [poison, 4, 5], NORMAL)
        results = await asyncio.gather(_collect(good), _collect(bad), return_exceptions=True)
        return results
    try:
        good, bad = asyncio.run(run())
    finally:
        restore()
        engine.shutdown()
    assert isinstance(bad, RequestFailed) and "injected fault" in str(bad)
    assert good[-1].outputs[0].token_ids == alone and good[-1].outputs[0].finish_reason == "length"
    assert not fatal and engine.health_problem(60) is None
    assert llm.engine.stats()["num_failed_requests"] == 1
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_a_fatal_error_stops_the_engine_tells_every_waiter_and_calls_on_fatal(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_tokens=2048)
    fatal = []
    engine = AsyncEngine(llm.engine, max_waiting=8, on_fatal=fatal.append)

    def broken(_output):
        raise EngineFatal("device lost")
    llm.engine.runner.execute = broken

    async def run():
        return await asyncio.gather(_collect(engine.submit("a", PROMPT, NORMAL)), return_exceptions=True)
    (result,) = asyncio.run(run())
    engine.shutdown()
    assert isinstance(result, EngineDead) and "device lost" in str(result)
    assert len(fatal) == 1 and "engine stopped" in engine.health_problem(60)
    with pytest.raises(EngineDead):
        asyncio.run(_collect(engine.submit("b", PROMPT, NORMAL)))


def test_refusals_raise_before_any_output(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_tokens=2048)
    engine = AsyncEngine(llm.engine, max_waiting=8)

    async def run():
        stream = engine.submit("oov", [5, 320, 6], NORMAL)
        with pytest.raises(ValueError, match="token ids must be in"):
            await stream.accepted()
    asyncio.run(run())
    engine.shutdown()
    assert engine.num_pending() == 0


def test_a_row_of_non_finite_logits_fails_only_its_request(llm):
    from xlserve.engine.scheduler import ScheduledRequest
    rows = torch.randn(3, 320)
    rows[1, 7], rows[2, 9] = float("nan"), float("inf")
    scheduled = [ScheduledRequest(f"r{i}", [5], 3, [0], True, SamplingParams(temperature=t), 1, 0)
                 for i, t in enumerate((0.0, 0.0, 0.8))]
    out = llm.engine.runner._sample(rows, scheduled)
    assert out.sampled == {"r0": [int(rows[0].argmax())]}
    assert set(out.errors) == {"r1", "r2"} and "non-finite logits" in out.errors["r1"]


def test_greedy_tokens_are_the_first_maximum_and_flag_non_finite_rows():
    """The CPU argmax (numpy) and the device one (torch max) agree: the first of equal maxima,
    and a row holding NaN or +inf, or nothing but -inf, is not finite."""
    from xlserve.engine.request_sampling import _greedy_tokens
    rows = torch.randn(6, 50)
    rows[0, [3, 17]] = 9.0  # a tie: the first wins
    rows[1, 40] = float("nan")
    rows[2, 2] = float("inf")
    rows[3] = float("-inf")
    rows[4, 11] = -float("inf")
    tokens, finite = _greedy_tokens(rows)
    assert tokens[0] == 3 and tokens[1] == 40 and tokens[2] == 2 and tokens[3] == 0
    assert finite == [True, False, False, False, True, True]
    assert (tokens, finite) == (rows.max(-1).indices.tolist(), torch.isfinite(rows.max(-1).values).tolist())
