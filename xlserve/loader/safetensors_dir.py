"""Hugging Face model directories: config.json + safetensors (single file or sharded index)."""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch


class SafetensorsDir:
    def __init__(self, path: str):
        self.path = path
        try:
            with open(os.path.join(path, "config.json")) as f:
                self.config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read config.json in {path!r}: {e}") from e
        self.files = self.weight_files()
        self.num_tensors = sum(self._count(f) for f in self.files)

    @staticmethod
    def _count(file: str) -> int:
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(file, "pt") as f:
                return len(f.keys())
        except SafetensorError as e:
            raise ValueError(f"cannot read weights {file!r} (corrupt or truncated?): {e}") from e

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

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        # safe_open memory-maps the file: tensors are read as they are copied in.
        from safetensors import SafetensorError, safe_open
        for file in self.files:
            try:
                with safe_open(file, "pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name).to(dtype)
            except SafetensorError as e:
                raise ValueError(f"cannot read weights {file!r} (corrupt or truncated?): {e}") from e
