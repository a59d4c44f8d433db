"""Fused CPU kernels for the decode step, built on first use with the system C compiler,
cached by source hash, and called through ctypes (which releases the GIL).

Plain C with no torch headers compiles in about a second, so there is no build step at
install time. Where the CPU lacks AVX-512 or no compiler is found, callers fall back to
the eager torch code, which these kernels reproduce up to summation order.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from xlserve.kernels.cpu_isa import cpu_flags

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(n) for n in ("gemv_bf16.c", "gemm_amx.c", "decode_ops.c", "decode_attention.c",
                                                 "decode_layer.c", "gemm_tile_order_dense.c")]
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp", "-shared", "-fPIC"]
LINEAR_MAX_ROWS = 4  # beyond this, a matmul on AMX tiles (or oneDNN's GEMM) beats a pass per row block
MAX_ROWS = 64  # decode batches up to this size take the fused path (norm, rope, attention)
# The portable one-call step (decode_step.c) has no row limit of its own; a speculative step's
# checking rows reach 80-100 at batch 8. The default model (Q4_1 kept, bf16 on the AMX tiles),
# median decode step, one-call against layer by layer, two alternating processes each: 72 rows
# 66-72 against 77-89 ms, 96 rows 76-98 against 83-113, 128 rows 119-133 against 102-115.
PORTABLE_MAX_ROWS = 96
# ...and, on vdpbf16ps without AMX, the row kernel's batched blocks (gemv_bf16.c) up to this many
# rows: every output the same bits in any batch, and a decode step of up to MAX_ROWS in one call
BF16_DOT_MAX_ROWS = MAX_ROWS
AMX_MAX_ROWS = MAX_ROWS  # up to this many rows our AMX matmul beats oneDNN's (which reorders the weight per call)
# ...and from this many it beats the row kernel too (decode_layer.c: the same rule): the default
# model dequantized to bf16 on a 2-core Xeon with AMX (Emerald Rapids), batch-1 decode 97.2 ->
# 120.5 tok/s with the tiles from 1 row instead of 5 (median of 5 interleaved rounds)
AMX_MIN_ROWS = 1
MAX_HEAD_DIM = 1024

_lock = threading.Lock()
_lib = None
_tried = False
_answers: dict[str, bool] = {}  # _library_says
_enabled = os.environ.get("XLSERVE_EAGER", "") in ("", "0")

P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "xl_linear_bf16": [P, P, P, P, P, I64, I64, I64, I32, I32],
    "xl_rmsnorm": [P, P, P, I64, I64, F32, I32],
    "xl_rope": [P, P, P, I64, I64, I64, I64, I64, I32],
    "xl_silu_mul": [P, P, I64, I64, I32],
    "xl_decode_attention": [P, P, P, I64, P, P, P, P, P, P, I64, I64, I64, I64, I64, F32, I32, I32],
    "xl_amx_ready": [],
    "xl_bf16_dot_ready": [],
    "xl_linear_amx": [P, P, P, P, P, I64, I64, I64, I32],
    "xl_linear_amx_f32": [P, P, P, I64, I64, I64, I32],
    "xl_linear_amx_dense": [P, P, P, I64, I64, I64, I64, I32],
    "xl_tile_order_dense": [P, P, P, P, P, P, I64, I64, I64, I64, I32],
    "xl_decode_layers": [P, I64, I64, I64, P, F32, I64, I64, I64, I64, P, P, P, P, P, I64, F32, I32, I32],
}
LAYER_POINTERS = 9  # per layer in ``decode_layers_``'s table, in xl_decode_layers' order


def set_enabled(enabled: bool) -> None:
    """Turn the kernels off to run the plain eager torch path (the reference)."""
    global _enabled
    _enabled = enabled


def enabled() -> bool:
    """False when the kernels are switched off (``XLSERVE_EAGER=1`` or ``set_enabled``)."""
    return _enabled


def _private(path: Path) -> bool:
    """Owned by this user, not a symlink, writable by nobody else: what lies there is ours."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022 and not stat.S_ISLNK(st.st_mode)


@functools.cache
def _cache_dir() -> Path:
    """The kernel cache, if it and its parent are private; else a fresh private temporary
    directory (a library planted in a shared directory would run inside the server)."""
    base = os.environ.get("XLSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "xlserve")
    wanted = Path(base) / "kernels"
    for folder in (wanted.parent, wanted):
        try:
            folder.mkdir(parents=True)
            folder.chmod(0o700)  # what we create is private whatever the umask
        except OSError:
            pass  # exists (checked below) or cannot be made (then a temporary one is used)
    if _private(wanted) and _private(wanted.parent):
        return wanted
    private = Path(tempfile.mkdtemp(prefix="xlserve-kernels-"))
    log.warning("kernel cache %s is not private to this user (owner or permissions); building in %s",
                wanted, private)
    return private


def _cflag_sets() -> list[list[str]]:
    """Flags to try in order: with every instruction set this CPU has, then without AMX
    (a compiler older than the CPU may not know it; the AMX kernel then reports itself
    unavailable and the rest still builds)."""
    flags, have = list(CFLAGS), cpu_flags()
    if "avx512_bf16" in have:
        flags += ["-mavx512bf16", "-DXL_HAVE_BF16_DOT"]
    if {"amx_tile", "amx_bf16", "avx512_bf16"} <= have:
        return [flags + ["-mamx-tile", "-mamx-bf16", "-DXL_HAVE_AMX"], flags]
    return [flags]


def c_compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _build() -> ctypes.CDLL | None:
    if "AVX512" not in torch.backends.cpu.get_cpu_capability() or "avx512f" not in cpu_flags():
        return None
    compiler = c_compiler()
    if compiler is None:
        log.warning("no C compiler found: the decode step uses the slower torch path")
        return None
    target = None
    for cflags in _cflag_sets():
        target = compiled(compiler, cflags)
        if target is not None:
            break
    if target is None:
        return None
    lib = ctypes.CDLL(str(target))
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    lib.xl_amx_ready.restype = lib.xl_bf16_dot_ready.restype = ctypes.c_int
    return lib


def library_name(cflags: list[str], sources: list[Path] = SOURCES) -> str:
    """The cached library's file name: a digest of the sources, headers and flags."""
    headers = sorted(Path(__file__).parent.glob("*.h"))
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in [*sources, *headers]) + " ".join(cflags).encode())
    return f"xlserve_cpu_{digest.hexdigest()[:16]}.so"


def compiled(compiler: str, cflags: list[str], sources: list[Path] = SOURCES) -> Path | None:
    """The library of ``sources`` built with ``cflags``, from the private cache or compiled
    now; None if it fails."""
    target = _cache_dir() / library_name(cflags, sources)
    if _private(target):
        return target
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    result = subprocess.run([compiler, *cflags, *map(str, sources), "-lm", "-o", str(tmp)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        log.warning("building the CPU kernels with %s failed: %s", " ".join(cflags[-3:]), result.stderr[-500:])
        return None
    tmp.chmod(0o700)
    os.replace(tmp, target)  # atomic: concurrent builders never see half a file
    return target


def kernels() -> ctypes.CDLL | None:
    """The library, or None where it cannot be built (or is switched off)."""
    global _lib, _tried
    if not _enabled:
        return None
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except OSError as e:
                log.warning("CPU kernels unavailable (%s); using torch", e)
    return _lib


def supports_shape(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """The kernels' fixed scratch and vector width: head_dim <= 1024 and a multiple of 16,
    at most 64 query heads per KV head."""
    return head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0 and num_heads // num_kv_heads <= 64


def usable(*tensors: torch.Tensor) -> bool:
    """Kernels apply: CPU, contiguous, bf16 or fp32 activations, library loaded."""
    return (all(t.device.type == "cpu" and t.is_contiguous() and t.dtype in (torch.bfloat16, torch.float32)
                for t in tensors) and kernels() is not None)


def _is_bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def use_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The row kernel applies: a bf16 weight and 1-4 rows, or up to ``BF16_DOT_MAX_ROWS`` bf16
    rows where vdpbf16ps multiplies them and AMX does not (``batched_rows``)."""
    rows = x.numel() // x.shape[-1]
    return (weight.dtype == torch.bfloat16 and (rows <= LINEAR_MAX_ROWS or (
        rows <= BF16_DOT_MAX_ROWS and x.dtype == torch.bfloat16 and batched_rows()))
        and usable(weight, x))


def batched_rows() -> bool:
    """Batches of bf16 rows (5 to ``BF16_DOT_MAX_ROWS``) take the row kernel's batched blocks:
    the CPU has AVX512-BF16 and no usable AMX (whose tiles are faster where they run)."""
    return bf16_dot_ready() and not amx_ready()


def bf16_dot_ready() -> bool:
    """The kernels were built with AVX512-BF16 (bf16 rows multiply on vdpbf16ps)."""
    return _library_says("xl_bf16_dot_ready")


def _library_says(question: str) -> bool:
    """A yes or no the loaded library answers once per process (``xl_amx_ready`` asks the OS
    for the tiles); no while the library is not loaded or switched off."""
    if question not in _answers:
        lib = kernels()
        if lib is None:
            return False
        _answers[question] = bool(getattr(lib, question)())
    return _answers[question]


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias) (+ residual)`` for bf16 ``weight`` and few rows of ``x``."""
    lib = kernels()
    x = x.contiguous()
    n, k = weight.shape
    m = x.numel() // k
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    bias_ptr = bias.to(x.dtype).contiguous().data_ptr() if bias is not None else None
    res_ptr = residual.contiguous().data_ptr() if residual is not None else None
    lib.xl_linear_bf16(x.data_ptr(), weight.data_ptr(), bias_ptr, res_ptr, out.data_ptr(), m, n, k, _is_bf16(x),
                       torch.get_num_threads())
    return out


BF16_X_F32_OUT = 2  # gemv_bf16.c's XL_BF16_X_F32_OUT


def linear_bf16_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for a bf16 ``weight`` and bf16 ``x`` of any row count, as the float32
    sums the kernels accumulate (never rounded to bf16): the logits. They take the AMX tiles
    where ``use_amx`` says so (32 rows of the default model's head: 33 ms on the row kernel,
    about 7 on the tiles), else the row kernel."""
    x = x.contiguous()
    n, k = weight.shape
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    rows = x.numel() // k
    if rows >= AMX_MIN_ROWS and use_amx(x[..., :AMX_MIN_ROWS, :], weight):
        for start in range(0, rows, AMX_MAX_ROWS):  # the tiles' row limit, a pass each
            m = min(AMX_MAX_ROWS, rows - start)
            kernels().xl_linear_amx_f32(x.data_ptr() + start * k * 2, weight.data_ptr(),
                                        out.data_ptr() + start * n * 4, m, n, k, torch.get_num_threads())
    else:
        kernels().xl_linear_bf16(x.data_ptr(), weight.data_ptr(), None, None, out.data_ptr(), rows, n, k,
                                 BF16_X_F32_OUT, torch.get_num_threads())
    return out


def use_amx(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The AMX matmul applies: bf16 activations and weight, AMX_MIN_ROWS to AMX_MAX_ROWS rows,
    K and N multiples of 32, AMX usable in this process (it comes before the row kernel)."""
    k = weight.shape[1]
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and amx_shapes(weight)
            and AMX_MIN_ROWS <= x.numel() // k <= AMX_MAX_ROWS and usable(weight, x) and amx_ready())


def amx_shapes(*weights: torch.Tensor) -> bool:
    """Every weight fits the AMX kernel's blocking (both dimensions multiples of 32)."""
    return all(w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0 for w in weights)


def amx_ready() -> bool:
    """The kernels were built with AMX and the OS lets this process use the tiles."""
    return _library_says("xl_amx_ready")


def linear_amx(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias) (+ residual)`` on AMX tiles, the weight read in place; where the
    process has no tiles, their twin in FMAs computes the same bits (``--deterministic``'s
    kernel, ``invariant_linear``), slower: the default takes it only with ``use_amx``."""
    if kernels() is None:
        raise ValueError("the AVX-512 kernels are unavailable in this process (CPU, compiler or XLSERVE_EAGER)")
    x = x.contiguous()
    n, k = weight.shape
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    bias_ptr = bias.to(x.dtype).contiguous().data_ptr() if bias is not None else None
    res_ptr = residual.contiguous().data_ptr() if residual is not None else None
    kernels().xl_linear_amx(x.data_ptr(), weight.data_ptr(), bias_ptr, res_ptr, out.data_ptr(), x.numel() // k, n, k,
                            torch.get_num_threads())
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    h = x.shape[-1]
    kernels().xl_rmsnorm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // h, h, eps, _is_bf16(x))
    return out


def rope_(qkv: torch.Tensor, num_q_heads: int, num_k_heads: int, head_dim: int,
          cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the q and k heads of the fused projection ``qkv`` [T, row] in place;
    cos/sin [T, D] in the activation dtype."""
    t, row = qkv.shape
    kernels().xl_rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, row, num_q_heads, num_k_heads,
                      head_dim, _is_bf16(qkv))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    i = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], i, dtype=gate_up.dtype)
    kernels().xl_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * i), i, _is_bf16(gate_up))
    return out


def decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, new_slots: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Write each sequence's new K/V (views [B, Hk, D] of the fused projection) into
    ``new_slots``, then attend q [B, Hq, D] over the paged context ``slots`` [B, L]."""
    b, hq, d = q.shape
    row = q.stride(0)  # meaningless (and unused) when b == 1
    assert q.stride(1) == d and (b == 1 or (k_new.stride(0) == row and v_new.stride(0) == row))
    out = torch.empty(b, hq, d, dtype=q.dtype)
    kernels().xl_decode_attention(q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), row, new_slots.data_ptr(),
                                  k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), lens.data_ptr(),
                                  out.data_ptr(), b, hq, k_cache.shape[1], d, slots.shape[1], scale,
                                  _is_bf16(q), torch.get_num_threads())
    return out


def decode_layers_(x: torch.Tensor, table: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int,
                   head_dim: int, intermediate: int, cos: torch.Tensor, sin: torch.Tensor, new_slots: torch.Tensor,
                   slots: torch.Tensor, lens: torch.Tensor) -> None:
    """Every Llama-style decoder layer on ``x`` [B, H] in place (bf16 weights; B within
    ``DecoderLayer.one_call_fits``' rule): ``table`` [layers, LAYER_POINTERS] int64
    holds each layer's weight and KV-cache addresses; cos/sin [B, D]; the new K/V go to
    ``new_slots``, attention reads ``slots``."""
    if table.dim() != 2 or table.shape[1] != LAYER_POINTERS or table.dtype != torch.int64:
        # the C loop reads LAYER_POINTERS raw addresses per layer: any other table is a crash
        raise ValueError(f"decode_layers_ needs an int64 [layers, {LAYER_POINTERS}] address table, "
                         f"got {table.dtype} {tuple(table.shape)}")
    b, h = x.shape
    kernels().xl_decode_layers(
        x.data_ptr(), b, h, table.shape[0], table.data_ptr(), eps, num_heads, num_kv_heads, head_dim, intermediate,
        cos.data_ptr(), sin.data_ptr(), new_slots.data_ptr(), slots.data_ptr(), lens.data_ptr(), slots.shape[1],
        head_dim ** -0.5, _is_bf16(x), torch.get_num_threads())
