"""Hugging Face model directories: config.json + safetensors (single file or sharded index),
quantized checkpoints kept in a block format or dequantized as they load
(``checkpoint_quantization``)."""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch

from xlserve.kernels.gguf_blocks import BlockType
from xlserve.layers.quantized import QuantizedWeight
from xlserve.loader.checkpoint_quantization import checkpoint_quantization
from xlserve.loader.lazy_tensor import LazyTensor, ReadCount

# the stored types of quantized tensors (FP8, MXFP4 bytes, packed INT4): read whole and dequantized
QUANTIZED_DTYPES = {"F8_E4M3", "F8_E5M2", "U8", "I32"}


class SafetensorsDir:
    def __init__(self, path: str):
        self.path = path
        try:
            with open(os.path.join(path, "config.json")) as f:
                self.config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read config.json in {path!r}: {e}") from e
        self.quantization = checkpoint_quantization(self.config)
        self.files = self.weight_files()
        self.location = {name: file for file in self.files for name in self._names(file)}  # tensor -> its shard
        self.num_tensors = sum(1 for name in self.location if not self._companion(name))
        self._open: dict[str, object] = {}  # shard -> open handle, for _fetch
        self.read = ReadCount()

    @staticmethod
    def _names(file: str) -> list[str]:
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(file, "pt") as f:
                return list(f.keys())
        except SafetensorError as e:
            raise ValueError(f"cannot read weights {file!r} (corrupt or truncated?): {e}") from e

    def _companion(self, name: str) -> bool:
        return self.quantization is not None and self.quantization.companion(name)

    def _fetch(self, name: str) -> torch.Tensor:
        """Any tensor by name, from whichever shard holds it (a quantized weight's scales)."""
        from safetensors import safe_open
        if name not in self.location:
            raise ValueError(f"quantized checkpoint {self.path!r} lacks tensor {name!r}")
        file = self.location[name]
        if file not in self._open:  # one parse of each shard's header, not one per scale
            self._open[file] = safe_open(file, "pt")
        return self._open[file].get_tensor(name)

    def weight_files(self) -> list[str]:
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        else:
            names = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not names:
            raise ValueError(f"no .safetensors weights in {self.path!r}")
        files = [os.path.join(self.path, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"weight shards listed in the index are missing: {missing}")
        return files

    @property
    def file_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.files)

    def weights(self, dtype: torch.dtype, lazy: bool = False, keep_quantized: bool = False, keep_bf16: bool = False
                ) -> Iterator[tuple[str, torch.Tensor | LazyTensor | QuantizedWeight]]:
        """(name, tensor) in ``dtype``; ``lazy``: unquantized tensors as ``LazyTensor``s, read
        when (and as far as) the model's loader indexes them (tensor-parallel slices);
        ``keep_quantized``: quantized tensors whose values a block format holds exactly come
        as ``QuantizedWeight`` (a layer that cannot hold one dequantizes it), and with
        ``keep_bf16`` so do bfloat16 matrices (``BlockType.BF16``)."""
        # safe_open memory-maps the file: tensors are read as they are copied in.
        from safetensors import SafetensorError, safe_open
        for file in self.files:
            try:
                with safe_open(file, "pt") as f:
                    for name in f.keys():
                        if self._companion(name):
                            continue
                        if lazy and not self._quantized(f, name):
                            yield name, LazyTensor(f.get_slice(name), dtype, self.read)
                        else:
                            yield self._plain(name, f.get_tensor(name), dtype, keep_quantized, keep_bf16)
            except SafetensorError as e:
                raise ValueError(f"cannot read weights {file!r} (corrupt or truncated?): {e}") from e

    def _quantized(self, f, name: str) -> bool:
        return self.quantization is not None and f.get_slice(name).get_dtype() in QUANTIZED_DTYPES

    def _plain(self, name: str, tensor: torch.Tensor, dtype: torch.dtype, keep_quantized: bool,
               keep_bf16: bool = False) -> tuple[str, torch.Tensor | QuantizedWeight]:
        self.read.bytes += tensor.numel() * tensor.element_size()
        if keep_bf16 and tensor.dtype == torch.bfloat16 and tensor.dim() == 2 and tensor.shape[1] % 32 == 0:
            return name, QuantizedWeight.from_blocks(BlockType.BF16, tensor.contiguous().view(torch.uint8),
                                                     tuple(tensor.shape))
        kept = keep_quantized and self.quantization and self.quantization.keep(name, tensor, self._fetch)
        if kept:
            return kept
        plain = self.quantization and self.quantization.dequantize(name, tensor, self._fetch)
        if plain:
            name, tensor = plain
        return name, tensor.to(dtype)
