"""The quantized-weight matmul (``gemm_quant.c``), built per instruction set on first use
and called through ctypes (which releases the GIL).

Two builds of one source: AVX-512 where the CPU has it, AVX2 + FMA + F16C elsewhere (every
x86-64 CPU since 2013), so a quantized model runs its own kernel on AMD and Intel alike.
Tests build both where the CPU allows and hold each to the reference. Without a compiler
or on another architecture, ``QuantizedWeight`` computes with torch instead.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
from pathlib import Path

import torch

from xlserve.kernels import cpu_ops

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name("gemm_quant.c")]
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]  # exact dequantization: no fused mul-add


class ISA(enum.Enum):
    """An instruction set the kernel is built for, best first."""
    AVX512 = "avx512"
    AVX2 = "avx2"

    @property
    def cpu_flags(self) -> set[str]:
        return {"avx512f", "f16c"} if self is ISA.AVX512 else {"avx2", "fma", "f16c"}

    @property
    def cflags(self) -> list[str]:
        return ["-mavx512f", "-mf16c", "-mfma"] if self is ISA.AVX512 else ["-mavx2", "-mfma", "-mf16c"]


P, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {
    "xl_linear_quant": ([I32, P, P, I64, P, I64, I64, I64, I64, I32], None),
    "xl_dequant_rows": ([I32, P, I64, P, I64, I64, P, I32], None),
    "xl_quant_supported": ([I32], ctypes.c_int),
}


def available_isas() -> list[ISA]:
    """The builds this CPU can run, best first."""
    have = cpu_ops.cpu_flags()
    return [isa for isa in ISA if isa.cpu_flags <= have]


@functools.cache
def library(isa: ISA) -> ctypes.CDLL | None:
    """The kernel built for ``isa``, or None where it cannot be (no compiler, build error)."""
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
    """The best build for this CPU, or None (torch computes instead)."""
    global _chosen
    if _chosen is False:
        _chosen = None
        if cpu_ops.enabled():
            for isa in available_isas():
                _chosen = library(isa)
                if _chosen is not None:
                    log.info("quantized matmul kernel: %s", isa.value)
                    break
    return _chosen if cpu_ops.enabled() else None


def linear(lib: ctypes.CDLL, qtype: int, x: torch.Tensor, data: torch.Tensor, out: torch.Tensor,
           column: int) -> None:
    """``out[:, column:column + N] = x @ dequant(data).T``: x [M, K] float32, data [N, row
    bytes] uint8 of ``qtype``, out [M, ldo] float32, all contiguous."""
    m, k = x.shape
    lib.xl_linear_quant(qtype, x.data_ptr(), data.data_ptr(), data.shape[1], out[:, column:].data_ptr(), m,
                        data.shape[0], k, out.shape[1], torch.get_num_threads())


def dequantize_rows(lib: ctypes.CDLL, qtype: int, data: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ``ids`` of ``data`` dequantized: [len(ids), k] float32."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    lib.xl_dequant_rows(qtype, data.data_ptr(), data.shape[1], ids.data_ptr(), ids.numel(), k, out.data_ptr(),
                        torch.get_num_threads())
    return out
