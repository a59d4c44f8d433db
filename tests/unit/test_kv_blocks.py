"""KV blocks exported from one engine and imported into another: the second engine gets a
prefix hit and the same greedy output; pins hold blocks for a bounded time; bad payloads
are refused."""

import dataclasses

import pytest

from xlserve import LLM, SamplingParams
from xlserve.engine.kv_blocks import KVPayload

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0)
PROMPT = list(range(20, 90))  # 70 tokens: 4 full blocks of 16


def _llm(path, **kw):
    return LLM(path, dtype="float32", kv_cache_tokens=1024, **kw)


def test_exported_blocks_give_a_prefix_hit_and_identical_output(tiny_llama_dir):
    colocated = _llm(tiny_llama_dir).generate(PROMPT, GREEDY)[0]
    prefill, decode = _llm(tiny_llama_dir), _llm(tiny_llama_dir)
    first = prefill.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0))[0]
    assert first.outputs[0].token_ids == colocated.outputs[0].token_ids[:1]
    hashes = prefill.engine.prompt_block_hashes(PROMPT)
    payload = prefill.engine.kv.export(hashes)
    assert len(payload.block_hashes) == 4 and len(payload.data) == 4 * payload.layout.block_bytes
    assert decode.engine.kv.import_blocks(payload) == 4
    assert decode.engine.stats()["kv_blocks_used"] == 0  # imported blocks wait in the cache, unreferenced
    out = decode.generate(PROMPT, GREEDY)[0]
    assert out.cached_tokens == 64
    assert out.outputs[0].token_ids == colocated.outputs[0].token_ids
    # the imported blocks hold the exported bytes: the bits of the prefill engine's own prefix hit
    local = prefill.generate(PROMPT, GREEDY)[0]
    assert local.cached_tokens == 64 and _logprobs(out) == _logprobs(local)


def _logprobs(out) -> list[float]:
    return [entry["logprob"] for entry in out.outputs[0].logprobs]


def test_export_stops_at_the_first_missing_block(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    llm.generate(PROMPT[:40], SamplingParams(max_tokens=1))
    assert len(llm.engine.kv.export(llm.engine.prompt_block_hashes(PROMPT)).block_hashes) == 2
    assert llm.engine.kv.export(llm.engine.prompt_block_hashes([9] * 40)).block_hashes == []


def test_layout_mismatch_and_bad_sizes_are_refused(tiny_llama_dir, tiny_model_dirs):
    a, other = _llm(tiny_llama_dir), _llm(tiny_model_dirs["qwen3"])
    a.generate(PROMPT, SamplingParams(max_tokens=1))
    payload = a.engine.kv.export(a.engine.prompt_block_hashes(PROMPT))
    with pytest.raises(ValueError, match="layout mismatch"):
        other.engine.kv.import_blocks(payload)
    with pytest.raises(ValueError, match="need"):
        KVPayload(payload.layout, payload.block_hashes, payload.data[:-1])
    bf16 = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_tokens=1024)
    with pytest.raises(ValueError, match="layout mismatch"):
        bf16.engine.kv.import_blocks(payload)
    wrong_model = dataclasses.replace(payload.layout, model_key="00" * 8)
    with pytest.raises(ValueError, match="layout mismatch"):
        a.engine.kv.import_blocks(KVPayload(wrong_model, payload.block_hashes, payload.data))


def test_pins_hold_blocks_until_released_or_expired(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, num_kv_blocks=8, block_size=16)
    engine = llm.engine
    llm.generate(PROMPT, SamplingParams(max_tokens=1))
    hashes = engine.prompt_block_hashes(PROMPT)
    grant = engine.kv.pin(hashes, seconds=60)
    assert grant.block_hashes == hashes[:4] and engine.stats()["kv_blocks_used"] == 4
    assert len(grant.secret) == 32 and grant.secret != grant.pin_id  # 128 random bits, not the name
    llm.generate([5] * 60, SamplingParams(max_tokens=1))  # needs 4 blocks: only the unpinned ones are free
    assert len(engine.kv.export(hashes).block_hashes) == 4  # the pinned prefix survived
    payload = engine.kv.export_pinned(grant.pin_id, grant.secret, hashes[:3])
    assert payload.block_hashes == hashes[:3]
    for pin_id, secret, asked, why in [(grant.pin_id, "0" * 32, hashes[:4], "no pin with that id and secret"),
                                       ("nope", grant.secret, hashes[:4], "no pin"),
                                       (grant.pin_id, grant.secret, hashes[1:3], "not the first"),
                                       (grant.pin_id, grant.secret, hashes[:4] + hashes[:1], "not the first 5")]:
        with pytest.raises(PermissionError, match=why):
            engine.kv.export_pinned(pin_id, secret, asked)
    assert engine.kv.unpin(grant.pin_id) and not engine.kv.unpin(grant.pin_id)
    assert engine.stats()["kv_blocks_used"] == 0
    with pytest.raises(PermissionError):  # a released pin opens nothing
        engine.kv.export_pinned(grant.pin_id, grant.secret, hashes[:1])
    pin_id = engine.kv.pin(hashes, seconds=60).pin_id
    assert engine.kv.expire_pins(now=float("inf")) == 1
    assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["kv_pins"] == 0
    with pytest.raises(ValueError, match="pin time"):
        engine.kv.pin(hashes, seconds=0)


def test_import_into_a_full_pool_stops_early(tiny_llama_dir):
    src = _llm(tiny_llama_dir)
    src.generate(PROMPT, SamplingParams(max_tokens=1))
    payload = src.engine.kv.export(src.engine.prompt_block_hashes(PROMPT))
    dst = _llm(tiny_llama_dir, num_kv_blocks=6, block_size=16)
    pin_id = dst.engine.kv.pin([], seconds=1).pin_id
    held = dst.engine.scheduler.kv.pool.allocate(4)  # leave 2 free blocks
    assert dst.engine.kv.import_blocks(payload) == 2
    dst.engine.scheduler.kv.pool.free(held)
    dst.engine.kv.unpin(pin_id)


def test_the_pool_has_one_owner():
    """Export, import, pins and events go through the KV cache manager; nothing above the
    scheduler reaches into its block pool."""
    import inspect

    import xlserve.engine.llm_engine as engine
    import xlserve.worker.internal as internal
    for module in (engine, internal):
        assert ".pool" not in inspect.getsource(module), module.__name__


def test_an_idle_engine_drops_expired_pins(tiny_llama_dir):
    """Pins expire between steps, also when no request runs (a prefill worker whose pins no
    decode worker pulled must not hold their blocks until the next request)."""
    import time

    from xlserve.worker.async_engine import AsyncEngine
    llm = _llm(tiny_llama_dir)
    llm.generate(PROMPT, SamplingParams(max_tokens=1))
    engine = AsyncEngine(llm.engine, max_waiting=8)
    try:
        hashes = llm.engine.prompt_block_hashes(PROMPT)
        engine.call_blocking(lambda e: e.kv.pin(hashes, seconds=0.2))
        assert engine.call_blocking(lambda e: e.stats())["kv_pins"] == 1
        time.sleep(1.5)  # past the pin's 0.2 s and the idle loop's 0.5 s wait; no request runs
        assert not llm.engine.has_unfinished_requests()
        stats = engine.call_blocking(lambda e: e.stats())
        assert stats["kv_pins"] == 0 and stats["kv_blocks_used"] == 0
    finally:
        engine.shutdown()
