"""The bf16 skinny-matmul CPU kernel: built on first use with the system C compiler,
cached by source hash, called through ctypes (which releases the GIL).

Falls back to ``torch.nn.functional.linear`` where the CPU lacks AVX-512 or no compiler
is found; results then differ only by summation order.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("gemv_bf16.c")
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp", "-shared", "-fPIC"]
MAX_ROWS = 16  # beyond this, a real GEMM (oneDNN, AMX) is faster

_lock = threading.Lock()
_lib = None
_tried = False
_enabled = os.environ.get("XLSERVE_EAGER", "") in ("", "0")


def set_enabled(enabled: bool) -> None:
    """Turn the kernel off to run the plain eager torch path (the reference)."""
    global _enabled
    _enabled = enabled


def _cache_dir() -> Path:
    base = os.environ.get("XLSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "xlserve")
    return Path(base) / "kernels"


def _build() -> ctypes.CDLL | None:
    if "AVX512" not in torch.backends.cpu.get_cpu_capability():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: bf16 decode uses the slower torch path")
        return None
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"gemv_bf16_{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True)
        if result.returncode != 0:
            log.warning("building the bf16 kernel failed, using torch: %s", result.stderr[-500:])
            return None
        os.replace(tmp, target)  # atomic: concurrent builders never see half a file
    lib = ctypes.CDLL(str(target))
    lib.xl_gemv_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.xl_gemv_bf16.restype = None
    return lib


def kernel() -> ctypes.CDLL | None:
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except OSError as e:
                log.warning("bf16 kernel unavailable (%s); using torch", e)
    return _lib


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for CPU bf16 ``weight`` and few rows of ``x``."""
    lib = kernel()
    if lib is None:
        return torch.nn.functional.linear(x, weight, bias)
    shape = x.shape
    x32 = x.reshape(-1, shape[-1]).to(torch.float32).contiguous()
    m, k = x32.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    lib.xl_gemv_bf16(x32.data_ptr(), weight.data_ptr(), out.data_ptr(), m, n, k, torch.get_num_threads())
    if bias is not None:
        out += bias
    return out.to(x.dtype).reshape(*shape[:-1], n)


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_enabled and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.is_contiguous()
            and x.numel() // x.shape[-1] <= MAX_ROWS and kernel() is not None)
