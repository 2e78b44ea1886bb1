"""Yardsticks for kernel benchmarks: the machine's real sgemm rate and its
measured vector peak.

* :func:`sgemm_reference` times NumPy's float32 GEMM in a child process with
  ``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` removed from its
  environment (only there: these machines set them for old-OpenBLAS safety,
  which pins OpenBLAS to its Haswell/AVX2 kernels and halves its rate), and
  asks OpenBLAS which kernel family it picked.
* :func:`vector_peak` runs ``fma_peak`` (``benchmarks/fma_peak.cc``): loops of
  independent FP32 FMAs, int8 dot products (VNNI) and bf16 dot products
  (AVX512-BF16) on one thread and on every core — the roofline a kernel's
  GFLOP/s is compared with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.host_class import host_class_line

__all__ = ["SgemmReference", "VectorPeak", "sgemm_reference", "vector_peak"]

_HANDICAP = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")

# Runs in the child: median of 7 timed 2048^3 sgemms after one warm-up, and
# OpenBLAS's own name for the kernel family it chose at load time.
_CHILD = r"""
import ctypes, glob, json, os, statistics, time
import numpy as np
n = int(os.environ["YARDSTICK_N"])
rng = np.random.default_rng(0)
a = rng.standard_normal((n, n), dtype=np.float32)
b = rng.standard_normal((n, n), dtype=np.float32)
a @ b
times = []
for _ in range(7):
    t = time.perf_counter(); a @ b; times.append(time.perf_counter() - t)
core = "unknown"
libs = glob.glob(os.path.join(os.path.dirname(np.__file__) + ".libs", "*openblas*"))
for lib in libs:
    dll = ctypes.CDLL(lib)
    for sym in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
        fn = getattr(dll, sym, None)
        if fn is not None:
            fn.restype = ctypes.c_char_p
            core = fn().decode()
            break
print(json.dumps({"gflops": 2 * n**3 / statistics.median(times) / 1e9, "core": core}))
"""


@dataclass(frozen=True)
class SgemmReference:
    """NumPy's float32 GEMM rate (GFLOP/s) and the OpenBLAS kernel family."""

    gflops: float
    core: str
    handicapped_gflops: float
    handicapped_core: str


def _child_sgemm(n: int, env: dict[str, str]) -> tuple[float, str]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env={**env, "YARDSTICK_N": str(n)},
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return float(result["gflops"]), str(result["core"])


def sgemm_reference(n: int = 2048) -> SgemmReference:
    """The real sgemm rate (child process without the OpenBLAS core pin) and,
    for comparison, the rate with this process's environment as it is."""
    clean = {k: v for k, v in os.environ.items() if k not in _HANDICAP}
    gflops, core = _child_sgemm(n, clean)
    handicapped, handicapped_core = _child_sgemm(n, dict(os.environ))
    return SgemmReference(gflops, core, handicapped, handicapped_core)


@dataclass(frozen=True)
class VectorPeak:
    """Measured loop rates per instruction family: ``{name: (unit, one
    thread, all cores)}``, e.g. ``fp32_fma_avx512``, ``int8_vnni_avx512``."""

    cores: int
    loops: dict[str, tuple[str, float, float]]

    def best(self, prefix: str) -> tuple[str, float]:
        """The fastest all-core loop whose name starts with ``prefix``
        (``"fp32"``, ``"int8"``, ``"bf16"``): ``(name, rate)``."""
        rates = [(name, r[2]) for name, r in self.loops.items() if name.startswith(prefix)]
        if not rates:
            return ("none", float("nan"))
        return max(rates, key=lambda item: item[1])


def _fma_peak_binary() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (
        here / "fma_peak",
        Path(os.environ.get("RUNFILES_DIR", "")) / "benchmarks/fma_peak",
    ):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(
        "fma_peak: build it with the benchmark (data dependency //benchmarks:fma_peak)"
    )


def vector_peak() -> VectorPeak:
    """Runs ``fma_peak`` and returns its measured loop rates."""
    out = subprocess.run(
        [str(_fma_peak_binary())], capture_output=True, text=True, check=True, timeout=120
    )
    data = json.loads(out.stdout)
    loops = {
        name: (v["unit"], float(v["one_thread"]), float(v["all_cores"]))
        for name, v in data["loops"].items()
    }
    return VectorPeak(int(data["cores"]), loops)


def main() -> None:
    """``bazel run //benchmarks:yardstick``: print both yardsticks."""
    print(host_class_line())
    ref = sgemm_reference()
    print(
        f"numpy sgemm 2048^3: {ref.gflops:.1f} GFLOP/s with OpenBLAS core {ref.core} "
        f"(OPENBLAS_CORETYPE/L2_SIZE unset); {ref.handicapped_gflops:.1f} GFLOP/s with "
        f"core {ref.handicapped_core} under this environment"
    )
    peak = vector_peak()
    print(f"measured vector peak ({peak.cores} cores):")
    for name, (unit, one, every) in peak.loops.items():
        print(f"  {name:18s} {one:8.1f} {unit} one thread, {every:8.1f} {unit} all cores")


if __name__ == "__main__":
    main()
