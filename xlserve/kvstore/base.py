"""The KV tier interface: a bounded store of KV blocks by key, under the device pool.

A key is a block's cache key as bytes (``block_key``): the block hash names the whole
prefix and the engine's model and dtype, so equal keys mean equal KV. A value is one
block's bytes in the engine's ``KVLayout`` (every layer slot and KV head).

Invariants every tier keeps:
- ``get`` returns exactly the bytes ``put`` stored under that key, or ``None`` (a miss).
  A tier fault is a miss, never an exception and never other bytes: whatever leaves the
  process (disk, the cluster) is sealed with its layout and a checksum and checked on
  the way back;
- capacity is bounded and eviction happens inside the tier (least recently used first);
  a put that cannot be stored is dropped and counted, it never blocks or raises;
- methods are batched and thread-safe: the tier set's writer and loader threads call them.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xlserve.hashing import BlockHash

if TYPE_CHECKING:
    from xlserve.config import KVTierConfig

BlockKey = bytes
MAGIC = b"XLKV\x01"
_HEADER = struct.Struct("<5s8s16sQ")  # magic, layout digest, blake2b-128 of the data, data length


def block_key(block_hash: BlockHash) -> BlockKey:
    return bytes(block_hash)


def layout_digest(layout_json: str) -> bytes:
    return hashlib.blake2b(layout_json.encode(), digest_size=8).digest()


def seal(data: memoryview | bytes, digest: bytes) -> list[bytes | memoryview]:
    """A block as it leaves the process: a header (layout digest, checksum, length), then the data."""
    checksum = hashlib.blake2b(data, digest_size=16).digest()
    return [_HEADER.pack(MAGIC, digest, checksum, len(data)), data]


def unseal(raw: bytes | memoryview | None, digest: bytes, block_bytes: int) -> memoryview | None:
    """The data of a sealed block, or ``None`` when it is truncated, corrupt or of another layout."""
    if raw is None or len(raw) != _HEADER.size + block_bytes:
        return None
    magic, got_digest, checksum, length = _HEADER.unpack_from(raw)
    data = memoryview(raw)[_HEADER.size:]
    if magic != MAGIC or got_digest != digest or length != block_bytes:
        return None
    if hashlib.blake2b(data, digest_size=16).digest() != checksum:
        return None
    return data


SEALED_OVERHEAD = _HEADER.size


@dataclass
class TierStats:
    """Counters of one tier (read by /metrics and the engine's stats)."""
    hits: int = 0  # blocks loaded from this tier into the device pool
    misses: int = 0  # blocks asked for and not found (including bad ones)
    bytes_read: int = 0
    bytes_written: int = 0
    stored: int = 0  # blocks put
    evictions: int = 0  # blocks the tier dropped to make room
    dropped: int = 0  # puts not stored (full queue, full tier, a failure)
    failures: int = 0  # faults met: corrupt or unreadable blocks, I/O errors, an unreachable store
    load_seconds: float = 0.0  # time spent in get, summed
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts) -> None:
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict:
        with self.lock:
            return {k: v for k, v in self.__dict__.items() if k != "lock"}


class KVTier(ABC):
    """One tier: host memory, a disk directory, the cluster store."""
    name: str
    local: bool = True  # False: shared with other workers (a cluster tier gets write-through)

    def __init__(self, block_bytes: int):
        self.block_bytes = block_bytes
        self.stats = TierStats()
        self.outages = 0  # times the tier failed: what it held before may be gone (a restarted store)
        self.events = None  # the worker's KVEventLog, once attached: the router's index follows it

    def announce(self, kind: str, keys: list[BlockKey]) -> None:
        """Tell the event log that these blocks were ``stored`` here or ``removed``."""
        if self.events is not None:
            record = self.events.stored if kind == "stored" else self.events.removed
            for key in keys:
                record(key, self.name)

    def keys(self) -> list[BlockKey]:
        """What the tier holds, as far as this process knows (event-log snapshots)."""
        return []

    @classmethod
    @abstractmethod
    def from_config(cls, config: "KVTierConfig", block_bytes: int, digest: bytes) -> "KVTier":
        """The tier as the flags describe it; ``digest``: the engine's layout (``layout_digest``)."""

    @abstractmethod
    def contains(self, keys: list[BlockKey]) -> list[bool]:
        """Whether each key is stored (a hint: a later ``get`` may still miss)."""

    @abstractmethod
    def get(self, keys: list[BlockKey]) -> list[memoryview | bytes | None]:
        """Each key's block bytes, or ``None``; a hit counts as recently used."""

    @abstractmethod
    def put(self, keys: list[BlockKey], blocks: list[memoryview]) -> list[tuple[BlockKey, memoryview]]:
        """Store these blocks (a key already stored is refreshed, not rewritten). Returns what
        the tier evicted to make room, as (key, bytes) when it still has them (a local tier
        passes them down to the next) or nothing."""

    @abstractmethod
    def remove(self, keys: list[BlockKey]) -> None:
        """Forget these keys (absent ones are ignored)."""

    @property
    @abstractmethod
    def capacity_blocks(self) -> int:
        """How many blocks the tier holds when full."""

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """How many blocks it holds now."""

    @property
    def enabled(self) -> bool:
        """False after a fault that takes the tier out (a full disk); it then misses and drops."""
        return True

    def close(self) -> None:  # noqa: B027 - most tiers hold nothing that needs releasing
        """Release what the tier holds open (memory, files, connections)."""


TIERS: dict[str, str] = {  # name -> "module:class", imported when first asked for
    "host": "xlserve.kvstore.host:HostTier",
    "disk": "xlserve.kvstore.disk:DiskTier",
    "mooncake": "xlserve.kvstore.mooncake:MooncakeTier",
}


def tier_class(name: str) -> type[KVTier]:
    import importlib

    if name not in TIERS:
        raise ValueError(f"unknown KV tier {name!r}; allowed: {', '.join(TIERS)}")
    module, cls = TIERS[name].split(":")
    return getattr(importlib.import_module(module), cls)
