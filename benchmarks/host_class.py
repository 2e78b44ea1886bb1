"""The host class a benchmark's figures belong to: CPU vendor and model and
the instruction-set flags that decide which kernels can run (AVX-512, VNNI,
BF16, FP16, AMX).

Every benchmark prints :func:`host_class_line` as its first line, so a
figure copied from its output carries the class of machine it was measured
on (AMD EPYC hosts without AMX and Intel hosts with AMX give different
ratios and are reported apart in ``benchmarks/LOG.md``); the convolution
benchmarks add the micro-kernels that run (:func:`kernel_names`).

>>> info = HostClass("GenuineIntel", "Xeon", ("avx512f", "amx_tile", "sse2"))
>>> for part in info.line().split("; "):
...     print(part)
host class: GenuineIntel Xeon
flags avx512f amx_tile
no avx_vnni avx512_vnni avx512_bf16 avx512_fp16 amx_int8 amx_bf16
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FLAGS",
    "HostClass",
    "host_class",
    "host_class_line",
    "kernel_names",
    "print_targets",
]

# The flags that decide which micro-kernels a host can run, in print order.
FLAGS = (
    "avx2",
    "fma",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "amx_fp16",
)
# Flags whose absence is named too (the ones the x86 kernels branch on).
_NAMED_ABSENT = (
    "avx_vnni",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


@dataclass(frozen=True)
class HostClass:
    """CPU vendor, model name and the flags the kernels branch on."""

    vendor: str
    model: str
    flags: tuple[str, ...]

    def line(self) -> str:
        """One line: ``host class: <vendor> <model>; flags ...; no ...``."""
        have = [f for f in FLAGS if f in self.flags]
        missing = [f for f in _NAMED_ABSENT if f not in self.flags]
        text = f"host class: {self.vendor} {self.model}; flags {' '.join(have) or 'none'}"
        return text + (f"; no {' '.join(missing)}" if missing else "")


def host_class(cpuinfo: str | None = None) -> HostClass:
    """The host class from ``/proc/cpuinfo`` (or the text given); on systems
    without it, the platform's machine and processor names and no flags.

    >>> host_class("vendor_id : AuthenticAMD\\nmodel name : EPYC\\nflags : fpu avx512f").flags
    ('fpu', 'avx512f')
    """
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(errors="replace") if path.exists() else ""
    fields: dict[str, str] = {}
    for raw in cpuinfo.splitlines():
        if not raw.strip():
            if fields:
                break  # the first processor describes the host
            continue
        key, _, value = raw.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if not fields:
        return HostClass(platform.system(), platform.machine() or platform.processor(), ())
    vendor = fields.get("vendor_id", fields.get("CPU implementer", platform.machine()))
    model = fields.get("model name", fields.get("Model", platform.processor() or "unknown"))
    flags = tuple(fields.get("flags", fields.get("Features", "")).split())
    return HostClass(vendor, f"{model} ({os.cpu_count()} cores)", flags)


def host_class_line(kernels: str | None = None) -> str:
    """:meth:`HostClass.line` of this host, with ``; kernels <kernels>``
    after it when given (see :func:`kernel_names`)."""
    line = host_class().line()
    return f"{line}; kernels {kernels}" if kernels else line


def kernel_names(ext: Any) -> str:
    """The CPU micro-kernels ``mlx_lattice``'s extension ``ext`` runs, per
    dtype (each family picks once per process, or per call for int8 under
    a changed cap, so the names hold for the run).

    >>> class Ext:
    ...     gemm_isa = staticmethod(lambda: "avx512f")
    ...     int8_isa = staticmethod(lambda: "amx-int8")
    ...     bf16_isa = staticmethod(lambda: "amx-bf16")
    ...     fp16_isa = staticmethod(lambda: "float32")
    >>> kernel_names(Ext)
    'fp32 avx512f, int8 amx-int8, bf16 amx-bf16, fp16 float32'
    """
    return (
        f"fp32 {ext.gemm_isa()}, int8 {ext.int8_isa()}, bf16 {ext.bf16_isa()}, "
        f"fp16 {ext.fp16_isa()}"
    )


def print_targets(heading: str, sections: dict[str, list[tuple[str, float, str, float]]]) -> None:
    """Prints an issue's target lines for this host under ``heading``: per
    section, each ``(name, value, ">=" or "<=", target)`` with its verdict.

    >>> print_targets("targets:", {"C64": [("fp32 / sgemm", 0.83, ">=", 0.8)],
    ...                            "share": [("relations", 0.17, "<=", 0.15)]})
    targets:
      C64:
        fp32 / sgemm                0.830  target >= 0.80  met
      share:
        relations                   0.170  target <= 0.15  above
    """
    print(heading)
    for title, rows in sections.items():
        print(f"  {title}:")
        for name, value, sense, target in rows:
            met = value >= target if sense == ">=" else value <= target
            verdict = "met" if met else ("below" if sense == ">=" else "above")
            print(f"    {name:<26}{value:>7.3f}  target {sense} {target:.2f}  {verdict}")


if __name__ == "__main__":
    print(host_class_line())
