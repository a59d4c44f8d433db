"""KV transport through Mooncake's Transfer Engine (``--kv-transport mooncake``).

The capability rules are the TCP transport's, on the same control connection: the puller
sends the pin id, its secret and the block hashes; the server checks them, exports the
blocks and answers the header (layout, hashes, byte count) that the puller checks before
anything moves. Then, instead of streaming the bytes on that connection, the server
registers the payload with its Transfer Engine and names its address; the puller reads it
into a buffer of its own registered with its engine (TCP here, RDMA where the engine has
it), and says ``done``, which releases the server's registration. The engines meet by
``P2PHANDSHAKE``: no metadata server. Everything is bounded by the pull's one deadline.

The Transfer Engine does not authenticate its peers: while a payload is registered, a
process that reaches the server's engine port and knows the address could read it. Run it
on the private network that Mooncake is built for; the pin's secret still guards which
blocks are exported at all.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np

from xlserve.engine.kv_blocks import KVPayload
from xlserve.transfer.base import TransferError
from xlserve.transfer.tcp import TCPTransportClient, TCPTransportServer, _DeadlineReader

_ENGINES: dict[str, object] = {}  # one Transfer Engine per process and host
_LOCK = threading.Lock()


def transfer_engine(host: str):
    """This process's Transfer Engine on ``host`` (started on first use)."""
    from xlserve.kvstore.mooncake import client_environment

    with _LOCK:
        if host not in _ENGINES:
            client_environment(host)
            from mooncake.engine import TransferEngine

            engine = TransferEngine()
            if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError(f"the Mooncake Transfer Engine did not start on {host}")
            _ENGINES[host] = engine
        return _ENGINES[host]


class MooncakeTransportServer(TCPTransportServer):
    name = "mooncake"

    def start(self) -> dict:
        engine = transfer_engine(self.host)
        self.session = f"{self.host}:{engine.get_rpc_port()}"
        return super().start()

    def send_payload(self, sock: socket.socket, reader: _DeadlineReader, header: dict, payload: KVPayload) -> None:
        engine = transfer_engine(self.host)
        data = np.frombuffer(payload.data, dtype=np.uint8)  # kept alive until the puller is done
        address = data.ctypes.data
        if data.size and engine.register_memory(address, data.size) != 0:
            raise TransferError("the Transfer Engine refused to register the payload")
        try:
            header = {**header, "mooncake": {"session": self.session, "address": address}}
            sock.sendall(json.dumps(header).encode() + b"\n")
            reader.line()  # "done" (or the connection's deadline)
        finally:
            if data.size:
                engine.unregister_memory(address)


class MooncakeTransportClient(TCPTransportClient):
    def receive_payload(self, sock: socket.socket, reader: _DeadlineReader, header: dict, nbytes: int) -> bytes:
        try:
            where = header["mooncake"]
            session, address = str(where["session"]), int(where["address"])
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"the answer does not say where its payload is: {e}") from e
        host = sock.getsockname()[0]
        engine = transfer_engine(host)
        buffer = np.empty(nbytes, dtype=np.uint8)
        if nbytes:
            result: list[int] = []
            reading = threading.Thread(target=lambda: result.append(_read(engine, session, address, buffer)),
                                       name="kv-transfer-mooncake-read", daemon=True)
            reading.start()
            reading.join(max(0.0, reader.deadline - time.monotonic()))
            if not result:  # the thread finishes on its own and releases the buffer
                raise TransferError(f"the Transfer Engine read from {session} timed out")
            if result[0] != 0:
                raise TransferError(f"the Transfer Engine read from {session} failed (code {result[0]})")
        sock.sendall(b'{"done": true}\n')
        return buffer.tobytes()


def _read(engine, session: str, address: int, buffer: np.ndarray) -> int:
    local = buffer.ctypes.data
    if engine.register_memory(local, buffer.size) != 0:
        return -1
    try:
        return engine.transfer_sync_read(session, local, address, buffer.size)
    finally:
        engine.unregister_memory(local)
