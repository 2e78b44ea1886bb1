"""The host class of the JAX benchmarks (``tpu_matmul``, ``tpu_train``):
backend, device kind and count, the library versions, and the CPU's class
(:func:`benchmarks.host_class.host_class_line`). Defines no flags, so both
programs import it.
"""

from __future__ import annotations

import importlib.metadata
import platform

import jax

from benchmarks.host_class import host_class_line

__all__ = ["host_lines", "is_v5e"]

LIBRARIES = ("jax", "jaxlib", "flax", "qwix", "optax", "taktiny_ops")


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:  # a source checkout on sys.path
        module = __import__(name)
        return getattr(module, "__version__", "?")


def host_lines() -> list[str]:
    """Two lines: the accelerator class (backend, ``device_kind`` × count,
    machine, library versions) and the CPU's host-class line."""
    dev = jax.devices()[0]
    versions = ", ".join(f"{name} {_version(name)}" for name in LIBRARIES)
    return [
        f"host class: backend {jax.default_backend()}, device_kind {dev.device_kind!r} "
        f"x{jax.device_count()}, {platform.machine()}; {versions}",
        f"cpu: {host_class_line()}",
    ]


def is_v5e(device_kind: str) -> bool:
    """Whether JAX's ``device_kind`` names a TPU v5e (JAX calls it ``TPU v5 lite``).

    >>> is_v5e("TPU v5 lite"), is_v5e("TPU v5e"), is_v5e("TPU v4"), is_v5e("cpu")
    (True, True, False, False)
    """
    kind = device_kind.lower()
    return "v5 lite" in kind or "v5e" in kind or "v5litepod" in kind
