"""What the API reports is what runs: get_kernel_isa() is the cap and
get_kernel_names() the micro-kernel each dtype's dispatch picked under it.

The expected names come from the documented rule applied to the host's
features (ext.isa_supported, the CPU vendor from /proc/cpuinfo), not from
the dispatch under test: each family runs its best kernel at or below the
cap, bf16 skips vdpbf16ps on Intel CPUs, x86 float16 converts to float32.
Each cap runs in a child process (the fp32 and half-precision families
choose once per process), through MLX_LATTICE_GEMM_ISA and set_kernel_isa.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest

import mlx_lattice
from mlx_lattice._native import ext

_X86 = platform.machine() in ("x86_64", "AMD64")
pytestmark = pytest.mark.skipif(not _X86, reason="the x86-64 levels (AArch64: docs/guides/arm64)")

# x86-64's levels, lowest first (csrc/cpu/isa.h).
_LEVELS = ("scalar", "avx2-fma", "avx-vnni", "avx512f", "avx512-vnni", "avx512-bf16",
           "amx-int8", "amx-bf16")  # fmt: skip
# Each family's kernels, best first, before its fallback.
_FP32 = ("avx512f", "avx2-fma")
_INT8 = ("amx-int8", "avx512-vnni", "avx-vnni", "avx2-fma")
_BF16 = ("amx-bf16", "avx512-bf16")


def _is_intel() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text(errors="replace") if cpuinfo.exists() else ""
    return "GenuineIntel" in text


def expected(cap: str) -> dict[str, str]:
    """The kernel each family runs under ``cap`` on this host, by the rule."""

    def best(kernels: tuple[str, ...], fallback: str, skip: tuple[str, ...] = ()) -> str:
        for isa in kernels:
            if isa in skip:
                continue
            if _LEVELS.index(isa) <= _LEVELS.index(cap) and ext.isa_supported(isa):
                return isa
        return fallback

    return {
        "fp32": best(_FP32, "scalar"),
        "bf16": best(_BF16, "float32", skip=("avx512-bf16",) if _is_intel() else ()),
        "fp16": "float32",  # no x86 float16 kernel: converted to float32
        "int8": best(_INT8, "scalar"),
    }


_REPORT = """
import json, sys
import mlx_lattice
before = mlx_lattice.get_kernel_isa()
if sys.argv[2] != "-":
    mlx_lattice.set_kernel_isa(sys.argv[2])  # before any kernel ran
report = {"cap": mlx_lattice.get_kernel_isa(), "names": mlx_lattice.get_kernel_names()}
mlx_lattice.set_kernel_isa(None)  # back to the environment's cap
report["reset"] = {"cap": mlx_lattice.get_kernel_isa(), "names": mlx_lattice.get_kernel_names()}
report["before"] = before
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
"""


def _report(isa_child, tmp_path, env_cap: str, set_cap: str = "-") -> dict:
    out = tmp_path / f"report-{env_cap or 'none'}-{set_cap}.json"
    isa_child(_REPORT, env_cap, out, set_cap)
    return json.loads(out.read_text())


def test_uncapped_the_cap_is_the_top_level_and_the_kernels_the_hosts_best(isa_child, tmp_path):
    report = _report(isa_child, tmp_path, "")  # empty: as if unset
    assert report["cap"] == "amx-bf16"
    assert report["names"] == expected("amx-bf16")


def test_this_host_class_reports_its_avx512_kernels_not_the_cap(isa_child, tmp_path):
    """AVX-512 VNNI and BF16 without AMX (AMD Zen 4): the cap says amx-bf16,
    the kernels that run are the AVX-512 ones (before, only the cap was
    reported, and on an AVX2 host it read amx-bf16 while avx2-fma ran)."""
    features = ("avx512f", "avx512-vnni", "avx512-bf16")
    if not all(map(ext.isa_supported, features)) or ext.isa_supported("amx-int8") or _is_intel():
        pytest.skip("not an AVX-512 VNNI/BF16 host without AMX (AMD Zen 4 class)")
    report = _report(isa_child, tmp_path, "")
    assert report["cap"] == "amx-bf16"
    assert report["names"] == {
        "fp32": "avx512f",
        "bf16": "avx512-bf16",
        "fp16": "float32",
        "int8": "avx512-vnni",
    }


@pytest.mark.parametrize("cap", _LEVELS)
def test_a_cap_from_the_environment_changes_every_family(isa_child, tmp_path, cap):
    report = _report(isa_child, tmp_path, cap)
    assert report["cap"] == cap
    assert report["names"] == expected(cap), cap
    if cap == "scalar":
        assert report["names"] == {"fp32": "scalar", "bf16": "float32", "fp16": "float32",
                                   "int8": "scalar"}  # fmt: skip


@pytest.mark.parametrize("cap", ["scalar", "avx2-fma", "avx512f"])
def test_set_kernel_isa_before_first_use_changes_every_family(isa_child, tmp_path, cap):
    """set_kernel_isa before the first kernel caps every family; back to the
    environment's cap, the int8 family follows at once, the others keep the
    kernel they chose (and report it)."""
    report = _report(isa_child, tmp_path, "", cap)
    assert report["before"] == "amx-bf16" and report["cap"] == cap
    assert report["names"] == expected(cap)
    assert report["reset"]["cap"] == "amx-bf16"
    assert report["reset"]["names"] == {**expected(cap), "int8": expected("amx-bf16")["int8"]}


def test_in_process_a_cap_moves_int8_at_once_and_keeps_the_others():
    names = mlx_lattice.get_kernel_names()  # the fp32 and half families chose by now
    try:
        mlx_lattice.set_kernel_isa("scalar")
        assert mlx_lattice.get_kernel_isa() == "scalar"
        assert mlx_lattice.get_kernel_names() == {**names, "int8": "scalar"}
    finally:
        mlx_lattice.set_kernel_isa(None)
    assert mlx_lattice.get_kernel_names() == names
