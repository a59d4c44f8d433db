"""uvicorn's HTTP/1.1 protocol (h11) with a bound on how long a connection may take to send
a request head.

uvicorn waits for the first request on a connection for ever, and for a head that arrives
one byte at a time too (its keep-alive timer runs only after a response and stops at the
first byte): a client could hold any number of sockets, and so file descriptors, open on
a server by sending nothing. Measured: a silent connection to ``xlserve serve``'s port was
still open after 120 s. Here a connection that has no complete request head
``--request-head-timeout`` seconds after it opened, or after its last response, is closed
(nginx's ``client_header_timeout`` is 60 s).
"""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from xlserve.server_config import ServerConfig


class HeadBoundedH11Protocol(H11Protocol):
    head_timeout = 30.0
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head was read: its own bounds take over
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self.head_timeout, self._head_overdue)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_overdue(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()


def uvicorn_config(app, config: ServerConfig) -> uvicorn.Config:
    """How every xlserve server (worker, router) runs uvicorn."""
    protocol = type("HeadBoundedH11Protocol", (HeadBoundedH11Protocol,), {"head_timeout": config.request_head_timeout})
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False,
                          timeout_graceful_shutdown=5, http=protocol)
