"""The instruction-set ceiling of the native CPU micro-kernels."""

from __future__ import annotations

from mlx_lattice._errors import MlxLatticeTypeError

__all__ = ["get_kernel_isa", "set_kernel_isa"]


def set_kernel_isa(name: str | None) -> None:
    """Cap the CPU micro-kernels at instruction-set level ``name``.

    The same as the ``MLX_LATTICE_GEMM_ISA`` environment variable, from code
    and at any time: tests and benchmarks compare kernels this way. x86-64
    levels, lowest first: ``scalar``, ``avx2-fma``, ``avx-vnni``,
    ``avx512f``, ``avx512-vnni``, ``avx512-bf16``, ``amx-int8``, ``amx-bf16``
    (AArch64's are in the ARM64 guide). Each kernel family then runs the
    best kernel the CPU supports at or below the cap. The int8 family
    follows a new cap at once; the float32 GEMM and the half-precision
    forward choose once per process, at their first use, and keep it. ``None`` returns to
    the environment variable's cap (or none).

    >>> previous = get_kernel_isa()
    >>> set_kernel_isa("scalar"); get_kernel_isa()
    'scalar'
    >>> from mlx_lattice._native import ext
    >>> ext.int8_isa()
    'scalar'
    >>> set_kernel_isa(None)
    >>> set_kernel_isa("avx9")
    Traceback (most recent call last):
    ...
    mlx_lattice._errors.MlxLatticeError: set_kernel_isa: unknown ISA level 'avx9'.
    """
    from mlx_lattice._native import ext

    if name is not None and not isinstance(name, str):
        raise MlxLatticeTypeError(
            f"set_kernel_isa: name must be a str or None, got {type(name).__name__}."
        )
    ext.set_isa_ceiling(name)


def get_kernel_isa() -> str:
    """The current instruction-set cap of the CPU micro-kernels (the highest
    level of the architecture when nothing caps them)."""
    from mlx_lattice._native import ext

    return str(ext.isa_ceiling())
