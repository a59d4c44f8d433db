"""What the HTTP edge checks before any route runs: the Host header and the body's type.

A server on a loopback address is still reachable from a browser: a cross-site page can
POST a ``text/plain`` body (no CORS preflight), and DNS rebinding lets a foreign site's
name point at 127.0.0.1. So JSON endpoints take only ``application/json``, and a loopback
server answers only requests addressed to a loopback name (``--allowed-hosts`` widens it).
"""

from __future__ import annotations

import ipaddress

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from xlserve.openai.errors import ApiError, error_body


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without its port (IPv6 addresses keep no brackets)."""
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def allowed_hosts(bind: str, extra: str) -> frozenset[str] | None:
    """Host names a server bound to ``bind`` answers; None: any. ``extra``: comma-separated
    names from ``--allowed-hosts`` ('*' for any)."""
    names = {n.strip().lower() for n in extra.split(",") if n.strip()}
    if "*" in names:
        return None
    if is_loopback(bind):
        return frozenset(names)  # plus every loopback name, checked by is_loopback
    return frozenset(names) or None


class HostGuard:
    """Pure ASGI middleware (a BaseHTTPMiddleware would hide client disconnects)."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            name = host_name(header).lower()
            if not (is_loopback(name) or name in self.allowed):
                response = JSONResponse(error_body(421, f"this server does not answer for host {header!r}; "
                                                        "add it with --allowed-hosts"), status_code=421)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_json_content_type(content_type: str | None) -> None:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"the body must be application/json, got {media or 'no content-type'!r}; "
                            "send 'Content-Type: application/json'")
