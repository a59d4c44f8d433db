"""KV transports: move KV blocks from the worker that computed them to one that needs them.

A transport has two halves. The serving half (on the prefill worker) answers pulls by
calling ``export(pin_id, secret, block_hashes) -> KVPayload`` of its engine, which
refuses anyone without the pin's secret. The pulling half turns a *handle* (plain JSON
handed over by the router: address, pin id and secret, block hashes) into a
``KVPayload`` for the local engine to import. Invariants: data never travels as pickle;
the answer is checked against what was asked (layout, block hashes, byte count) before
a payload byte is trusted; every size read from the network is bounded; a failed,
refused or slow pull raises ``TransferError`` (never hangs past its timeout), so the
caller can apply its policy (recompute or fail).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Callable

from xlserve.engine.kv_blocks import KVLayout, KVPayload
from xlserve.hashing import BlockHash

ExportFn = Callable[[str, str, list[BlockHash]], KVPayload]  # (pin id, secret, hashes)


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
    def pull(self, handle: dict, timeout: float, layout: KVLayout) -> KVPayload:
        """Fetch the blocks a handle names, in ``layout`` (the puller's own), within
        ``timeout`` seconds in all; raises ``TransferError``."""


TRANSPORTS = {"tcp": ("xlserve.transfer.tcp", "TCPTransportServer", "TCPTransportClient"),
              "mooncake": ("xlserve.transfer.mooncake", "MooncakeTransportServer", "MooncakeTransportClient")}


def transport(name: str) -> tuple[type[KVTransportServer], type[KVTransportClient]]:
    if name not in TRANSPORTS:
        raise ValueError(f"KV transport {name!r} unknown; available: {sorted(TRANSPORTS)}")
    module, server, client = TRANSPORTS[name]
    mod = importlib.import_module(module)
    return getattr(mod, server), getattr(mod, client)
