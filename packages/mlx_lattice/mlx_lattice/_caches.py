"""The package's caches: the dequantized weights of weight-only quantized
convolutions (bounded by a byte budget), remembered relation validations and
the Python-side weight conversions."""

from __future__ import annotations

from mlx_lattice._errors import MlxLatticeError, MlxLatticeTypeError

__all__ = ["clear_caches", "set_weight_cache_budget", "weight_cache_info"]


def clear_caches() -> None:
    """Drop every cache of the package (results never change, later calls
    recompute what they need).

    That is: the dequantized float32 weights of weight-only quantized
    convolutions (and the references they hold on the quantized buffers),
    with the counters of :func:`weight_cache_info`; the remembered
    validations of relations; the converted weight layouts and float32
    scales kept per weight value.
    """
    from mlx_lattice._native import ext
    from mlx_lattice.core import ops, quantized, weights

    ext.clear_weight_cache()
    ext.clear_validation_memo()
    weights._MAPPED_WEIGHT_CACHE.clear()
    ops._PADDED_WEIGHT_CACHE.clear()
    quantized._FLOAT32_SCALES_CACHE.clear()


def set_weight_cache_budget(nbytes: int) -> None:
    """Bound the dequantized-weight cache to ``nbytes`` bytes (``0`` turns it off).

    A weight-only quantized convolution (``act_bits=None``) caches the
    float32 values of its weight (``K * Cin * Cout * 4`` bytes) on the
    weight's second call and keeps them, with references to the packed
    codes, scales and biases, for later calls; an entry is charged those float32 bytes plus the
    quantized buffers' bytes, and the least recently used entries are
    dropped beyond the budget. The default is 256 MiB, or
    ``MLX_LATTICE_WEIGHT_CACHE_MB`` MiB when that is set (a decimal integer
    in [0, 2**40]; any other non-empty value raises :class:`~mlx_lattice.MlxLatticeError`
    when ``mlx_lattice`` is imported).

    >>> info = weight_cache_info()
    >>> set_weight_cache_budget(64 << 20); weight_cache_info()["budget"]
    67108864
    >>> set_weight_cache_budget(info["budget"])
    >>> set_weight_cache_budget(-1)
    Traceback (most recent call last):
    ...
    mlx_lattice._errors.MlxLatticeError: set_weight_cache_budget: nbytes must be >= 0, got -1.
    """
    from mlx_lattice._native import ext

    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise MlxLatticeTypeError(
            f"set_weight_cache_budget: nbytes must be an int, got {type(nbytes).__name__}."
        )
    if nbytes < 0:
        raise MlxLatticeError(f"set_weight_cache_budget: nbytes must be >= 0, got {nbytes}.")
    ext.set_weight_cache_budget(nbytes)


def weight_cache_info() -> dict[str, int]:
    """The dequantized-weight cache: ``entries``, ``bytes`` charged,
    ``budget`` (bytes), and since the last :func:`clear_caches` its
    ``hits``, ``misses`` and ``evictions``."""
    from mlx_lattice._native import ext

    return {str(k): int(v) for k, v in ext.weight_cache_info().items()}
