"""Accelerators the planner knows, by the memory a device reports (``nvidia-smi`` /
``torch.cuda.mem_get_info`` total, not the marketing figure: an "80 GB" H100 reports
81,559 MiB), and ``--gpus`` parsing."""

from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 1024 ** 3
_MIB = 1024 ** 2

# name -> total MiB the device reports
GPUS = {
    "H100": 81559,  # H100 SXM / PCIe 80 GB
    "H200": 143771,
    "B200": 183359,
    "A100": 81920,  # A100 80 GB
    "A100-40GB": 40960,
    "H20": 97871,
    "L40S": 46068,
    "RTX4090": 24564,
}


@dataclass(frozen=True)
class Hardware:
    count: int
    name: str
    bytes_per_device: int

    @property
    def gib_per_device(self) -> float:
        return self.bytes_per_device / GIB

    def __str__(self) -> str:
        return f"{self.count}x{self.name} ({self.gib_per_device:.1f} GiB each)"


def parse_gpus(spec: str) -> Hardware:
    """``2xH200``, ``8xH100``, ``4x96GiB`` or ``H200`` (one)."""
    m = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?([A-Za-z0-9.\-]+?)\s*", spec)
    if not m:
        raise ValueError(f"--gpus {spec!r}: expected COUNTxGPU, e.g. 2xH200, 8xH100 or 4x96GiB")
    count, name = int(m.group(1) or 1), m.group(2)
    if count < 1:
        raise ValueError(f"--gpus {spec!r}: the count must be at least 1")
    size = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(GiB|GB)", name, re.IGNORECASE)
    if size:
        unit = GIB if size.group(2).lower() == "gib" else 10 ** 9
        return Hardware(count, name, int(float(size.group(1)) * unit))
    known = {k.lower(): k for k in GPUS}
    key = known.get(name.lower())
    if key is None:
        raise ValueError(f"--gpus {spec!r}: unknown GPU {name!r}; known: {', '.join(GPUS)}, or a size such as 80GiB")
    return Hardware(count, key, GPUS[key] * _MIB)
