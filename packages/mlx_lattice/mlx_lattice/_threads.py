"""Thread count of the native CPU kernels."""

from __future__ import annotations

from mlx_lattice._errors import MlxLatticeTypeError

__all__ = ["get_num_threads", "set_num_threads"]


def set_num_threads(n: int) -> None:
    """Use ``n`` threads (>= 1) in the CPU kernels.

    The default is the ``MLX_LATTICE_NUM_THREADS`` environment variable when it
    is set (an integer in [1, 1024]; any other non-empty value raises
    :class:`~mlx_lattice.MlxLatticeError` when ``mlx_lattice`` is imported),
    else the CPUs the process may run on (its affinity mask on Linux, as a
    container's CPU set or ``taskset`` limits it; at most 1024). Results are
    bitwise identical for every thread count.

    >>> previous = get_num_threads()
    >>> set_num_threads(1); get_num_threads()
    1
    >>> set_num_threads(previous)
    >>> set_num_threads(0)
    Traceback (most recent call last):
    ...
    mlx_lattice._errors.MlxLatticeError: set_num_threads: n must be in [1, 1024], got 0.
    """
    from mlx_lattice._native import ext

    if isinstance(n, bool) or not isinstance(n, int):
        raise MlxLatticeTypeError(f"set_num_threads: n must be an int, got {type(n).__name__}.")
    ext.set_num_threads(n)


def get_num_threads() -> int:
    """Threads the CPU kernels use."""
    from mlx_lattice._native import ext

    return int(ext.get_num_threads())
