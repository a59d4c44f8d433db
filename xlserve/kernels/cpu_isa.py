"""The instruction sets this process may use: the CPU's flags, capped by ``XLSERVE_MAX_CPU_ISA``.

Every choice of kernel build (``cpu_ops``, ``portable_library``) and of the default dtype
reads the flags here, so a cap makes a CPU compute as an older one would, as oneDNN's
``ONEDNN_MAX_CPU_ISA`` does for its own kernels (torch's matmuls follow that variable and
``ATEN_CPU_CAPABILITY``, not this one). Uses: run and measure the paths of a CPU without AMX
on one with it (``avx512-bf16`` is an AMD Zen 4 / 5's set), and give the workers of a mixed
fleet the same kernels, hence the same bits, so that a prompt computed on one CPU and
decoded on another answers as one machine would.
"""

from __future__ import annotations

import enum
import functools
import logging
import os

log = logging.getLogger(__name__)
MAX_CPU_ISA_ENV = "XLSERVE_MAX_CPU_ISA"


class CpuIsa(enum.IntEnum):
    """A level of the x86-64 instruction sets the kernels use, each one a CPU family's."""
    AVX2 = 0  # every x86-64 CPU since 2013
    AVX512 = 1  # Intel Skylake-X
    AVX512_VNNI = 2  # Intel Cascade Lake, Ice Lake (no bfloat16 math: the default dtype is float32)
    AVX512_BF16 = 3  # AMD Zen 4 / 5, Intel Cooper Lake
    AMX = 4  # Intel Sapphire Rapids and later

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")


SKYLAKE_X_FLAGS = {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}


def flag_level(flag: str) -> CpuIsa:
    """The lowest level whose CPUs have ``flag`` (a /proc/cpuinfo name); AVX2 for flags that
    are not AVX-512 or AMX."""
    if flag.startswith("amx") or flag == "avx512_fp16":
        return CpuIsa.AMX
    if flag == "avx512_bf16":
        return CpuIsa.AVX512_BF16
    if flag in SKYLAKE_X_FLAGS:
        return CpuIsa.AVX512
    return CpuIsa.AVX512_VNNI if flag.startswith("avx512") else CpuIsa.AVX2


def max_isa() -> CpuIsa:
    """The cap ``XLSERVE_MAX_CPU_ISA`` sets (the highest level when unset)."""
    value = os.environ.get(MAX_CPU_ISA_ENV, "").strip().lower()
    if not value:
        return CpuIsa.AMX
    for isa in CpuIsa:
        if isa.label == value:
            return isa
    raise ValueError(f"{MAX_CPU_ISA_ENV}={value!r}: expected one of {', '.join(i.label for i in CpuIsa)}")


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first value of ``field`` in /proc/cpuinfo ('' where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpuinfo_flags() -> frozenset[str]:
    return frozenset(_cpuinfo("flags").split())


def cpu_flags() -> set[str]:
    """The CPU's flags that this process may use: those at or below ``max_isa()``."""
    cap, have = max_isa(), _cpuinfo_flags()
    kept = {flag for flag in have if flag_level(flag) <= cap}
    if kept != have:
        _log_cap(cap, frozenset(have - kept))
    return kept


@functools.cache
def _log_cap(cap: CpuIsa, dropped: frozenset[str]) -> None:
    log.info("%s=%s: the kernels do without %s", MAX_CPU_ISA_ENV, cap.label, " ".join(sorted(dropped)))


def machine() -> dict:
    """Where a benchmark ran: the CPU's model name, its logical CPUs, the cap in force (None when
    unset) and the highest level this process uses."""
    return {"cpu": _cpuinfo("model name"), "logical_cpus": os.cpu_count(),
            "max_cpu_isa": max_isa().label if os.environ.get(MAX_CPU_ISA_ENV, "").strip() else None,
            "isa": max(map(flag_level, cpu_flags()), default=CpuIsa.AVX2).label}
