"""KV blocks out of and into an engine's pool, by block hash (the building block of
prefill/decode disaggregation and of KV tiers).

Export reads the longest cached prefix of a hash chain; import writes blocks into free
slots of the pool and publishes them in the prefix cache, so the next request with that
prefix gets a prefix hit and computes only the rest. With layer groups
(``engine/kv_groups.py``) a prefix of n blocks travels as group 0's n blocks followed by
each windowed group's blocks inside the window at the prefix's end. Pins hold exported blocks for a
bounded time so they cannot be evicted before a peer pulls them, and a pin is a
capability: only a caller holding its random secret can read its blocks, and only
those (block hashes come from token ids, so serving bare hashes would let anyone who
guesses a prompt test for it and read its KV). Data is raw tensor bytes with a
plain-JSON description; nothing is pickled. A payload carries every KV head: under tensor
parallelism rank 0 gathers the other ranks' heads (``KVShards``), so a prefill worker at
one degree hands KV to a decode worker at any other.
"""

from __future__ import annotations

import hmac
import secrets
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch

from xlserve.engine.block_pool import BlockPool, KVBlock
from xlserve.engine.kv_groups import KVGroup
from xlserve.hashing import BlockHash
from xlserve.layers.window import Window

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
MAX_PIN_SECONDS = 600.0


def cached_prefix(pool: BlockPool, groups: tuple[KVGroup, ...], hashes: list[BlockHash],
                  block_size: int) -> list[list[KVBlock]]:
    """The longest prefix of ``hashes`` cached in every layer group: group 0's blocks, then
    each windowed group's blocks inside the window at the prefix's end (prefix hits and the
    hand-off both start from this)."""
    full = []
    for h in hashes:
        block = pool.lookup(h)
        if block is None:
            break
        full.append(block)
    n = len(full)
    while True:  # n == 0 always holds: no window to have
        windows = [[pool.lookup(h, g) for h in hashes[group.first_block(n * block_size, block_size):n]]
                   for g, group in enumerate(groups[1:], start=1)]
        if all(None not in w for w in windows):
            return [full[:n], *windows]
        n -= 1


def held(kv_caches: list[tuple[torch.Tensor, ...] | None]) -> list[tuple[torch.Tensor, ...]]:
    """The layer slots a rank's pool holds (a pipeline stage: its own layers' slots; else all)."""
    return [slot for slot in kv_caches if slot is not None]


def read_blocks(kv_caches: list[tuple[torch.Tensor, ...] | None], block_ids: list[int],
                block_size: int) -> torch.Tensor:
    """These blocks of a pool's held slots, [blocks, held slots, parts, block_size, heads, dim]."""
    slots = held(kv_caches)
    ids = torch.tensor(block_ids, device=slots[0][0].device)
    return torch.stack([torch.stack([part.view(-1, block_size, *part.shape[1:])[ids] for part in slot], dim=1)
                        for slot in slots], dim=1)


def write_blocks(kv_caches: list[tuple[torch.Tensor, ...] | None], block_ids: list[int], data: torch.Tensor,
                 block_size: int) -> None:
    """``read_blocks``' inverse."""
    slots = held(kv_caches)
    ids = torch.tensor(block_ids, device=slots[0][0].device)
    for s, slot in enumerate(slots):
        for p, part in enumerate(slot):
            part.view(-1, block_size, *part.shape[1:])[ids] = data[:, s, p].to(part.device, part.dtype)


def own_share(full: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...] | None], rank: int) -> torch.Tensor:
    """A rank's part of blocks with every layer slot and head: its held slots, and its heads
    (its share in tensor-parallel rank order, or all of a shared entry)."""
    slots = [s for s, slot in enumerate(kv_caches) if slot is not None]
    if len(slots) < full.shape[1]:
        full = full[:, slots]
    local = held(kv_caches)[0][0].shape[1]
    return full if local == full.shape[-2] else full[..., rank * local:(rank + 1) * local, :]


class KVShards(ABC):
    """The KV the other ranks hold, as rank 0 reaches them: other tensor-parallel ranks' heads,
    other pipeline stages' layer slots; or, under data-parallel attention, the whole of another
    rank's own pool (``local`` False: this process holds none of these blocks' bytes). Every
    call is collective: each rank concerned reads or writes the same blocks of its own pool."""
    rank: int  # this rank's tensor-parallel rank: its heads are the rank-th share of every head
    local: bool = True  # this process holds a part of the blocks (else ``gather`` and ``scatter`` move them all)

    @abstractmethod
    def gather(self, block_ids: list[int], local: torch.Tensor | None, layout: "KVLayout") -> torch.Tensor:
        """Every rank's part of these blocks in place (``read_blocks``' shape, every slot and head)."""

    @abstractmethod
    def scatter(self, block_ids: list[int], full: torch.Tensor) -> None:
        """The other ranks write their part of ``full`` (every slot and head) into these blocks."""

    @abstractmethod
    def check_layout(self, layout: "KVLayout") -> None:
        """Raise ``ValueError`` when blocks of ``layout`` cannot move through these ranks
        (checked before any block is read or written)."""


@dataclass(frozen=True)
class KVLayout:
    """What a block's bytes mean; two engines exchange blocks only if their layouts match.
    A block holds ``num_layers`` layer slots of ``parts`` tensors of [num_kv_heads, head_dim]
    per token (``ModelArch.kv_cache_spec``: K and V; or one MLA latent entry); ``windows``:
    (size, chunked) of each layer group after the first."""
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    model_key: str  # hex of the engine's extra key (model + dtype)
    parts: int = 2
    windows: tuple = ()

    def __post_init__(self):  # JSON brings lists
        object.__setattr__(self, "windows", tuple(tuple(w) for w in self.windows))

    @property
    def block_bytes(self) -> int:
        itemsize = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        return self.num_layers * self.parts * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def window_starts(self, num_blocks: int) -> list[int]:
        """The first block each windowed group keeps for a prefix of ``num_blocks`` blocks."""
        end = num_blocks * self.block_size
        return [Window(size, chunked).first_key(end) // self.block_size for size, chunked in self.windows]

    def payload_blocks(self, num_blocks: int) -> int:
        return num_blocks + sum(num_blocks - first for first in self.window_starts(num_blocks))

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass(repr=False)
class KVPayload:
    layout: KVLayout
    block_hashes: list[BlockHash]
    # [blocks, layer slots, parts, block_size, kv_heads, head_dim] in layout.dtype: group 0's
    # blocks, then each windowed group's (``KVLayout.window_starts``)
    data: bytes

    def __repr__(self) -> str:
        return f"KVPayload({len(self.block_hashes)} blocks, {len(self.data)} bytes, {self.layout})"

    def __post_init__(self):
        expected = self.layout.payload_blocks(len(self.block_hashes)) * self.layout.block_bytes
        if len(self.data) != expected:
            raise ValueError(f"KV payload has {len(self.data)} bytes; {len(self.block_hashes)} blocks of this "
                             f"layout need {expected}")


@dataclass
class Pin:
    blocks: list[list[KVBlock]]  # per group: group 0's prefix, each windowed group's window at its end
    expires: float
    secret: str  # 128 random bits, hex: whoever holds it may read these blocks


@dataclass(frozen=True)
class PinGrant:
    pin_id: str  # names the pin (release, logs); not a capability
    secret: str
    block_hashes: list[BlockHash]  # the pinned prefix, in order


@dataclass
class KVBlockStore:
    pool: BlockPool
    kv_caches: list[tuple[torch.Tensor, ...]]  # the pool's tensors: one tuple of parts per layer slot
    layout: KVLayout
    groups: tuple[KVGroup, ...] = (KVGroup(None, ()),)
    shards: KVShards | None = None  # tensor parallel: the other ranks' heads
    pins: dict[str, Pin] = field(default_factory=dict)

    def cached_prefix(self, hashes: list[BlockHash]) -> list[list[KVBlock]]:
        return cached_prefix(self.pool, self.groups, hashes, self.layout.block_size)

    def export_pinned(self, pin_id: str, secret: str, hashes: list[BlockHash]) -> KVPayload:
        """The blocks of pin ``pin_id`` named by ``hashes`` (a prefix of the pin), for the
        holder of its secret; anything else is refused with ``PermissionError``."""
        pin = self.pins.get(pin_id)
        if pin is None or not hmac.compare_digest(pin.secret.encode(), str(secret).encode()):
            raise PermissionError("no pin with that id and secret (expired, released or never granted)")
        pinned = [b.block_hash for b in pin.blocks[0]]
        n = len(hashes)
        if list(hashes) != pinned[:n]:
            raise PermissionError(f"the blocks asked for are not the first {n} of the pin's {len(pinned)}")
        groups = [pin.blocks[0][:n]]
        for g, first in enumerate(self.layout.window_starts(n), start=1):
            held = {b.block_hash: b for b in pin.blocks[g]}
            window = [held.get((g, h)) for h in hashes[first:n]]
            if None in window:
                raise PermissionError(f"the pin does not hold layer group {g}'s window for the first {n} blocks")
            groups.append(window)
        return self._export(groups, list(hashes))

    def export(self, hashes: list[BlockHash]) -> KVPayload:
        """The longest cached prefix of ``hashes`` (possibly empty); local use only."""
        groups = self.cached_prefix(hashes)
        return self._export(groups, list(hashes[:len(groups[0])]))

    def _export(self, groups: list[list[KVBlock]], hashes: list[BlockHash]) -> KVPayload:
        blocks = [b for group in groups for b in group]
        if not blocks:
            return KVPayload(self.layout, [], b"")
        return KVPayload(self.layout, hashes, self.read([b.block_id for b in blocks]).tobytes())

    def read(self, block_ids: list[int]) -> np.ndarray:
        """These blocks' bytes with every layer slot and KV head, [blocks, layout.block_bytes]."""
        if self.shards is not None:
            self.shards.check_layout(self.layout)
        if self.shards is not None and not self.shards.local:  # another rank's pool
            data = self.shards.gather(block_ids, None, self.layout)
        else:
            data = read_blocks(self.kv_caches, block_ids, self.layout.block_size)  # [n, slots, parts, bs, hk, d]
        if data.shape[-2] < self.layout.num_kv_heads or data.shape[1] < self.layout.num_layers:
            data = self.shards.gather(block_ids, data, self.layout)  # else this rank has it all
        data = data.contiguous().cpu()
        raw = data.view(torch.int16) if data.dtype in (torch.bfloat16, torch.float16) else data
        return raw.numpy().view(np.uint8).reshape(len(block_ids), self.layout.block_bytes)

    def import_(self, payload: KVPayload) -> int:
        """Write the payload's blocks into free slots and publish them; returns how many of its
        leading blocks are now cached here in every group (fewer when the pool is short; none
        when a windowed layout does not fit whole)."""
        if payload.layout != self.layout:
            raise ValueError(f"KV layout mismatch: got {payload.layout}, this engine has {self.layout}")
        if self.shards is not None:
            self.shards.check_layout(self.layout)
        hashes = payload.block_hashes
        n = len(hashes)
        while n and self._blocks_missing(hashes, n) > self.pool.num_free_blocks:
            # a shorter prefix needs windows the payload does not carry: with windows, all or nothing
            n = 0 if self.layout.windows else n - 1
        placed = self._placements(len(hashes))
        held: list[KVBlock] = []  # referenced until the end, so a later block never evicts an earlier one
        written: list[tuple[int, int]] = []  # (block id, payload row) of the blocks filled here
        for row, (group, index) in enumerate(placed):
            if index >= n or index < self._first(group, n):
                continue
            block = self.pool.lookup(hashes[index], group)
            if block is not None:
                self.pool.touch([block])
            else:
                block = self.pool.allocate(1)[0]
                self.pool.cache_block(block, hashes[index], group)
                written.append((block.block_id, row))
            held.append(block)
        if written:
            self._write(payload, written)
        self.pool.free(list(reversed(held)))  # cached and evictable, like a finished request's blocks
        return n

    def _first(self, group: int, n: int) -> int:
        return self.layout.window_starts(n)[group - 1] if group else 0

    def _placements(self, n: int) -> list[tuple[int, int]]:
        """(group, block index) of each block of a payload of ``n`` blocks, in order."""
        rows = [(0, i) for i in range(n)]
        for g, first in enumerate(self.layout.window_starts(n), start=1):
            rows += [(g, i) for i in range(first, n)]
        return rows

    def _blocks_missing(self, hashes: list[BlockHash], n: int) -> int:
        return sum(1 for g in range(len(self.groups)) for h in hashes[self._first(g, n):n]
                   if self.pool.lookup(h, g) is None)

    def _write(self, payload: KVPayload, written: list[tuple[int, int]]) -> None:
        layout = self.layout
        rows = np.frombuffer(payload.data, dtype=np.uint8).reshape(-1, layout.block_bytes)
        ids = [block_id for block_id, _ in written]
        data = torch.from_numpy(rows[[row for _, row in written]]).view(DTYPES[layout.dtype]).view(  # copies those rows
            -1, layout.num_layers, layout.parts, layout.block_size, layout.num_kv_heads, layout.head_dim)
        if self.shards is None or self.shards.local:
            write_blocks(self.kv_caches, ids, own_share(data, self.kv_caches, self.shards.rank if self.shards else 0),
                         layout.block_size)
        if self.shards is not None:
            self.shards.scatter(ids, data.to(held(self.kv_caches)[0][0].device))  # where the ranks' collectives run

    def pin(self, hashes: list[BlockHash], seconds: float) -> PinGrant:
        """Hold the cached prefix of ``hashes`` for at most ``seconds``."""
        if not 0 < seconds <= MAX_PIN_SECONDS:
            raise ValueError(f"pin time must be in (0, {MAX_PIN_SECONDS}] seconds, got {seconds}")
        groups = self.cached_prefix(hashes)
        self.pool.touch([b for group in groups for b in group])
        grant = PinGrant(uuid.uuid4().hex, secrets.token_hex(16), [b.block_hash for b in groups[0]])
        self.pins[grant.pin_id] = Pin(groups, time.monotonic() + seconds, grant.secret)
        return grant

    def unpin(self, pin_id: str) -> bool:
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return False
        self.pool.free([b for group in pin.blocks for b in reversed(group)])
        return True

    def expire_pins(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        expired = [p for p, pin in self.pins.items() if pin.expires <= now]
        for pin_id in expired:
            self.unpin(pin_id)
        return len(expired)
