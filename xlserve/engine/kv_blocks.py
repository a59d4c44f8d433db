"""KV blocks out of and into an engine's pool, by block hash (the building block of
prefill/decode disaggregation and of KV tiers).

Export reads the longest cached prefix of a hash chain; import writes blocks into free
slots of the pool and publishes them in the prefix cache, so the next request with that
prefix gets a prefix hit and computes only the rest. Pins hold exported blocks for a
bounded time so they cannot be evicted before a peer pulls them, and a pin is a
capability: only a caller holding its random secret can read its blocks, and only
those (block hashes come from token ids, so serving bare hashes would let anyone who
guesses a prompt test for it and read its KV). Data is raw tensor bytes with a
plain-JSON description; nothing is pickled.
"""

from __future__ import annotations

import hmac
import secrets
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from xlserve.engine.block_pool import BlockPool, KVBlock
from xlserve.hashing import BlockHash

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
MAX_PIN_SECONDS = 600.0


@dataclass(frozen=True)
class KVLayout:
    """What a block's bytes mean; two engines exchange blocks only if their layouts match.
    Each layer keeps ``parts`` tensors of [num_kv_heads, head_dim] per token
    (``ModelArch.kv_cache_spec``: K and V; or one MLA latent entry)."""
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    model_key: str  # hex of the engine's extra key (model + dtype)
    parts: int = 2

    @property
    def block_bytes(self) -> int:
        itemsize = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        return self.num_layers * self.parts * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass(repr=False)
class KVPayload:
    layout: KVLayout
    block_hashes: list[BlockHash]
    data: bytes  # [blocks, layers, parts, block_size, kv_heads, head_dim] in layout.dtype

    def __repr__(self) -> str:
        return f"KVPayload({len(self.block_hashes)} blocks, {len(self.data)} bytes, {self.layout})"

    def __post_init__(self):
        expected = len(self.block_hashes) * self.layout.block_bytes
        if len(self.data) != expected:
            raise ValueError(f"KV payload has {len(self.data)} bytes; {len(self.block_hashes)} blocks of this "
                             f"layout need {expected}")


@dataclass
class Pin:
    blocks: list[KVBlock]
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
    kv_caches: list[tuple[torch.Tensor, ...]]
    layout: KVLayout
    pins: dict[str, Pin] = field(default_factory=dict)

    def _views(self):
        bs, hk, d = self.layout.block_size, self.layout.num_kv_heads, self.layout.head_dim
        return [tuple(part.view(-1, bs, hk, d) for part in layer) for layer in self.kv_caches]

    def cached_prefix(self, hashes: list[BlockHash]) -> list[KVBlock]:
        blocks = []
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def export_pinned(self, pin_id: str, secret: str, hashes: list[BlockHash]) -> KVPayload:
        """The blocks of pin ``pin_id`` named by ``hashes`` (a prefix of the pin), for the
        holder of its secret; anything else is refused with ``PermissionError``."""
        pin = self.pins.get(pin_id)
        if pin is None or not hmac.compare_digest(pin.secret.encode(), str(secret).encode()):
            raise PermissionError("no pin with that id and secret (expired, released or never granted)")
        pinned = [b.block_hash for b in pin.blocks]
        if list(hashes) != pinned[:len(hashes)]:
            raise PermissionError(f"the blocks asked for are not the first {len(hashes)} of the pin's "
                                  f"{len(pinned)}")
        return self._export(pin.blocks[:len(hashes)])

    def export(self, hashes: list[BlockHash]) -> KVPayload:
        """The longest cached prefix of ``hashes`` (possibly empty); local use only."""
        return self._export(self.cached_prefix(hashes))

    def _export(self, blocks: list[KVBlock]) -> KVPayload:
        if not blocks:
            return KVPayload(self.layout, [], b"")
        ids = torch.tensor([b.block_id for b in blocks], device=self.kv_caches[0][0].device)
        layers = [torch.stack([part[ids] for part in layer], dim=1) for layer in self._views()]  # [n, parts, ...]
        data = torch.stack(layers, dim=1).contiguous().cpu()  # [n, layers, parts, bs, hk, d]
        raw = data.view(torch.int16) if data.dtype in (torch.bfloat16, torch.float16) else data
        return KVPayload(self.layout, [b.block_hash for b in blocks], raw.numpy().tobytes())

    def import_(self, payload: KVPayload) -> int:
        """Write the payload's blocks into free slots and publish them; returns how many of its
        leading blocks are now cached here (stops early if the pool has no free block)."""
        if payload.layout != self.layout:
            raise ValueError(f"KV layout mismatch: got {payload.layout}, this engine has {self.layout}")
        views = self._views()
        dtype = DTYPES[self.layout.dtype]
        block_bytes = self.layout.block_bytes
        shape = (self.layout.num_layers, self.layout.parts, self.layout.block_size, self.layout.num_kv_heads,
                 self.layout.head_dim)
        held: list[KVBlock] = []  # referenced until the end, so a later block never evicts an earlier one
        imported = 0
        for i, block_hash in enumerate(payload.block_hashes):
            block = self.pool.lookup(block_hash)
            if block is not None:
                self.pool.touch([block])
            elif self.pool.num_free_blocks == 0:
                break
            else:
                block = self.pool.allocate(1)[0]
                raw = np.frombuffer(payload.data, dtype=np.uint8, count=block_bytes, offset=i * block_bytes)
                data = torch.from_numpy(raw.copy()).view(dtype).view(shape)
                for layer, parts in enumerate(views):
                    for index, part in enumerate(parts):
                        part[block.block_id].copy_(data[layer, index])
                self.pool.cache_block(block, block_hash)
            held.append(block)
            imported = i + 1
        self.pool.free(list(reversed(held)))  # cached and evictable, like a finished request's blocks
        return imported

    def pin(self, hashes: list[BlockHash], seconds: float) -> PinGrant:
        """Hold the cached prefix of ``hashes`` for at most ``seconds``."""
        if not 0 < seconds <= MAX_PIN_SECONDS:
            raise ValueError(f"pin time must be in (0, {MAX_PIN_SECONDS}] seconds, got {seconds}")
        blocks = self.cached_prefix(hashes)
        self.pool.touch(blocks)
        grant = PinGrant(uuid.uuid4().hex, secrets.token_hex(16), [b.block_hash for b in blocks])
        self.pins[grant.pin_id] = Pin(blocks, time.monotonic() + seconds, grant.secret)
        return grant

    def unpin(self, pin_id: str) -> bool:
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return False
        self.pool.free(list(reversed(pin.blocks)))
        return True

    def expire_pins(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        expired = [p for p, pin in self.pins.items() if pin.expires <= now]
        for pin_id in expired:
            self.unpin(pin_id)
        return len(expired)
