"""The built-in KV transport: one TCP connection per pull.

Request: one JSON line ``{"block_hashes": [hex, ...]}``. Answer: one JSON line
``{"ok": true, "layout": {...}, "block_hashes": [...], "nbytes": N}`` followed by exactly
N raw bytes, or ``{"ok": false, "error": "..."}``. Lines, hash counts and payload sizes
are bounded; nothing is unpickled.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading

from xlserve.engine.kv_blocks import KVLayout, KVPayload
from xlserve.transfer.base import ExportFn, KVTransportClient, KVTransportServer, TransferError

log = logging.getLogger(__name__)
MAX_LINE = 4 * 1024 * 1024
MAX_BLOCKS = 65536
MAX_PAYLOAD = 16 * 1024 ** 3


def _read_line(stream) -> dict:
    line = stream.readline(MAX_LINE + 1)
    if not line or len(line) > MAX_LINE or not line.endswith(b"\n"):
        raise TransferError("missing, oversized or unterminated header line")
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
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
    def __init__(self, export: ExportFn, host: str = "127.0.0.1", port: int = 0):
        self.export, self.host, self.port = export, host, port
        self._server: socketserver.ThreadingTCPServer | None = None

    def start(self) -> dict:
        export = self.export

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                try:
                    request = _read_line(self.rfile)
                    payload = export(_hashes(request.get("block_hashes")))
                    header = {"ok": True, "layout": payload.layout.to_json(), "nbytes": len(payload.data),
                              "block_hashes": [h.hex() for h in payload.block_hashes]}
                    self.wfile.write(json.dumps(header).encode() + b"\n")
                    self.wfile.write(payload.data)
                except Exception as e:  # answer the peer instead of dropping it
                    log.warning("KV pull from %s failed: %s", self.client_address, e)
                    try:
                        self.wfile.write(json.dumps({"ok": False, "error": str(e)}).encode() + b"\n")
                    except OSError:
                        pass

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="kv-transfer", daemon=True).start()
        return {"transport": "tcp", "host": self.host, "port": self.port}

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class TCPTransportClient(KVTransportClient):
    def pull(self, handle: dict, timeout: float) -> KVPayload:
        try:
            host, port = str(handle["host"]), int(handle["port"])
            hashes = [h.hex() if isinstance(h, bytes) else str(h) for h in handle["block_hashes"]]
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"bad KV handle: {e}") from e
        try:
            with socket.create_connection((host, port), timeout=timeout) as sock:
                sock.settimeout(timeout)
                stream = sock.makefile("rwb")
                stream.write(json.dumps({"block_hashes": hashes}).encode() + b"\n")
                stream.flush()
                header = _read_line(stream)
                if not header.get("ok"):
                    raise TransferError(f"peer refused: {header.get('error', 'no reason given')}")
                nbytes = int(header["nbytes"])
                if not 0 <= nbytes <= MAX_PAYLOAD:
                    raise TransferError(f"payload of {nbytes} bytes is out of bounds")
                data = stream.read(nbytes)
                if len(data) != nbytes:
                    raise TransferError(f"connection closed after {len(data)} of {nbytes} bytes")
                layout = KVLayout(**header["layout"])
                return KVPayload(layout, _hashes(header["block_hashes"]), data)
        except TransferError:
            raise
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise TransferError(f"KV pull from {handle.get('host')}:{handle.get('port')} failed: {e}") from e
