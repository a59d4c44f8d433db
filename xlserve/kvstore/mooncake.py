"""The cluster tier: Mooncake Store, shared by every worker that names the same master.

Workers are pure clients (they mount no memory of their own): the store's memory is
mounted by ``xlserve kvstore`` (``kvstore/master.py``), so a worker that exits takes no
one's blocks with it. Values are sealed blocks (layout digest, checksum), so a block of
another layout, or damaged on the way, is a miss.

The store must never stall or fail a request. Setting up a client against a master that
is down takes seconds (4.4 s with one retry, measured), so it happens on a thread of its
own, again and again until the master answers; until then, and for ``COOL_OFF_S`` after
any failed call, the tier misses and drops writes without calling the store. The
Mooncake client reconnects by itself when a master comes back (measured: the first call
after a restart fails, the next succeeds).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from xlserve.kvstore.base import SEALED_OVERHEAD, BlockKey, KVTier, seal, unseal

log = logging.getLogger(__name__)
COOL_OFF_S = 2.0  # after a failed call: miss without calling for this long
RECONNECT_S = 2.0  # between client setups while the master does not answer
CLIENT_BUFFER_BYTES = 128 * 1024 ** 2  # the client's transfer buffer: one get batch must fit in it
KEY_PREFIX = "xlkv-"
RPC_FAIL = -900  # the master did not answer (other failures: a full store, which evicts behind the write)


def metadata_url(host: str, port: int) -> str:
    """The store's HTTP metadata server: on the port after the master's RPC port (``master.py``)."""
    return f"http://{host}:{port + 1}/metadata"


def client_environment(host: str) -> None:
    """Settings the Mooncake client reads from the environment, before its first use."""
    if host in ("127.0.0.1", "localhost"):  # else it advertises the machine's external address
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")  # bounded: we retry on our own thread
    os.environ.setdefault("GLOG_minloglevel", "2")  # its INFO and WARNING lines: several per connection


def new_client(host: str, port: int, segment_bytes: int, buffer_bytes: int):
    """A set-up Mooncake Store client, or None when the master does not answer."""
    client_environment(host)
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    local = "127.0.0.1" if host in ("127.0.0.1", "localhost") else host
    rc = store.setup(local, metadata_url(host, port), segment_bytes, buffer_bytes, "tcp", "", f"{host}:{port}")
    return store if rc == 0 else None


class MooncakeTier(KVTier):
    name = "mooncake"
    local = False

    def __init__(self, block_bytes: int, address: str, digest: bytes):
        super().__init__(block_bytes)
        host, _, port = address.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        client_environment(self.host)
        import mooncake.store  # noqa: F401 - fail at start, with its own message, when it cannot load

        self.digest = digest
        self.value_bytes = block_bytes + SEALED_OVERHEAD
        self.batch = max(1, CLIENT_BUFFER_BYTES // 2 // self.value_bytes)
        self.store = None
        self.down_until = 0.0
        self._closed = threading.Event()
        self._connector = threading.Thread(target=self._connect, name="kv-tier-mooncake-connect", daemon=True)
        self._connector.start()

    @classmethod
    def from_config(cls, config, block_bytes: int, digest: bytes) -> "MooncakeTier":
        if not config.kv_store_address:
            raise ValueError("the mooncake KV tier needs --kv-store-address HOST:PORT (run 'xlserve kvstore', "
                             "or let 'xlserve serve' start one)")
        return cls(block_bytes, config.kv_store_address, digest)

    def _connect(self) -> None:
        while not self._closed.is_set() and self.store is None:
            try:
                self.store = new_client(self.host, self.port, 0, CLIENT_BUFFER_BYTES)
            except Exception:  # noqa: BLE001 - a client that cannot start is a store that is down
                log.warning("mooncake KV tier: client setup failed", exc_info=True)
            if self.store is None:
                self.stats.add(failures=1)
                log.warning("mooncake KV tier: no master at %s:%d; serving from local tiers, retrying",
                            self.host, self.port)
                self._closed.wait(RECONNECT_S)
        if self.store is not None:
            log.info("mooncake KV tier: connected to %s:%d", self.host, self.port)

    @property
    def enabled(self) -> bool:
        return self.store is not None and time.monotonic() >= self.down_until

    def _failed(self, what: str) -> None:
        if time.monotonic() >= self.down_until:
            log.warning("mooncake KV tier: %s failed; missing for %.0f s, then trying again", what, COOL_OFF_S)
        self.down_until = time.monotonic() + COOL_OFF_S
        self.outages += 1
        self.stats.add(failures=1)

    @staticmethod
    def _name(key: BlockKey) -> str:
        return KEY_PREFIX + key.hex()

    def contains(self, keys: list[BlockKey]) -> list[bool]:
        if not self.enabled:
            return [False] * len(keys)
        try:
            found = self.store.batch_is_exist([self._name(k) for k in keys])
        except Exception:  # noqa: BLE001
            found = [-1]
        if any(f < 0 for f in found):
            self._failed("a lookup")
            return [False] * len(keys)
        return [f == 1 for f in found]

    def get(self, keys: list[BlockKey]) -> list[memoryview | None]:
        out: list[memoryview | None] = []
        for start in range(0, len(keys), self.batch):
            chunk = keys[start:start + self.batch]
            raws = self._get(chunk)
            for key, raw in zip(chunk, raws):
                data = unseal(raw, self.digest, self.block_bytes) if raw else None
                if raw and data is None:
                    log.warning("mooncake KV tier: block %s is corrupt or of another layout; a miss", key.hex())
                    self.stats.add(failures=1)
                out.append(data)
        found = sum(1 for b in out if b is not None)
        self.stats.add(misses=len(keys) - found, bytes_read=found * self.block_bytes)
        return out

    def _get(self, keys: list[BlockKey]) -> list[bytes | None]:
        if not self.enabled:
            return [None] * len(keys)
        try:
            return self.store.get_batch([self._name(k) for k in keys])
        except Exception:  # noqa: BLE001
            self._failed("a read")
            return [None] * len(keys)

    def put(self, keys: list[BlockKey], blocks: list[memoryview]) -> list[tuple[BlockKey, memoryview]]:
        if not self.enabled:
            self.stats.add(dropped=len(keys))
            return []
        for start in range(0, len(keys), self.batch):
            chunk = keys[start:start + self.batch]
            values = [b"".join(seal(block, self.digest)) for block in blocks[start:start + self.batch]]
            try:
                rc = self.store.put_batch([self._name(k) for k in chunk], values)
            except Exception:  # noqa: BLE001
                rc = RPC_FAIL
            if rc != 0:  # a full store evicts behind the write: this batch is dropped, the next may fit
                self.stats.add(dropped=len(chunk))
                if rc == RPC_FAIL:
                    self._failed("a write")
                    return []
                continue
            self.stats.add(stored=len(chunk), bytes_written=len(chunk) * self.value_bytes)
            self.announce("stored", chunk)  # removals are the master's, unseen: the router ages them out
        return []

    @property
    def capacity_blocks(self) -> int:
        return 0  # the store's memory is shared: ask its master

    @property
    def num_blocks(self) -> int:
        return 0

    def remove(self, keys: list[BlockKey]) -> None:
        if self.enabled:
            try:
                self.store.batch_remove([self._name(k) for k in keys])
            except Exception:  # noqa: BLE001 - removal is a hint
                pass

    def close(self) -> None:
        self._closed.set()
        store, self.store = self.store, None
        if store is not None:
            try:
                store.close()
            except Exception:  # noqa: BLE001
                pass
