"""The host-memory tier: one slab of fixed-size block slots, allocated once, reused LRU.

One slab rather than a buffer per block so the tier's memory is exactly ``--kv-host-gib``
from start to end: nothing is allocated per put and nothing can leak (pinned chunks that
are never released are a known failure of per-block host caches). On CUDA the slab is
pinned, so copies to and from the device run at full PCIe speed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from xlserve.kvstore.base import BlockKey, KVTier


class HostTier(KVTier):
    name = "host"

    def __init__(self, block_bytes: int, gib: float, pin: bool | None = None):
        super().__init__(block_bytes)
        slots = int(gib * 1024 ** 3 // block_bytes)
        if slots < 1:
            raise ValueError(f"--kv-host-gib {gib} holds no KV block of {block_bytes} bytes")
        pin = torch.cuda.is_available() if pin is None else pin
        self.slab = torch.empty((slots, block_bytes), dtype=torch.uint8, pin_memory=pin).numpy()
        self.slots: OrderedDict[BlockKey, int] = OrderedDict()  # key -> slot, least recently used first
        self.free = list(range(slots - 1, -1, -1))
        self.lock = threading.Lock()

    @classmethod
    def from_config(cls, config, block_bytes: int, digest: bytes) -> "HostTier":
        return cls(block_bytes, config.kv_host_gib)

    @property
    def capacity_blocks(self) -> int:
        return len(self.slab)

    @property
    def num_blocks(self) -> int:
        return len(self.slots)

    def contains(self, keys: list[BlockKey]) -> list[bool]:
        with self.lock:
            return [k in self.slots for k in keys]

    def get(self, keys: list[BlockKey]) -> list[bytes | None]:
        out = []
        with self.lock:
            for key in keys:
                slot = self.slots.get(key)
                if slot is None:
                    out.append(None)
                    continue
                self.slots.move_to_end(key)
                out.append(self.slab[slot].tobytes())  # a copy: the slot may be reused once the lock drops
        found = sum(1 for b in out if b is not None)
        self.stats.add(misses=len(keys) - found, bytes_read=found * self.block_bytes)
        return out

    def put(self, keys: list[BlockKey], blocks: list[memoryview]) -> list[tuple[BlockKey, memoryview]]:
        evicted, stored = [], []
        with self.lock:
            for key, block in zip(keys, blocks):
                if key in self.slots:
                    self.slots.move_to_end(key)
                    continue
                stored.append(key)
                if not self.free:
                    old, slot = self.slots.popitem(last=False)
                    evicted.append((old, memoryview(self.slab[slot].copy())))  # handed to the next tier
                    self.free.append(slot)
                slot = self.free.pop()
                self.slab[slot] = memoryview(block).cast("B")
                self.slots[key] = slot
        self.stats.add(stored=len(stored), evictions=len(evicted), bytes_written=len(stored) * self.block_bytes)
        self.announce("removed", [k for k, _ in evicted])
        self.announce("stored", stored)
        return evicted

    def keys(self) -> list[BlockKey]:
        with self.lock:
            return list(self.slots)

    def remove(self, keys: list[BlockKey]) -> None:
        removed = []
        with self.lock:
            for key in keys:
                slot = self.slots.pop(key, None)
                if slot is not None:
                    self.free.append(slot)
                    removed.append(key)
        self.announce("removed", removed)

    def close(self) -> None:
        with self.lock:
            self.slots.clear()
            self.free = []
            self.slab = self.slab[:0]
