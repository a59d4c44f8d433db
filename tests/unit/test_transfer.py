"""The KV transports (the built-in TCP one, Mooncake's Transfer Engine) between two real
engines on 127.0.0.1: pins are capabilities, and the puller trusts nothing a peer sends
(fake peers on real sockets)."""

import json
import socket
import threading
import time

import pytest

from xlserve import LLM, SamplingParams
from xlserve.transfer import tcp
from xlserve.transfer.base import TransferError, transport

PROMPT = list(range(30, 100))
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _llm(path):
    return LLM(path, dtype="float32", kv_cache_tokens=1024)


def _mooncake_or_skip():
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:  # the package or its system library (libibverbs1) is missing
        pytest.skip(f"Mooncake cannot run here: {e}")


@pytest.fixture(params=["tcp", "mooncake"])
def any_prefill(request, tiny_llama_dir):
    """``prefill`` behind each transport, with that transport's client."""
    if request.param == "mooncake":
        _mooncake_or_skip()
    server_cls, client_cls = transport(request.param)
    yield from _serving(tiny_llama_dir, server_cls, client_cls())


@pytest.fixture
def prefill(tiny_llama_dir):
    """A prefill engine holding PROMPT's blocks, its pin, and a KV server in front of it."""
    for llm, handle, _ in _serving(tiny_llama_dir, tcp.TCPTransportServer, None):
        yield llm, handle


def _serving(tiny_llama_dir, server_cls, client):
    llm = _llm(tiny_llama_dir)
    llm.generate(PROMPT, SamplingParams(max_tokens=1))
    grant = llm.engine.kv.pin(llm.engine.prompt_block_hashes(PROMPT), 60)
    lock = threading.Lock()  # the engine is single-threaded; a worker routes this through its engine thread

    def export(pin_id, secret, hashes):
        with lock:
            return llm.engine.kv.export_pinned(pin_id, secret, hashes)
    server = server_cls(export)
    address = server.start()
    handle = {**address, "pin_id": grant.pin_id, "secret": grant.secret,
              "block_hashes": [h.hex() for h in grant.block_hashes]}
    yield llm, handle, client
    server.stop()


def test_a_pull_gives_identical_output(tiny_llama_dir, any_prefill):
    llm, handle, client = any_prefill
    decode = _llm(tiny_llama_dir)
    expected = _llm(tiny_llama_dir).generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    payload = client.pull(handle, 10, decode.engine.kv.layout)
    assert len(payload.block_hashes) == 4
    assert decode.engine.kv.import_blocks(payload) == 4
    out = decode.generate(PROMPT, GREEDY)[0]
    assert out.cached_tokens == 64 and out.outputs[0].token_ids == expected


def test_a_pull_needs_the_pins_secret_and_gets_only_its_blocks(any_prefill):
    llm, handle, client = any_prefill
    layout = llm.engine.kv.layout
    for bad, why in [({**handle, "secret": "0" * 32}, "no pin with that id and secret"),
                     ({**handle, "secret": ""}, "no pin"),
                     ({**handle, "pin_id": "guessed"}, "no pin"),
                     ({**handle, "block_hashes": handle["block_hashes"][1:]}, "are not the first 3"),
                     ({**handle, "block_hashes": handle["block_hashes"] + ["00" * 8]}, "are not the first 5")]:
        with pytest.raises(TransferError, match=why):
            client.pull(bad, 5, layout)
    with pytest.raises(TransferError, match="bad KV handle"):
        client.pull({k: v for k, v in handle.items() if k != "secret"}, 5, layout)
    assert len(client.pull(handle, 5, layout).block_hashes) == 4  # the right secret still works


class FakePeer:
    """A KV server that answers every pull with ``answer(request) -> bytes`` (then stalls)."""

    def __init__(self, answer):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port, self.answer, self.conns = self.sock.getsockname()[1], answer, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            request = json.loads(conn.makefile("rb").readline())
            conn.sendall(self.answer(request))  # and never closes: a stalling peer

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def _header(request, ours, **override):
    header = {"ok": True, "layout": ours.to_json(), "block_hashes": request["block_hashes"],
              "nbytes": len(request["block_hashes"]) * ours.block_bytes, **override}
    return json.dumps(header).encode() + b"\n"


def test_the_puller_refuses_what_it_did_not_ask_for_within_the_deadline(prefill):
    llm, handle = prefill
    layout = llm.engine.kv.layout
    other_layout = {**layout.to_json(), "num_kv_heads": layout.num_kv_heads * 2}
    cases = {
        "other blocks than those asked": lambda r: _header(r, layout, block_hashes=r["block_hashes"][:1]),
        "layout": lambda r: _header(r, layout, layout=other_layout),
        "announces": lambda r: _header(r, layout, nbytes=10**12),  # oversized: refused before reading
        "timed out with": lambda r: _header(r, layout) + b"\0" * 100,  # short payload, then a stall
        "timed out": lambda r: b'{"ok": true, "lay',  # stalls mid-header
        "header is not JSON": lambda r: b"\xff\xfe garbage\n",
    }
    for why, answer in cases.items():
        peer = FakePeer(answer)
        try:
            began = time.monotonic()
            with pytest.raises(TransferError, match=why):
                tcp.TCPTransportClient().pull({**handle, "port": peer.port}, 1.0, layout)
            assert time.monotonic() - began < 2.0, why  # the deadline held
        finally:
            peer.close()


def test_idle_connections_neither_block_pulls_nor_hold_server_threads(prefill, monkeypatch):
    llm, handle = prefill
    monkeypatch.setattr(tcp, "CONNECTION_TIMEOUT_S", 0.5)
    idle = [socket.create_connection((handle["host"], handle["port"])) for _ in range(100)]
    try:
        began = time.monotonic()
        payload = tcp.TCPTransportClient().pull(handle, 5, llm.engine.kv.layout)
        assert len(payload.block_hashes) == 4 and time.monotonic() - began < 2
        idle[0].settimeout(3)
        answer = idle[0].makefile("rb").readline()  # the server gave up on it
        assert b"timed out" in answer
    finally:
        for s in idle:
            s.close()


def test_pull_failures_raise_transfer_error(prefill):
    llm, handle = prefill
    layout = llm.engine.kv.layout
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    with pytest.raises(TransferError, match="failed"):
        tcp.TCPTransportClient().pull({**handle, "port": dead_port}, 2, layout)
    with pytest.raises(ValueError, match="unknown; available"):
        transport("carrier-pigeon")
