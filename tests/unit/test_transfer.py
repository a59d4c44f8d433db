"""The TCP KV transport between two real engines on 127.0.0.1, and its failure modes."""

import socket
import threading

import pytest

from xlserve import LLM, SamplingParams
from xlserve.transfer.base import TransferError, transport

PROMPT = list(range(30, 100))
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _llm(path):
    return LLM(path, dtype="float32", kv_cache_tokens=1024)


def test_pull_over_tcp_gives_identical_output(tiny_llama_dir):
    server_cls, client_cls = transport("tcp")
    prefill, decode = _llm(tiny_llama_dir), _llm(tiny_llama_dir)
    expected = _llm(tiny_llama_dir).generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    prefill.generate(PROMPT, SamplingParams(max_tokens=1))
    lock = threading.Lock()  # the engine is single-threaded; the worker routes this through its engine thread

    def export(hashes):
        with lock:
            return prefill.engine.export_kv(hashes)
    server = server_cls(export)
    address = server.start()
    try:
        handle = {**address, "block_hashes": [h.hex() for h in prefill.engine.prompt_block_hashes(PROMPT)]}
        payload = client_cls().pull(handle, timeout=10)
        assert len(payload.block_hashes) == 4
        assert decode.engine.import_kv(payload) == 4
        out = decode.generate(PROMPT, GREEDY)[0]
        assert out.cached_tokens == 64 and out.outputs[0].token_ids == expected
    finally:
        server.stop()


def test_pull_failures_raise_transfer_error():
    _, client_cls = transport("tcp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    with pytest.raises(TransferError, match="failed"):
        client_cls().pull({"host": "127.0.0.1", "port": dead_port, "block_hashes": []}, timeout=2)
    with pytest.raises(TransferError, match="bad KV handle"):
        client_cls().pull({"host": "127.0.0.1"}, timeout=2)
    # a peer that accepts and says nothing: the pull times out instead of hanging
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        with pytest.raises(TransferError):
            client_cls().pull({"host": "127.0.0.1", "port": silent.getsockname()[1], "block_hashes": []},
                              timeout=0.5)
    finally:
        silent.close()


def test_server_refuses_bad_requests(tiny_llama_dir):
    server_cls, client_cls = transport("tcp")
    server = server_cls(lambda hashes: (_ for _ in ()).throw(RuntimeError("engine says no")))
    address = server.start()
    try:
        with pytest.raises(TransferError, match="peer refused: engine says no"):
            client_cls().pull({**address, "block_hashes": []}, timeout=5)
        with socket.create_connection((address["host"], address["port"]), timeout=5) as sock:
            sock.sendall(b'{"block_hashes": ["zz"]}\n')
            assert b"bad block hash" in sock.makefile("rb").readline()
    finally:
        server.stop()
    with pytest.raises(ValueError, match="unknown; available"):
        transport("carrier-pigeon")
