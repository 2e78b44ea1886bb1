"""Quantization-aware dense ops on JAX + Qwix."""

from taktiny_ops._version import __version__

__all__ = ["__version__"]
