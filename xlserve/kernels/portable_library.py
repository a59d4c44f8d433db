"""The kernels built per instruction set (``gemm_quant.c``, ``dot_q8.c``, ``dot_q8_x16.c``,
``gemm_amx_quant.c``, ``gemm_tile_order.c``, ``attention_paged.c``, ``decode_step.c``) on first
use and called through ctypes (which releases the GIL).

Four builds of the same sources: AMX, AVX-512 with VNNI or without it where the CPU has them,
AVX2 + FMA + F16C elsewhere (every x86-64 CPU since 2013), so AMD and Intel CPUs alike run
them. Tests build each one the CPU allows and hold it to the reference. Without a compiler, on another architecture
or with the kernels switched off (``XLSERVE_EAGER=1``), callers compute with torch.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
from pathlib import Path

import torch

from xlserve.kernels import cpu_isa, cpu_ops

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(n) for n in ("gemm_quant.c", "dot_q8.c", "dot_q8_x16.c", "gemm_amx_quant.c",
                                                  "gemm_tile_order.c", "attention_paged.c", "decode_step.c")]
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]  # exact dequantization: no fused mul-add


class ISA(enum.Enum):
    """An instruction set the kernels are built for, best first. AVX512_VNNI (Intel Ice Lake and
    later, AMD Zen 4 and later) adds the 8-bit activations' vpdpbusd path (``dot_q8.c``) and
    the tile kernel's twin in FMAs (``gemm_tile_order.c``); AVX512 alone is Skylake-X's. AMX
    (Intel Sapphire Rapids and later) adds the tile kernel of Q4_0 / Q4_1 / Q8_0 weights
    against bfloat16 activations (``gemm_amx_quant.c``), the same bits as the twin."""
    AMX = "amx"
    AVX512_VNNI = "avx512-vnni"
    AVX512 = "avx512"
    AVX2 = "avx2"

    @property
    def cpu_flags(self) -> set[str]:
        return CPU_FLAGS[self]

    @property
    def cflags(self) -> list[str]:
        return CFLAGS[self]


CPU_FLAGS = {ISA.AMX: {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "avx512_bf16", "avx512vbmi",
                       "amx_tile", "amx_bf16"},
             ISA.AVX512_VNNI: {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c"},
             ISA.AVX512: {"avx512f", "f16c"}, ISA.AVX2: {"avx2", "fma", "f16c"}}
CFLAGS = {ISA.AMX: ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma", "-mavx512bf16",
                    "-mavx512vbmi", "-mamx-tile", "-mamx-bf16"],
          ISA.AVX512_VNNI: ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma"],
          ISA.AVX512: ["-mavx512f", "-mf16c", "-mfma"], ISA.AVX2: ["-mavx2", "-mfma", "-mf16c"]}


P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "xl_linear_quant": ([I32, P, P, I64, P, I64, I64, I64, I64, I32, I32], None),
    "xl_dequant_rows": ([I32, P, I64, P, I64, I64, P, I32], None),
    "xl_linear_dense": ([P, P, I32, P, I64, I64, I64, I64, I32], None),
    "xl_paged_attention": ([P, I64, I64, I64, I64, I64, P, P, P, I64, P, P, F32, P, I32, I32], None),
    "xl_paged_attention_windowed": ([P, I64, I64, I64, I64, I64, P, P, P, I64, P, P, P, P, P, F32, P, I32, I32], None),
    "xl_row_rmsnorm": ([P, P, P, I64, I64, F32, I32, I32], None),
    "xl_row_silu_mul": ([P, P, I64, I64, I32, I32], None),
    "xl_decode_step": ([P, I64, I64, I64, P, F32, I64, I64, I64, I64, P, P, P, P, I64, P, F32, I32, I32], None),
    "xl_decode_step_layer_fields": ([], I64),
    "xl_amx_quant_ready": ([], I32),
    "xl_tile_order_ready": ([], I32),
}


def available_isas() -> list[ISA]:
    """The builds this CPU can run, best first."""
    have = cpu_isa.cpu_flags()
    return [isa for isa in ISA if isa.cpu_flags <= have]


@functools.cache
def library(isa: ISA) -> ctypes.CDLL | None:
    """The kernels built for ``isa``, or None where they cannot be (no compiler, build error)."""
    compiler = cpu_ops.c_compiler()
    if compiler is None:
        return None
    target = cpu_ops.compiled(compiler, COMMON_FLAGS + isa.cflags, SOURCES)
    if target is None:
        return None
    lib = ctypes.CDLL(str(target))
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


_chosen: ctypes.CDLL | None | bool = False


def kernels() -> ctypes.CDLL | None:
    """The best build for this CPU, or None (torch computes instead). Chosen at the first call
    with the kernels switched on: a first call while they are off (``cpu_ops.set_enabled``)
    must not leave them off for good, or a later run would mix torch and kernel paths (a
    deterministic run once lost its batch invariance that way, after an eager comparison)."""
    global _chosen
    if not cpu_ops.enabled():
        return None
    if _chosen is False:
        _chosen = None
        for isa in available_isas():
            _chosen = library(isa)
            if _chosen is not None:
                log.info("portable CPU kernels: %s", isa.value)
                break
    return _chosen


def row_kernels(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The build, when its row kernels (RMSNorm, SiLU-and-multiply) compute these tensors in the
    eager path: CPU, fp32 or bf16, on every CPU the build runs (AVX-512 ones too, where the
    AVX-512 decode kernels have their own norm inside their fused paths). The one-call decode
    step (``decode_step.c``) calls the same kernels, so a row gets the same bits on both paths.
    Nothing here may depend on the batch (not even contiguity, which a one-row view has and a
    many-row one lacks): a row must take the same kernel alone or batched."""
    if not all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16) for t in tensors):
        return None
    return kernels()
