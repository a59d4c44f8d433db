"""The block hash: the one identity of a KV block everywhere in xlserve.

``hash_i = blake2b(hash_{i-1} || token ids of block i || extra_key)``. Chaining makes
a block's hash name its whole prefix, so equal hashes mean equal KV. blake2b is in
the standard library, stable across processes and platforms (unlike ``hash()``).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

BlockHash = bytes
DIGEST_SIZE = 16
ROOT_HASH: BlockHash = b"\x00" * DIGEST_SIZE


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_key)
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        extra_key: bytes = b"") -> list[BlockHash]:
    """Append hashes for every full block of ``token_ids`` not yet hashed in ``hashes``."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else ROOT_HASH
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra_key))
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, extra_key: bytes = b"") -> list[BlockHash]:
    return extend_block_hashes([], token_ids, block_size, extra_key)
