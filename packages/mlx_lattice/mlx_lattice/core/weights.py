"""The one weight-layout conversion: ``(Cout, kx, ky, kz, Cin)`` -> ``(K, Cin, Cout)``.

The native ops take the mapped ``(K, Cin, Cout)`` layout only. The
conversion of a 5-D weight is cached per weight *value*: an array updated in
place, or a new array at a reused ``id``, never gets a stale entry, and a
dead weight is never kept alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import mlx.core as mx

from mlx_lattice._errors import MlxLatticeError
from mlx_lattice._native import ext

__all__ = ["cached_per_value", "mapped_conv_weight"]

# Cache entries: id(weight) -> (weakref to the weight, handle on the value it
# had, derived array). The value handle makes in-place updates miss the cache.
_CacheEntry = tuple[weakref.ReferenceType[mx.array], mx.array, mx.array]
_MAPPED_WEIGHT_CACHE: dict[int, _CacheEntry] = {}


def cached_per_value(
    cache: dict[int, _CacheEntry], weight: mx.array, derive: Callable[[mx.array], mx.array]
) -> mx.array:
    """``derive(weight)``, remembered in ``cache`` while ``weight`` keeps its value."""
    key = id(weight)
    entry = cache.get(key)
    if entry is not None:
        ref, value, derived = entry
        if ref() is weight and ext.same_value(value, weight):
            return derived
    derived = derive(weight)
    # Evaluated before it is shared: another thread cannot evaluate a lazy
    # array built on this thread's stream (MLX raises "There is no Stream(cpu,
    # N) in current thread"), and two threads evaluating one lazy node race.
    # A placeholder of a transformation being traced stays lazy (it cannot be
    # evaluated, and its entry dies with it).
    if not ext.is_tracer(derived):
        mx.eval(derived)

    def forget(dead: weakref.ReferenceType[mx.array], key: int = key) -> None:
        current = cache.get(key)
        if current is not None and current[0] is dead:
            cache.pop(key, None)

    cache[key] = (weakref.ref(weight, forget), ext.array_value(weight), derived)
    return derived


def _map(weight: mx.array) -> mx.array:
    out_channels, in_channels = int(weight.shape[0]), int(weight.shape[4])
    return mx.contiguous(weight.transpose(1, 2, 3, 4, 0).reshape((-1, in_channels, out_channels)))


def mapped_conv_weight(weight: mx.array, *, cache: bool = True) -> mx.array:
    """``(Cout, kx, ky, kz, Cin)`` -> contiguous ``(K, Cin, Cout)``; 3-D passes through.

    ``cache=False`` converts without remembering (for weights that are
    transformed values, such as a quantizer's input).

    >>> mapped_conv_weight(mx.zeros((8, 3, 3, 3, 4))).shape
    (27, 4, 8)
    >>> mapped_conv_weight(mx.zeros((2, 3))).shape
    Traceback (most recent call last):
    ...
    mlx_lattice._errors.MlxLatticeError: weight must be (K, Cin, Cout) or (Cout, kx, ky, kz, Cin), got shape (2, 3).
    """
    if weight.ndim == 3:
        return weight
    if weight.ndim != 5:
        raise MlxLatticeError(
            "weight must be (K, Cin, Cout) or (Cout, kx, ky, kz, Cin), got shape "
            f"{tuple(weight.shape)}."
        )
    return cached_per_value(_MAPPED_WEIGHT_CACHE, weight, _map) if cache else _map(weight)
