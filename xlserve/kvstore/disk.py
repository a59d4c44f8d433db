"""The disk tier: one directory, one file per block, least recently used deleted first.

A block is written to a temporary file and renamed into place, so a reader never sees a
half-written file under a block's name. There is no fsync: after a power loss a renamed
file may be empty or short, and the seal (layout digest, blake2b checksum, length) turns
that into a miss, which deletes the file, never wrong tokens. The directory survives a
restart: the index is rebuilt from the files at start (oldest access first). A full disk
(or any write error) takes the tier out with one log line; reads of what is there go on.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from xlserve.kvstore.base import SEALED_OVERHEAD, BlockKey, KVTier, seal, unseal

log = logging.getLogger(__name__)
SUFFIX = ".kvb"


class DiskTier(KVTier):
    name = "disk"

    def __init__(self, block_bytes: int, directory: str, gib: float, digest: bytes):
        super().__init__(block_bytes)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.digest = digest  # the engine's layout: blocks of another layout are misses
        self.file_bytes = block_bytes + SEALED_OVERHEAD
        self.capacity = int(gib * 1024 ** 3 // self.file_bytes)
        if self.capacity < 1:
            raise ValueError(f"--kv-disk-gib {gib} holds no KV block of {block_bytes} bytes")
        self.index: OrderedDict[BlockKey, None] = OrderedDict()  # least recently used first
        self.lock = threading.Lock()
        self._disabled = False
        self._rebuild_index()

    @classmethod
    def from_config(cls, config, block_bytes: int, digest: bytes) -> "DiskTier":
        return cls(block_bytes, config.disk_dir, config.kv_disk_gib, digest)

    def _rebuild_index(self) -> None:
        found = []
        for path in self.dir.glob(f"*{SUFFIX}"):
            try:
                key = bytes.fromhex(path.stem)
                stat = path.stat()
            except (ValueError, OSError):
                continue
            if stat.st_size == self.file_bytes:  # another layout's blocks are left alone
                found.append((stat.st_mtime, key))
        for _, key in sorted(found):
            self.index[key] = None
        for tmp in self.dir.glob(".tmp-*"):  # a writer that died mid-block
            tmp.unlink(missing_ok=True)
        self._evict_over(self.capacity)
        if self.index:
            log.info("disk KV tier %s: %d blocks from before", self.dir, len(self.index))

    @property
    def capacity_blocks(self) -> int:
        return self.capacity

    @property
    def num_blocks(self) -> int:
        return len(self.index)

    @property
    def enabled(self) -> bool:
        return not self._disabled

    def _path(self, key: BlockKey) -> Path:
        return self.dir / f"{key.hex()}{SUFFIX}"

    def contains(self, keys: list[BlockKey]) -> list[bool]:
        with self.lock:
            return [k in self.index for k in keys]

    def get(self, keys: list[BlockKey]) -> list[memoryview | None]:
        out = [self._read(key) for key in keys]
        found = sum(1 for b in out if b is not None)
        self.stats.add(misses=len(keys) - found, bytes_read=found * self.block_bytes)
        return out

    def _read(self, key: BlockKey) -> memoryview | None:
        with self.lock:
            if key not in self.index:
                return None
            self.index.move_to_end(key)
        path = self._path(key)
        try:
            raw = path.read_bytes()
            os.utime(path)  # the access order survives a restart
        except OSError:
            raw = None
        data = unseal(raw, self.digest, self.block_bytes)
        if data is None:
            log.warning("disk KV tier: block %s is missing, truncated or corrupt; removed", path.name)
            self.stats.add(failures=1)
            self.remove([key])
        return data

    def put(self, keys: list[BlockKey], blocks: list[memoryview]) -> list[tuple[BlockKey, memoryview]]:
        if self._disabled:
            self.stats.add(dropped=len(keys))
            return []
        for key, block in zip(keys, blocks):
            with self.lock:
                if key in self.index:
                    self.index.move_to_end(key)
                    continue
            if not self._write(key, block):
                self.stats.add(dropped=len(keys))
                return []
            with self.lock:
                self.index[key] = None
                gone = self._evict_over(self.capacity)
            self.stats.add(stored=1, bytes_written=self.file_bytes)
            self.announce("removed", gone)
            self.announce("stored", [key])
        return []

    def keys(self) -> list[BlockKey]:
        with self.lock:
            return list(self.index)

    def _write(self, key: BlockKey, block: memoryview) -> bool:
        try:
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.dir)
            try:
                with os.fdopen(fd, "wb") as f:
                    for part in seal(block, self.digest):
                        f.write(part)
                os.replace(tmp, self._path(key))
            except BaseException:
                os.unlink(tmp)
                raise
            return True
        except OSError as e:
            self._disabled = True
            self.stats.add(failures=1)
            log.error("disk KV tier %s is off after a write failed (%s); the other tiers go on", self.dir, e)
            return False

    def _evict_over(self, capacity: int) -> list[BlockKey]:
        gone = []
        while len(self.index) > capacity:  # the lock is held
            old, _ = self.index.popitem(last=False)
            self._path(old).unlink(missing_ok=True)
            gone.append(old)
        self.stats.add(evictions=len(gone))
        return gone

    def remove(self, keys: list[BlockKey]) -> None:
        removed = []
        with self.lock:
            for key in keys:
                if self.index.pop(key, "absent") is None:
                    self._path(key).unlink(missing_ok=True)
                    removed.append(key)
        self.announce("removed", removed)
