"""The GGUF container: metadata and tensor directory, with the tensor bytes memory-mapped.

``gguf.GGUFReader`` builds a numpy view per array element; on a tokenizer's 100,000
strings that is 3+ seconds of every cold start. This reads the same layout with
``struct`` in ~0.1 s. Tensor types, block sizes and dequantization stay with the ``gguf``
package. Every offset is bounds-checked, so a damaged file is a ``ValueError``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
         7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first)
    qtype: int
    offset: int  # absolute, in the file
    nbytes: int


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ValueError(f"file ends at byte {len(self.buf)}, needed {self.pos + n}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("<Q"))).decode("utf-8", errors="replace")

    def _strings(self, count: int) -> list[str]:
        # The tokenizer's ~100k strings: one tight loop, no per-item method calls.
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                raise ValueError(f"file ends at byte {end}, needed {pos + n}")
            out.append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int):
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == STRING:
                return self._strings(count)
            if item in NUMPY:
                size = np.dtype(NUMPY[item]).itemsize * count
                return np.frombuffer(self.take(size), dtype=NUMPY[item]).tolist()
            return [self.value(item) for _ in range(count)]
        if vtype not in SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.scalar(SCALARS[vtype])


def read_gguf(path: str) -> tuple[dict, list[TensorInfo], np.memmap]:
    from gguf import GGML_QUANT_SIZES
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data))
    if bytes(cur.take(4)) != MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    meta = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        qtype, offset = cur.scalar("<I"), cur.scalar("<Q")
        infos.append((name, tuple(reversed(dims)), qtype, offset))
    align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cur.pos // align) * align
    tensors = []
    for name, shape, qtype, offset in infos:
        if qtype not in GGML_QUANT_SIZES:
            raise ValueError(f"tensor {name} has unknown type {qtype}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
        if start + offset + nbytes > len(data):
            raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
        tensors.append(TensorInfo(name, shape, qtype, start + offset, nbytes))
    return meta, tensors, data


def tensor_bytes(data: np.memmap, info: TensorInfo) -> np.ndarray:
    """The tensor's raw bytes as rows of the innermost dimension (what ``gguf`` dequantizes)."""
    raw = data[info.offset:info.offset + info.nbytes]
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    return raw.reshape(rows, -1)


def release(data: np.memmap, info: TensorInfo) -> None:
    """Drop the tensor's mapped pages once copied: they would otherwise stay resident and
    count twice (file pages + weights) toward the process's memory."""
    handle = getattr(data, "_mmap", None)
    if handle is None or not hasattr(handle, "madvise"):
        return
    page = mmap.PAGESIZE
    start = -(-info.offset // page) * page
    end = (info.offset + info.nbytes) // page * page
    if end > start:
        handle.madvise(mmap.MADV_DONTNEED, start, end - start)
