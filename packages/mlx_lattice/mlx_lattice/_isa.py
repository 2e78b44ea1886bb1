"""The instruction-set cap, the micro-kernels it lets run, and the cache
size of the native CPU kernels."""

from __future__ import annotations

from mlx_lattice._errors import MlxLatticeTypeError

__all__ = [
    "get_kernel_isa",
    "get_kernel_l2_bytes",
    "get_kernel_names",
    "set_kernel_isa",
    "set_kernel_l2_bytes",
]


def set_kernel_isa(name: str | None) -> None:
    """Cap the CPU micro-kernels at instruction-set level ``name``.

    The same as the ``MLX_LATTICE_GEMM_ISA`` environment variable, from code
    and at any time: tests and benchmarks compare kernels this way. x86-64
    levels, lowest first: ``scalar``, ``avx2-fma``, ``avx-vnni``,
    ``avx512f``, ``avx512-vnni``, ``avx512-bf16``, ``amx-int8``, ``amx-bf16``
    (AArch64's are in the ARM64 guide; another architecture's names are
    unknown). Each kernel family then runs the best kernel the CPU supports
    at or below the cap. The int8 family follows a new cap at once; the
    float32 GEMM and the half-precision forward and gradients choose once
    per process, at their first use, and keep it. ``None`` returns to the
    environment variable's cap (or none). A non-empty
    ``MLX_LATTICE_GEMM_ISA`` that names no level raises
    :class:`~mlx_lattice.MlxLatticeError` when ``mlx_lattice`` is imported.

    >>> previous = get_kernel_isa()
    >>> set_kernel_isa("scalar"); get_kernel_isa()
    'scalar'
    >>> from mlx_lattice._native import ext
    >>> ext.int8_isa()
    'scalar'
    >>> set_kernel_isa(None)
    >>> set_kernel_isa("avx9")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mlx_lattice._errors.MlxLatticeError: ...unknown ISA level 'avx9'; the levels are scalar, ...
    """
    from mlx_lattice._native import ext

    if name is not None and not isinstance(name, str):
        raise MlxLatticeTypeError(
            f"set_kernel_isa: name must be a str or None, got {type(name).__name__}."
        )
    ext.set_isa_ceiling(name)


def get_kernel_isa() -> str:
    """The current instruction-set cap of the CPU micro-kernels: the last
    :func:`set_kernel_isa`, else ``MLX_LATTICE_GEMM_ISA``, else the highest
    level of the architecture (``amx-bf16`` on x86-64).

    This is a ceiling, not what runs: on a CPU without AMX, for example, the
    default cap is still ``amx-bf16`` while the kernels are AVX-512 or AVX2
    ones. :func:`get_kernel_names` names the kernels that run.

    >>> previous = get_kernel_isa()
    >>> set_kernel_isa("scalar"); get_kernel_isa()
    'scalar'
    >>> set_kernel_isa(None); get_kernel_isa() == previous
    True
    """
    from mlx_lattice._native import ext

    return str(ext.isa_ceiling())


def get_kernel_names() -> dict[str, str]:
    """The CPU micro-kernel each data type's convolutions run now, by name:
    ``{"fp32": ..., "bf16": ..., "fp16": ..., "int8": ...}``.

    Each kernel family picks the best kernel the CPU (and OS) supports at or
    below the cap (:func:`get_kernel_isa`), and each name is the one its
    dispatch picked:

    * ``fp32``: ``avx512f``, ``avx2-fma``, ``neon-fma`` or ``scalar``;
    * ``bf16`` and ``fp16``: the half-precision kernel (``amx-bf16``,
      ``avx512-bf16``, ``neon-bf16``, ``neon-fhm``), or ``float32`` where the
      data are converted to float32 and run by the ``fp32`` kernel (every
      x86 CPU for float16; Intel CPUs without AMX for bfloat16, where
      ``vdpbf16ps`` is slower than float32);
    * ``int8``: the integer kernel of int8 activations (w8a8, w4a8):
      ``amx-int8``, ``avx512-vnni``, ``avx-vnni``, ``avx2-fma``,
      ``neon-i8mm``, ``neon-dotprod`` or ``scalar`` (under ``amx-int8``,
      convolutions of at most 32 input and output channels run
      ``avx512-vnni``, which is faster there; weight-only layers run the
      float kernels).

    The int8 family follows a new cap at once. The fp32, bf16 and fp16
    families choose once per process, at their first use (or their first
    report here), and keep that kernel, so a cap set later leaves their
    names, like their kernels, as they are: to compare them, cap them with
    ``MLX_LATTICE_GEMM_ISA`` in a new process. Benchmarks print these names
    beside their figures.

    >>> sorted(get_kernel_names())
    ['bf16', 'fp16', 'fp32', 'int8']
    >>> set_kernel_isa("scalar"); get_kernel_names()["int8"]
    'scalar'
    >>> set_kernel_isa(None)
    """
    from mlx_lattice._native import ext

    return {
        "fp32": str(ext.gemm_isa()),
        "bf16": str(ext.bf16_isa()),
        "fp16": str(ext.fp16_isa()),
        "int8": str(ext.int8_isa()),
    }


def set_kernel_l2_bytes(n_bytes: int | None) -> None:
    """Size the CPU kernels' output tiles for an L2 cache of ``n_bytes``.

    The tile drivers read one core's L2 size once from the host and, where
    it is 2 MiB or more (current Xeons), grow their tiles of output rows to
    fill a share of it; smaller caches keep the sizes measured on them.
    Results do not depend on the tile size, only speed, so tests run every
    tile size on any host this way and benchmarks compare them. Takes effect
    at the next call, in every thread. ``None`` returns to the host's size.

    >>> previous = get_kernel_l2_bytes()
    >>> set_kernel_l2_bytes(4 << 20); get_kernel_l2_bytes()
    4194304
    >>> set_kernel_l2_bytes(None); get_kernel_l2_bytes() == previous
    True
    >>> set_kernel_l2_bytes(-1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mlx_lattice._errors.MlxLatticeError: ...n_bytes must be in [0, 2**40] or None, got -1.
    >>> set_kernel_l2_bytes(2**41)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mlx_lattice._errors.MlxLatticeError: ...n_bytes must be in [0, 2**40] or None, got 2199...
    """
    from mlx_lattice._errors import MlxLatticeError
    from mlx_lattice._native import ext

    if n_bytes is not None and (isinstance(n_bytes, bool) or not isinstance(n_bytes, int)):
        raise MlxLatticeTypeError(
            f"set_kernel_l2_bytes: n_bytes must be an int or None, got {type(n_bytes).__name__}."
        )
    if n_bytes is not None and not 0 <= n_bytes <= 2**40:
        raise MlxLatticeError(
            f"set_kernel_l2_bytes: n_bytes must be in [0, 2**40] or None, got {n_bytes}."
        )
    ext.set_l2_cache_bytes(n_bytes)


def get_kernel_l2_bytes() -> int:
    """The L2 size in bytes the CPU kernels size their tiles from now (the
    host's, 0 where unknown, unless :func:`set_kernel_l2_bytes` set one)."""
    from mlx_lattice._native import ext

    return int(ext.l2_cache_bytes())
