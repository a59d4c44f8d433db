"""A checkpoint tensor not read yet: its shape, and reads of all or part of it.

Under tensor parallelism each rank keeps a slice of most weights; handed a ``LazyTensor``, a
layer's loader indexes it (``t[rows]``, ``t[:, columns]``) and only those bytes of the
memory-mapped file are read, so N ranks together read the checkpoint about once, in
parallel, instead of N times. Code that needs the whole tensor calls ``whole(t)``.
"""

from __future__ import annotations

import torch


class ReadCount:
    """Bytes read from a checkpoint's files (the load reports its throughput with it)."""

    def __init__(self):
        self.bytes = 0


class LazyTensor:
    def __init__(self, source, dtype: torch.dtype, count: ReadCount):
        self._source, self._dtype, self._count = source, dtype, count  # a safetensors slice handle
        self.shape = torch.Size(source.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        part = self._source[index]
        self._count.bytes += part.numel() * part.element_size()
        return part.to(self._dtype)

    def whole(self) -> torch.Tensor:
        return self[tuple(slice(None) for _ in self.shape)] if self.shape else self[()]

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return self.whole().to(dtype)


def whole(t: torch.Tensor | LazyTensor) -> torch.Tensor:
    return t.whole() if isinstance(t, LazyTensor) else t
