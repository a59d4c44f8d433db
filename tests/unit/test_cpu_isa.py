"""``XLSERVE_MAX_CPU_ISA``: a CPU capped at a level shows only that level's flags, so the kernel
builds and the default dtype are an older CPU's; a wrong value is a clear error."""

import json
import subprocess
import sys

import pytest

from xlserve.kernels import cpu_isa
from xlserve.kernels.cpu_isa import CpuIsa

ZEN4 = {"avx2", "fma", "f16c", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512ifma", "avx512vbmi",
        "avx512_vbmi2", "avx512_vnni", "avx512_bitalg", "avx512_vpopcntdq", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize("cap, kept", [
    (CpuIsa.AMX, SAPPHIRE_RAPIDS),
    (CpuIsa.AVX512_BF16, ZEN4),
    (CpuIsa.AVX512_VNNI, ZEN4 - {"avx512_bf16"}),
    (CpuIsa.AVX512, {"avx2", "fma", "f16c", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
    (CpuIsa.AVX2, {"avx2", "fma", "f16c"}),
])
def test_a_cap_keeps_the_flags_of_its_level(cap, kept, monkeypatch):
    monkeypatch.setattr(cpu_isa, "_cpuinfo_flags", lambda: frozenset(SAPPHIRE_RAPIDS))
    monkeypatch.setenv(cpu_isa.MAX_CPU_ISA_ENV, cap.label)
    assert cpu_isa.cpu_flags() == kept


def test_a_benchmark_records_the_cap_it_ran_under(monkeypatch, tmp_path):
    from xlserve.bench.cli import write_results
    monkeypatch.setattr(cpu_isa, "_cpuinfo_flags", lambda: frozenset(SAPPHIRE_RAPIDS))
    monkeypatch.setenv(cpu_isa.MAX_CPU_ISA_ENV, "avx512-bf16")
    write_results(str(tmp_path / "run.json"), {"figure": 1.5})
    written = json.loads((tmp_path / "run.json").read_text())
    assert written["figure"] == 1.5
    assert {k: written["machine"][k] for k in ("max_cpu_isa", "isa")} == {"max_cpu_isa": "avx512-bf16",
                                                                           "isa": "avx512-bf16"}
    monkeypatch.delenv(cpu_isa.MAX_CPU_ISA_ENV)
    assert cpu_isa.machine()["max_cpu_isa"] is None and cpu_isa.machine()["isa"] == "amx"


def test_unset_keeps_every_flag_and_a_wrong_value_names_the_choices(monkeypatch):
    monkeypatch.delenv(cpu_isa.MAX_CPU_ISA_ENV, raising=False)
    assert cpu_isa.max_isa() is CpuIsa.AMX
    monkeypatch.setenv(cpu_isa.MAX_CPU_ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match="avx2, avx512, avx512-vnni, avx512-bf16, amx"):
        cpu_isa.cpu_flags()


PROBE = """
import torch
from xlserve.kernels import cpu_ops, portable_library
from xlserve.loader.model_loader import resolve_dtype
lib = portable_library.kernels()
tiles = lib is not None and bool(lib.xl_amx_quant_ready())
print(cpu_ops.amx_ready(), tiles, resolve_dtype("auto", torch.device("cpu")))
"""


@pytest.mark.skipif(not {"avx512_bf16", "avx512_vnni"} <= cpu_isa.cpu_flags(), reason="needs AVX512-BF16")
def test_capped_below_amx_the_process_takes_the_kernels_of_a_cpu_without_it(monkeypatch):
    """In a fresh process (the builds are chosen once): no tiles, bfloat16 still the default
    dtype at avx512-bf16 (an AMD Zen 4's set), float32 at avx512-vnni (no bfloat16 math)."""
    def probe(cap: str) -> str:
        monkeypatch.setenv(cpu_isa.MAX_CPU_ISA_ENV, cap)
        return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    assert probe("avx512-bf16").split() == ["False", "False", "torch.bfloat16"]
    assert probe("avx512-vnni").split() == ["False", "False", "torch.float32"]
