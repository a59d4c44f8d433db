"""KV transports: move KV blocks from the worker that computed them to one that needs them.

A transport has two halves. The serving half (on the prefill worker) answers pulls by
calling ``export(block_hashes) -> KVPayload`` of its engine. The pulling half turns a
*handle* (plain JSON, handed over by the router) into a ``KVPayload`` for the local
engine to import. Invariants: data never travels as pickle; every size read from the
network is bounded; a failed or slow pull raises ``TransferError`` (never hangs past its
timeout), so the caller can apply its policy (recompute or fail).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Callable

from xlserve.engine.kv_blocks import KVPayload
from xlserve.hashing import BlockHash

ExportFn = Callable[[list[BlockHash]], KVPayload]


class TransferError(Exception):
    """A pull failed: unreachable peer, timeout, refused or malformed answer."""


class KVTransportServer(ABC):
    @abstractmethod
    def start(self) -> dict:
        """Start serving; returns the address part of handles (plain JSON)."""

    @abstractmethod
    def stop(self) -> None:
        ...


class KVTransportClient(ABC):
    @abstractmethod
    def pull(self, handle: dict, timeout: float) -> KVPayload:
        """Fetch the blocks a handle names; raises ``TransferError``."""


TRANSPORTS = {"tcp": ("xlserve.transfer.tcp", "TCPTransportServer", "TCPTransportClient")}


def transport(name: str) -> tuple[type[KVTransportServer], type[KVTransportClient]]:
    if name not in TRANSPORTS:
        raise ValueError(f"KV transport {name!r} unknown; available: {sorted(TRANSPORTS)}")
    module, server, client = TRANSPORTS[name]
    mod = importlib.import_module(module)
    return getattr(mod, server), getattr(mod, client)
