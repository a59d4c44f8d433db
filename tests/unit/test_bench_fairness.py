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
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    assert system.kv_token_bytes == per_token and system.kv_bytes() == 0
    system.prefill(list(range(3, 13)))
    assert system.kv_bytes() == 10 * per_token
    system.decode_batch([list(range(3, 8)), list(range(9, 14))], 4)  # 2 sequences of 5 + 4 tokens
    assert system.kv_bytes() == 18 * per_token
    system.prefill(list(range(3, 9)))  # a smaller one later does not lower the peak
    assert system.kv_bytes() == 18 * per_token
