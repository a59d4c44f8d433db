"""The built-in KV transport: one TCP connection per pull.

Request: one JSON line ``{"pin_id": ..., "secret": ..., "block_hashes": [hex, ...]}``.
Answer: one JSON line ``{"ok": true, "layout": {...}, "block_hashes": [...], "nbytes": N}``
followed by exactly N raw bytes, or ``{"ok": false, "error": "..."}``. Only the holder of
a pin's secret gets that pin's blocks. The puller trusts nothing it reads: the answer
must name exactly the blocks asked for, in the layout asked for, with exactly the bytes
that layout needs (checked before a payload byte is read), and every read shares one
deadline, so a peer that stalls mid-header or mid-payload is cut at it. The server gives
each connection a bounded time too: an idle connection never holds a thread forever.
Nothing is unpickled. The control exchange is shared with the Mooncake transport
(``transfer/mooncake.py``), which moves the payload itself through Mooncake's engine.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
import time

from xlserve.engine.kv_blocks import KVLayout, KVPayload
from xlserve.transfer.base import ExportFn, KVTransportClient, KVTransportServer, TransferError

log = logging.getLogger(__name__)
MAX_LINE = 4 * 1024 * 1024
MAX_BLOCKS = 65536
CONNECTION_TIMEOUT_S = 10.0  # the server's bound on one connection's request and answer


class _DeadlineReader:
    """Reads from a socket; every byte by one deadline (a trickling peer cannot stretch it)."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline, self.buffer = sock, deadline, bytearray()

    def _read(self, read, have: int, want: int):
        """One read of the socket (``read()``: bytes or a count) within the deadline."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransferError(f"timed out with {have} of {want} bytes read")
        self.sock.settimeout(left)
        try:
            result = read()
        except socket.timeout as e:
            raise TransferError(f"timed out with {have} of {want} bytes read") from e
        if not result:
            raise TransferError(f"connection closed after {have} of {want} bytes")
        return result

    def _fill(self, want: int) -> None:
        """At least ``want`` bytes buffered; reads in chunks (a header line must not cost a
        system call per byte; what is read past it stays buffered for the payload)."""
        while len(self.buffer) < want:
            self.buffer += self._read(lambda: self.sock.recv(min(max(want - len(self.buffer), 1 << 16), 1 << 20)),
                                      len(self.buffer), want)

    def line(self) -> dict:
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_LINE:
                raise TransferError("oversized header line")
            self._fill(len(self.buffer) + 1)
        end = self.buffer.index(b"\n")
        if end > MAX_LINE:
            raise TransferError("oversized header line")
        line = bytes(self.buffer[:end])
        del self.buffer[:end + 1]
        return _json_object(line)

    def exactly(self, n: int) -> bytearray:
        """``n`` bytes, read straight into one buffer of that size. A payload is megabytes:
        grown chunk by chunk (about 180 reallocations for a 500-token prompt of the default
        model) and then copied out whole, it was allocated twice and freed in pieces."""
        out = bytearray(n)
        got = min(n, len(self.buffer))
        out[:got] = self.buffer[:got]
        del self.buffer[:got]
        with memoryview(out) as view:
            while got < n:
                got += self._read(lambda at=got: self.sock.recv_into(view[at:], min(n - at, 1 << 20)), got, n)
        return out


def _json_object(line: bytes) -> dict:
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TransferError(f"header is not JSON: {e}") from e
    if not isinstance(value, dict):
        raise TransferError("header is not a JSON object")
    return value


def _hashes(value) -> list[bytes]:
    if not isinstance(value, list) or len(value) > MAX_BLOCKS:
        raise TransferError(f"block_hashes must be a list of at most {MAX_BLOCKS} hex strings")
    try:
        return [bytes.fromhex(h) for h in value]
    except (TypeError, ValueError) as e:
        raise TransferError(f"bad block hash: {e}") from e


class TCPTransportServer(KVTransportServer):
    name = "tcp"

    def __init__(self, export: ExportFn, host: str = "127.0.0.1", port: int = 0):
        self.export, self.host, self.port = export, host, port
        self._server: socketserver.ThreadingTCPServer | None = None

    def send_payload(self, sock: socket.socket, reader: _DeadlineReader, header: dict, payload: KVPayload) -> None:
        """The answer after the checks: the header line, then the payload's bytes."""
        sock.sendall(json.dumps(header).encode() + b"\n")
        sock.sendall(payload.data)

    def start(self) -> dict:
        export, transport = self.export, self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                sock: socket.socket = self.request
                deadline = time.monotonic() + CONNECTION_TIMEOUT_S
                try:
                    reader = _DeadlineReader(sock, deadline)
                    request = reader.line()
                    payload = export(str(request.get("pin_id", "")), str(request.get("secret", "")),
                                     _hashes(request.get("block_hashes")))
                    header = {"ok": True, "layout": payload.layout.to_json(), "nbytes": len(payload.data),
                              "block_hashes": [h.hex() for h in payload.block_hashes]}
                    sock.settimeout(max(0.1, deadline - time.monotonic()))
                    transport.send_payload(sock, reader, header, payload)
                except Exception as e:  # answer the peer instead of dropping it
                    log.warning("KV pull from %s refused: %s", self.client_address, e)
                    try:
                        sock.settimeout(1.0)
                        sock.sendall(json.dumps({"ok": False, "error": str(e)}).encode() + b"\n")
                    except OSError:
                        pass

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="kv-transfer", daemon=True).start()
        return {"transport": self.name, "host": self.host, "port": self.port}

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class TCPTransportClient(KVTransportClient):
    def receive_payload(self, sock: socket.socket, reader: _DeadlineReader, header: dict,
                        nbytes: int) -> bytearray:
        """The payload's ``nbytes`` bytes, after the header passed every check."""
        return reader.exactly(nbytes)

    def pull(self, handle: dict, timeout: float, layout: KVLayout) -> KVPayload:
        deadline = time.monotonic() + timeout
        try:
            host, port = str(handle["host"]), int(handle["port"])
            request = {"pin_id": str(handle["pin_id"]), "secret": str(handle["secret"]),
                       "block_hashes": [str(h) for h in handle["block_hashes"]]}
            asked = _hashes(request["block_hashes"])
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"bad KV handle: {type(e).__name__} {e}") from e
        try:
            with socket.create_connection((host, port), timeout=timeout) as sock:
                sock.sendall(json.dumps(request).encode() + b"\n")
                reader = _DeadlineReader(sock, deadline)
                header = reader.line()
                if not header.get("ok"):
                    raise TransferError(f"peer refused: {header.get('error', 'no reason given')}")
                nbytes = _check_header(header, asked, layout)
                return KVPayload(layout, asked, self.receive_payload(sock, reader, header, nbytes))
        except TransferError:
            raise
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise TransferError(f"KV pull from {host}:{port} failed: {type(e).__name__} {e}") from e


def _check_header(header: dict, asked: list[bytes], layout: KVLayout) -> int:
    """The payload size the answer may have: exactly what was asked, in our layout."""
    try:
        theirs = KVLayout(**header["layout"])
    except (KeyError, TypeError) as e:
        raise TransferError(f"the answer's layout is malformed: {e}") from e
    if theirs != layout:
        raise TransferError(f"the answer's layout {theirs} is not ours {layout}")
    if _hashes(header.get("block_hashes")) != asked:
        raise TransferError("the answer names other blocks than those asked for")
    expected = layout.payload_blocks(len(asked)) * layout.block_bytes
    if header.get("nbytes") != expected:
        raise TransferError(f"the answer announces {header.get('nbytes')!r} bytes; {len(asked)} blocks "
                            f"need {expected}")
    return expected
