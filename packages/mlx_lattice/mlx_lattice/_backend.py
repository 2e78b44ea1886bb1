"""Which kernels evaluate the primitives on this machine."""

from __future__ import annotations

__all__ = ["metal_harness_enabled", "set_metal_harness"]


def set_metal_harness(enabled: bool) -> None:
    """Evaluate the primitives with their *Metal* kernels, run on the CPU.

    The MSL sources of the GPU path are compiled into the extension through
    the CPU harness (``tools/msl``); with this switch on, CPU evaluation goes
    through the GPU encode plans instead of the CPU kernels, so the Metal
    path is tested end to end on machines without an Apple GPU. It is much
    slower than the CPU kernels. ``MLX_LATTICE_METAL_HARNESS=1`` sets it at
    start-up.

    >>> set_metal_harness(True); metal_harness_enabled()
    True
    >>> set_metal_harness(False)
    """
    from mlx_lattice._native import ext

    if not isinstance(enabled, bool):
        raise TypeError(f"set_metal_harness: enabled must be a bool, got {type(enabled).__name__}.")
    ext.set_metal_harness(enabled)


def metal_harness_enabled() -> bool:
    """Whether the primitives evaluate through the Metal kernels on the CPU harness."""
    from mlx_lattice._native import ext

    return bool(ext.metal_harness_enabled())
