"""Functional sparse ops on :class:`~mlx_lattice.tensor.SparseTensor`.

Convolution weights are ``(Cout, kx, ky, kz, Cin)`` (MLX's ``conv3d``
layout) or quantized (:class:`~mlx_lattice.core.quantized.QuantizedWeight`);
the kernel size is read from the weight. Relations come from the input's
coordinate manager, so layers at one level share them. Convolutions take
``padding`` (moves the window as in a dense convolution) and
``coordinates=`` (an explicit output support); pooling takes padding and
dilation; upsampling, global pooling and the feature layers (activations,
norms, dropout, linear) work on the features. Half-precision activations are
computed in float32 and cast back (faster with MLX's CPU ops, measured).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import mlx.core as mx
import mlx.nn as mlx_nn
import numpy as np

from mlx_lattice._native import ext
from mlx_lattice.core import ops as core_ops
from mlx_lattice.core.coordinates import check_coordinates
from mlx_lattice.core.quantized import QuantizedWeight
from mlx_lattice.core.relations import (
    KernelRelation,
    build_kernel_relation,
    kernel_offsets,
    normalize_triple,
)
from mlx_lattice.tensor import CoordinateKey, SparseTensor, SparseTensorError

__all__ = [
    "Coordinates",
    "Padding",
    "add",
    "apply",
    "avg_pool3d",
    "cat",
    "conv3d",
    "conv_transpose3d",
    "dropout",
    "gelu",
    "generative_conv_transpose3d",
    "global_avg_pool",
    "global_max_pool",
    "global_sum_pool",
    "layer_norm",
    "leaky_relu",
    "linear",
    "max_pool3d",
    "mul",
    "normalized_conv3d",
    "normalized_conv_transpose3d",
    "normalized_generative_conv_transpose3d",
    "normalized_subm_conv3d",
    "pointwise_relation",
    "pool3d",
    "pool_transpose3d",
    "prune",
    "relu",
    "rms_norm",
    "sigmoid",
    "silu",
    "softplus",
    "subm_conv3d",
    "sum_pool3d",
    "tanh",
    "trilinear_upsample3d",
]

Weight = mx.array | QuantizedWeight


def _kernel_size(weight: Weight, kernel_size: int | Sequence[int] | None) -> tuple[int, int, int]:
    if isinstance(weight, QuantizedWeight):
        if kernel_size is None:
            k = round(weight.n_kernels ** (1 / 3))
            if k**3 != weight.n_kernels:
                raise SparseTensorError(
                    "pass kernel_size for a quantized weight with an anisotropic kernel."
                )
            return (k, k, k)
        size = normalize_triple(kernel_size, "kernel_size", high=7)
        if size[0] * size[1] * size[2] != weight.n_kernels:
            raise SparseTensorError(
                f"kernel_size {size} does not match the weight's {weight.n_kernels} offsets."
            )
        return size
    if weight.ndim != 5:
        raise SparseTensorError(
            f"weight must be (Cout, kx, ky, kz, Cin), got shape {tuple(weight.shape)}."
        )
    return tuple(int(d) for d in weight.shape[1:4])  # type: ignore[return-value]


def _in_channels(weight: Weight) -> int:
    return weight.in_channels if isinstance(weight, QuantizedWeight) else int(weight.shape[4])


#: Convolution padding: ``None`` centres odd kernels (``(k - 1) // 2 * dilation``
#: per axis, even kernels lean forward), or explicit non-negative ints.
Padding = int | Sequence[int] | None
#: An explicit output support: a tensor, a key of ``x``'s manager, or ``(N, 4)`` coordinates.
Coordinates = SparseTensor | CoordinateKey | mx.array | np.ndarray

Triple = tuple[int, int, int]


def _conv_features(x: SparseTensor, weight: Weight, rel: KernelRelation) -> mx.array:
    if x.num_channels != _in_channels(weight):
        raise SparseTensorError(
            f"x has {x.num_channels} channels but the weight expects {_in_channels(weight)}."
        )
    if isinstance(weight, QuantizedWeight):
        return core_ops.sparse_quantized_conv_features_from_relation(x.feats, weight, rel)
    return core_ops.sparse_conv_features_from_relation(x.feats, weight, rel)


def _normalized_features(
    x: SparseTensor, weight: Weight, rel: KernelRelation, eps: float
) -> mx.array:
    if isinstance(weight, QuantizedWeight):
        raise SparseTensorError("weight-normalized convolutions take float weights, not quantized.")
    if not eps >= 0:
        raise SparseTensorError(f"eps must be >= 0, got {eps!r}.")
    num = _conv_features(x, weight, rel)
    ones = mx.ones(x.feats.shape, dtype=x.dtype)
    squared = weight * weight
    den = core_ops.sparse_conv_normalization_denominator_from_relation(ones, squared, rel)
    if den is None:
        den = core_ops.sparse_conv_features_from_relation(ones, squared, rel)
    return num / mx.sqrt(den.astype(mx.float32) + eps).astype(num.dtype)


def _finish(
    x: SparseTensor, feats: mx.array, bias: mx.array | None, out_key: CoordinateKey
) -> SparseTensor:
    if bias is not None:
        feats = feats + bias.astype(feats.dtype)
    return x.at(out_key, feats)


def _window_shift(
    padding: Padding, size: Triple, dilation: Triple, tensor_stride: Triple
) -> Triple:
    """How far an explicit ``padding`` moves the kernel window from the default centring."""
    if padding is None:
        return (0, 0, 0)
    pad = normalize_triple(padding, "padding", low=0)
    return tuple(  # type: ignore[return-value]
        (((k - 1) // 2) * d - p) * t
        for k, d, p, t in zip(size, dilation, pad, tensor_stride, strict=True)
    )


def _negated(t: Triple) -> Triple:
    return (-t[0], -t[1], -t[2])


def _output_key(x: SparseTensor, coordinates: Coordinates, tensor_stride: Triple) -> CoordinateKey:
    """Resolve ``coordinates=`` to a key of ``x.manager`` at ``tensor_stride``."""
    m = x.manager
    if isinstance(coordinates, SparseTensor):
        if coordinates.tensor_stride != tensor_stride:
            raise SparseTensorError(
                f"coordinates has tensor stride {coordinates.tensor_stride}; this layer's outputs "
                f"are at {tensor_stride}."
            )
        if coordinates.manager is m:
            return coordinates.coordinate_key
        arr = coordinates.coords
        # Registered arrays stay alive in the manager, so their id is a stable key.
        return m.derived(("coordinates", id(arr)), tensor_stride, lambda: (arr, tensor_stride))
    if isinstance(coordinates, tuple):
        if not m.has(coordinates):  # type: ignore[arg-type]
            raise SparseTensorError(
                f"coordinates: no coordinate set {coordinates!r} in x's manager."
            )
        if tuple(coordinates[0]) != tensor_stride:
            raise SparseTensorError(
                f"coordinates key {coordinates!r} is at tensor stride {coordinates[0]}; this "
                f"layer's outputs are at {tensor_stride}."
            )
        return coordinates  # type: ignore[return-value]
    if isinstance(coordinates, mx.array | np.ndarray):
        arr = check_coordinates(coordinates, "coordinates")
        c = np.array(arr)
        if c.size and (np.any(c[:, 1:] % np.array(tensor_stride)) or c[:, 0].min() < 0):
            raise SparseTensorError(
                f"coordinates must be (batch >= 0, x, y, z) rows with x, y, z multiples of the "
                f"output tensor stride {tensor_stride}."
            )
        return m.register(arr, tensor_stride, m.new_tag())
    raise SparseTensorError(
        "coordinates must be a SparseTensor, a coordinate key or an (N, 4) array, got "
        f"{type(coordinates).__name__}."
    )


def _forward_relation(
    x: SparseTensor,
    size: Triple,
    stride: int | Sequence[int],
    padding: Padding,
    dilation: int | Sequence[int],
    coordinates: Coordinates | None,
) -> tuple[KernelRelation, CoordinateKey]:
    strides = normalize_triple(stride, "stride")
    dil = normalize_triple(dilation, "dilation")
    out_stride = tuple(t * s for t, s in zip(x.tensor_stride, strides, strict=True))
    out_key = None if coordinates is None else _output_key(x, coordinates, out_stride)  # type: ignore[arg-type]
    shift = _negated(_window_shift(padding, size, dil, x.tensor_stride))
    return x.manager.relation(
        x.coordinate_key,
        out_key,
        kernel_size=size,
        stride=strides,
        dilation=dil,
        kind="forward",
        shift=shift,
    )


def _transpose_relation(
    x: SparseTensor,
    size: Triple,
    stride: int | Sequence[int],
    padding: Padding,
    dilation: int | Sequence[int],
    coordinates: Coordinates | None,
) -> tuple[KernelRelation, CoordinateKey]:
    dil = normalize_triple(dilation, "dilation")
    fine = _finer_stride(x, normalize_triple(stride, "stride"))
    if coordinates is None:
        out_key: CoordinateKey = (fine, x.coordinate_key[1])
        if not x.manager.has(out_key):
            raise SparseTensorError(
                f"no coordinates at tensor stride {fine} to transpose onto; run the matching "
                "strided conv3d first, pass coordinates=, or use generative_conv_transpose3d."
            )
    else:
        out_key = _output_key(x, coordinates, fine)
    shift = _window_shift(padding, size, dil, fine)
    rel, _ = x.manager.relation(
        x.coordinate_key, out_key, kernel_size=size, dilation=dil, kind="target", shift=shift
    )
    return rel, out_key


def _generative_relation(
    x: SparseTensor,
    size: Triple,
    stride: int | Sequence[int],
    padding: Padding,
    dilation: int | Sequence[int],
    coordinates: Coordinates | None,
) -> tuple[KernelRelation, CoordinateKey]:
    if coordinates is not None:
        return _transpose_relation(x, size, stride, padding, dilation, coordinates)
    dil = normalize_triple(dilation, "dilation")
    fine = _finer_stride(x, normalize_triple(stride, "stride"))
    shift = _window_shift(padding, size, dil, fine)

    def make() -> tuple[mx.array, Triple]:
        offsets = kernel_offsets(size, dil, fine) + np.asarray(shift, np.int64)
        return _grown(x.coords, offsets), fine

    out_key = x.manager.derived(x.coordinate_key, ("generative", size, dil, fine, shift), make)
    rel, _ = x.manager.relation(
        x.coordinate_key, out_key, kernel_size=size, dilation=dil, kind="target", shift=shift
    )
    return rel, out_key


def _relation_for(
    kind: str,
    size: Triple,
    stride: int | Sequence[int] = 1,
    padding: Padding = None,
    dilation: int | Sequence[int] = 1,
    coordinates: Coordinates | None = None,
) -> Callable[[SparseTensor], tuple[KernelRelation, CoordinateKey]]:
    """The relation a convolution of ``kind`` (``"subm"``, ``"conv"``,
    ``"transpose"`` or ``"generative"``) runs on, chosen once: the returned
    function looks it up (or builds it) for an input, with its output key.
    A ``"conv"`` of stride 1 with a centred window and no given outputs is
    submanifold."""
    if kind == "subm" or (
        kind == "conv"
        and normalize_triple(stride, "stride") == (1, 1, 1)
        and padding is None
        and coordinates is None
    ):
        return lambda x: x.manager.relation(
            x.coordinate_key, kernel_size=size, dilation=dilation, kind="submanifold"
        )
    build = {
        "conv": _forward_relation,
        "transpose": _transpose_relation,
        "generative": _generative_relation,
    }[kind]
    return lambda x: build(x, size, stride, padding, dilation, coordinates)


def _grown(coords: mx.array, offsets: np.ndarray) -> mx.array:
    """Every row of ``coords`` moved by every offset, unique and sorted."""
    c = np.array(coords).astype(np.int64)
    grown = c[:, None, 1:] + offsets[None]
    rows = np.concatenate([np.repeat(c[:, :1], len(offsets), axis=0), grown.reshape(-1, 3)], axis=1)
    rows = np.unique(rows, axis=0)
    if rows.size and (rows.min() < -(2**31) or rows.max() >= 2**31):
        raise SparseTensorError("generated coordinates leave the int32 range.")
    return mx.array(rows.astype(np.int32).reshape(-1, 4))


def conv3d(
    x: SparseTensor,
    weight: Weight,
    bias: mx.array | None = None,
    *,
    stride: int | Sequence[int] = 1,
    padding: Padding = None,
    dilation: int | Sequence[int] = 1,
    kernel_size: int | Sequence[int] | None = None,
    coordinates: Coordinates | None = None,
) -> SparseTensor:
    """Sparse 3-D convolution.

    ``out[q] = sum_i x[q + (i * dilation - padding) * x.tensor_stride] @ W_i (+ bias)``
    per axis, for kernel index ``i``. ``padding=None`` centres the window
    (``(k - 1) // 2 * dilation``, as :func:`subm_conv3d`); an explicit
    ``padding`` moves the window exactly as in a dense convolution, not the
    output support. The outputs are ``coordinates`` when given (a tensor, a
    key of ``x.manager`` or an ``(N, 4)`` array at tensor stride
    ``x.tensor_stride * stride``); otherwise with ``stride`` 1 the input
    coordinates, and else the input coordinates floored to the coarser grid.

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32), mx.ones((2, 4)))
    >>> y = conv3d(x, mx.ones((8, 2, 2, 2, 4)), stride=2)
    >>> y.coords.tolist(), y.tensor_stride, y.feats[0, 0].item()
    ([[0, 0, 0, 0]], (2, 2, 2), 8.0)
    >>> conv3d(x, mx.ones((1, 3, 1, 1, 4)), padding=0).feats[:, 0].tolist()  # window q .. q + 2
    [8.0, 4.0]
    """
    size = _kernel_size(weight, kernel_size)
    rel, out_key = _relation_for("conv", size, stride, padding, dilation, coordinates)(x)
    return _finish(x, _conv_features(x, weight, rel), bias, out_key)


def subm_conv3d(
    x: SparseTensor,
    weight: Weight,
    bias: mx.array | None = None,
    *,
    dilation: int | Sequence[int] = 1,
    kernel_size: int | Sequence[int] | None = None,
) -> SparseTensor:
    """Submanifold convolution: outputs exactly at the input coordinates, centred window."""
    size = _kernel_size(weight, kernel_size)
    rel, out_key = _relation_for("subm", size, dilation=dilation)(x)
    return _finish(x, _conv_features(x, weight, rel), bias, out_key)


def _finer_stride(x: SparseTensor, stride: Triple) -> Triple:
    if any(t % s for t, s in zip(x.tensor_stride, stride, strict=True)):
        raise SparseTensorError(
            f"a transposed convolution with stride {stride} needs a tensor stride divisible by it; "
            f"x has tensor stride {x.tensor_stride}."
        )
    return tuple(t // s for t, s in zip(x.tensor_stride, stride, strict=True))  # type: ignore[return-value]


def conv_transpose3d(
    x: SparseTensor,
    weight: Weight,
    bias: mx.array | None = None,
    *,
    stride: int | Sequence[int] = 2,
    padding: Padding = None,
    dilation: int | Sequence[int] = 1,
    kernel_size: int | Sequence[int] | None = None,
    coordinates: Coordinates | None = None,
) -> SparseTensor:
    """Transposed convolution to the finer grid ``t = x.tensor_stride / stride``:
    ``out[p] = sum_i x[p - (i * dilation - padding) * t] @ W_i (+ bias)``, the
    adjoint of :func:`conv3d` with the same geometry.

    Outputs are ``coordinates`` when given, else the finer coordinates the
    manager already holds (those a strided :func:`conv3d` came from).
    """
    size = _kernel_size(weight, kernel_size)
    rel, out_key = _relation_for("transpose", size, stride, padding, dilation, coordinates)(x)
    return _finish(x, _conv_features(x, weight, rel), bias, out_key)


def generative_conv_transpose3d(
    x: SparseTensor,
    weight: Weight,
    bias: mx.array | None = None,
    *,
    stride: int | Sequence[int] = 2,
    padding: Padding = None,
    dilation: int | Sequence[int] = 1,
    kernel_size: int | Sequence[int] | None = None,
    coordinates: Coordinates | None = None,
) -> SparseTensor:
    """Transposed convolution that creates its outputs: every
    ``p + (i * dilation - padding) * t`` for input ``p`` and kernel index
    ``i`` at the finer stride ``t`` (the set is cached per input set and
    geometry). With ``coordinates`` it is :func:`conv_transpose3d` onto them.

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0]], dtype=mx.int32), mx.ones((1, 1)), tensor_stride=2)
    >>> generative_conv_transpose3d(x, mx.ones((1, 2, 1, 1, 1))).coords.tolist()
    [[0, 0, 0, 0], [0, 1, 0, 0]]
    """
    size = _kernel_size(weight, kernel_size)
    rel, out_key = _relation_for("generative", size, stride, padding, dilation, coordinates)(x)
    return _finish(x, _conv_features(x, weight, rel), bias, out_key)


# -- weight-normalized convolutions ------------------------------------------------------------


def normalized_subm_conv3d(
    x: SparseTensor,
    weight: mx.array,
    bias: mx.array | None = None,
    *,
    dilation: int | Sequence[int] = 1,
    eps: float = 1e-6,
) -> SparseTensor:
    """Submanifold convolution normalized by the weight energy each output sees.

    ``out[o] = (sum_k x[o + offset(k)] @ W_k) / sqrt(sum_k 1 @ (W_k * W_k) + eps) (+ bias)``
    with both sums over the offsets present at ``o``: an output with few
    neighbours is not attenuated against a dense one. ``eps`` (default
    ``1e-6``) keeps an output whose present weights are all zero finite (it
    is then 0). The denominator is the convolution of all-ones features with
    the squared weight (the specialised float16 reduction when it applies).
    """
    size = _kernel_size(weight, None)
    rel, out_key = _relation_for("subm", size, dilation=dilation)(x)
    return _finish(x, _normalized_features(x, weight, rel, eps), bias, out_key)


#: The earlier name of :func:`normalized_subm_conv3d`.
normalized_conv3d = normalized_subm_conv3d


def normalized_conv_transpose3d(
    x: SparseTensor,
    weight: mx.array,
    bias: mx.array | None = None,
    *,
    stride: int | Sequence[int] = 2,
    padding: Padding = None,
    dilation: int | Sequence[int] = 1,
    coordinates: Coordinates | None = None,
    eps: float = 1e-6,
) -> SparseTensor:
    """:func:`conv_transpose3d` divided per output by ``sqrt(sum_k 1 @ (W_k * W_k) + eps)``
    over the edges present at that output (``eps`` default ``1e-6``)."""
    size = _kernel_size(weight, None)
    rel, out_key = _relation_for("transpose", size, stride, padding, dilation, coordinates)(x)
    return _finish(x, _normalized_features(x, weight, rel, eps), bias, out_key)


def normalized_generative_conv_transpose3d(
    x: SparseTensor,
    weight: mx.array,
    bias: mx.array | None = None,
    *,
    stride: int | Sequence[int] = 2,
    padding: Padding = None,
    dilation: int | Sequence[int] = 1,
    coordinates: Coordinates | None = None,
    eps: float = 1e-6,
) -> SparseTensor:
    """:func:`generative_conv_transpose3d` normalized like
    :func:`normalized_conv_transpose3d` (``eps`` default ``1e-6``)."""
    size = _kernel_size(weight, None)
    rel, out_key = _relation_for("generative", size, stride, padding, dilation, coordinates)(x)
    return _finish(x, _normalized_features(x, weight, rel, eps), bias, out_key)


# -- pooling and upsampling ----------------------------------------------------------------------

_POOL_MODES = ("max", "avg", "sum")


def pool3d(
    x: SparseTensor,
    kernel_size: int | Sequence[int] = 2,
    stride: int | Sequence[int] = 2,
    *,
    padding: Padding = None,
    dilation: int | Sequence[int] = 1,
    mode: Literal["max", "avg", "sum"] = "max",
) -> SparseTensor:
    """Local pooling over the present inputs of each output's window.

    The window and output support are those of :func:`conv3d` with the same
    ``kernel_size``, ``stride``, ``padding`` and ``dilation``. ``max`` and
    ``avg`` reduce over the inputs present in the window; an output whose
    window holds none (possible with ``padding``) gets 0.

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32), mx.array([[1.0], [3.0]]))
    >>> pool3d(x, 2, 2, mode="avg").feats.tolist()
    [[2.0]]
    """
    if mode not in _POOL_MODES:
        raise SparseTensorError(f"mode must be one of {_POOL_MODES}, got {mode!r}.")
    size = normalize_triple(kernel_size, "kernel_size", high=7)
    strides = normalize_triple(stride, "stride")
    dil = normalize_triple(dilation, "dilation")
    rel, out_key = _forward_relation(x, size, strides, padding, dil, None)
    exclusive = size == strides and dil == (1, 1, 1) and padding is None
    feats = core_ops.sparse_pool_features_from_relation(
        x.feats, rel, input_exclusive=exclusive, mode=mode
    )
    return x.at(out_key, feats)


def max_pool3d(
    x: SparseTensor,
    kernel_size: int | Sequence[int] = 2,
    stride: int | Sequence[int] = 2,
    *,
    padding: Padding = None,
    dilation: int | Sequence[int] = 1,
) -> SparseTensor:
    """Max over the present inputs of each output's window (:func:`pool3d`)."""
    return pool3d(x, kernel_size, stride, padding=padding, dilation=dilation, mode="max")


def avg_pool3d(
    x: SparseTensor,
    kernel_size: int | Sequence[int] = 2,
    stride: int | Sequence[int] = 2,
    *,
    padding: Padding = None,
    dilation: int | Sequence[int] = 1,
) -> SparseTensor:
    """Mean over the present inputs of each output's window (:func:`pool3d`)."""
    return pool3d(x, kernel_size, stride, padding=padding, dilation=dilation, mode="avg")


def sum_pool3d(
    x: SparseTensor,
    kernel_size: int | Sequence[int] = 2,
    stride: int | Sequence[int] = 2,
    *,
    padding: Padding = None,
    dilation: int | Sequence[int] = 1,
) -> SparseTensor:
    """Sum over the present inputs of each output's window (:func:`pool3d`)."""
    return pool3d(x, kernel_size, stride, padding=padding, dilation=dilation, mode="sum")


def pool_transpose3d(
    x: SparseTensor,
    kernel_size: int | Sequence[int] = 2,
    stride: int | Sequence[int] = 2,
    *,
    padding: Padding = None,
    dilation: int | Sequence[int] = 1,
    coordinates: Coordinates | None = None,
    mode: Literal["max", "avg", "sum"] = "sum",
) -> SparseTensor:
    """Unpooling to the finer grid: each output reduces (``mode``, default the
    sum, the adjoint of ``sum`` pooling) the coarse inputs whose window holds
    it; outputs with none get 0. Outputs as in :func:`conv_transpose3d`
    (``coordinates``, else the finer set the manager holds). With
    ``kernel_size == stride`` every fine point gets its coarse parent's features.
    """
    if mode not in _POOL_MODES:
        raise SparseTensorError(f"mode must be one of {_POOL_MODES}, got {mode!r}.")
    size = normalize_triple(kernel_size, "kernel_size", high=7)
    rel, out_key = _transpose_relation(x, size, stride, padding, dilation, coordinates)
    feats = core_ops.sparse_pool_features_from_relation(
        x.feats, rel, input_exclusive=False, mode=mode
    )
    return x.at(out_key, feats)


def _lookup_rows(table: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Row of each query in ``table`` (unique ``(N, 4)`` rows), or -1."""
    if len(table) == 0 or len(queries) == 0:
        return np.full(len(queries), -1, np.int64)
    both = np.concatenate([table, queries]).astype(np.int64)
    _, inverse = np.unique(both, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    row_of = np.full(int(inverse.max()) + 1, -1, np.int64)
    row_of[inverse[: len(table)]] = np.arange(len(table))
    return row_of[inverse[len(table) :]]


def _trilinear_map(
    coarse: np.ndarray, coarse_stride: Triple, fine: np.ndarray, fine_stride: Triple
) -> tuple[mx.array, mx.array]:
    """``(M, 8)`` corner rows (absent: 0) and renormalized weights (absent: 0)."""
    big = np.asarray(coarse_stride, np.float64)
    small = np.asarray(fine_stride, np.float64)
    centre = fine[:, 1:].astype(np.float64) + small / 2
    g = (centre - big / 2) / big
    base = np.floor(g)
    frac = g - base
    rows = np.empty((len(fine), 8), np.int64)
    weights = np.empty((len(fine), 8), np.float64)
    for corner in range(8):
        bits = np.array([(corner >> 2) & 1, (corner >> 1) & 1, corner & 1])
        cell = (base + bits) * big
        query = np.concatenate([fine[:, :1], cell.astype(np.int64)], axis=1)
        rows[:, corner] = _lookup_rows(coarse, query)
        weights[:, corner] = np.prod(np.where(bits == 1, frac, 1.0 - frac), axis=1)
    weights[rows < 0] = 0.0
    total = weights.sum(axis=1, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
    rows[rows < 0] = 0
    return mx.array(rows.astype(np.int32)), mx.array(weights.astype(np.float32))


def trilinear_upsample3d(
    x: SparseTensor,
    target: SparseTensor | CoordinateKey | None = None,
    *,
    stride: int | Sequence[int] | None = None,
) -> SparseTensor:
    """Trilinear interpolation of ``x``'s features onto finer coordinates.

    Onto ``target`` (a tensor or a key of ``x.manager`` at a tensor stride
    dividing ``x``'s), or by ``stride``: onto every fine cell of each input
    voxel's block (``x.tensor_stride / stride`` spacing). A voxel with
    coordinate ``c`` at tensor stride ``t`` is centred at ``c + t / 2``; an
    output takes the 8 coarse centres around it with trilinear weights. Absent
    corners are dropped and the remaining weights renormalized (an output with
    no present corner gets 0), so on a full grid this is exactly trilinear
    interpolation. Implemented with MLX gathers: differentiable in the features.

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0], [0, 2, 0, 0]], dtype=mx.int32),
    ...                  mx.array([[0.0], [4.0]]), tensor_stride=2)
    >>> trilinear_upsample3d(x, stride=2).feats[:, 0].tolist()[::4]  # x = 0, 1, 2, 3
    [0.0, 1.0, 3.0, 4.0]
    """
    m = x.manager
    if (target is None) == (stride is None):
        raise SparseTensorError("trilinear_upsample3d takes exactly one of target or stride.")
    if stride is not None:
        strides = normalize_triple(stride, "stride")
        fine = _finer_stride(x, strides)

        def make() -> tuple[mx.array, Triple]:
            axes = [np.arange(s) * t for s, t in zip(strides, fine, strict=True)]
            block = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
            return _grown(x.coords, block.astype(np.int64)), fine

        out_key = m.derived(x.coordinate_key, ("upsample_blocks", strides), make)
    elif isinstance(target, SparseTensor):
        out_key = _output_key(x, target, target.tensor_stride)
    elif isinstance(target, tuple) and m.has(target):
        out_key = target
    else:
        raise SparseTensorError(
            f"target must be a SparseTensor or a coordinate key of x's manager, got {target!r}."
        )
    fine_stride = out_key[0]
    if any(t % f for t, f in zip(x.tensor_stride, fine_stride, strict=True)):
        raise SparseTensorError(
            f"target tensor stride {fine_stride} must divide x's tensor stride {x.tensor_stride}."
        )

    def build() -> tuple[mx.array, mx.array]:
        return _trilinear_map(
            np.array(x.coords).astype(np.int64),
            x.tensor_stride,
            np.array(m.coords(out_key)).astype(np.int64),
            fine_stride,
        )

    if x.num_points == 0:  # nothing to gather from: every output has no corner
        return x.at(out_key, mx.zeros((int(m.coords(out_key).shape[0]), x.num_channels), x.dtype))
    rows, weights = m.memo(("trilinear", x.coordinate_key, out_key), build)
    w = weights.astype(x.dtype)
    feats = x.feats
    out = w[:, 0:1] * mx.take(feats, rows[:, 0], axis=0)
    for corner in range(1, 8):
        out = out + w[:, corner : corner + 1] * mx.take(feats, rows[:, corner], axis=0)
    return x.at(out_key, out)


def _batch_index(x: SparseTensor) -> mx.array:
    return x.coords[:, 0]


def _global_batch_size(x: SparseTensor, batch_size: int | None) -> int:
    if batch_size is None:
        return x.batch_size
    if not isinstance(batch_size, int | np.integer) or isinstance(batch_size, bool):
        raise SparseTensorError(f"batch_size must be an int or None, got {batch_size!r}.")
    if batch_size < x.batch_size:
        raise SparseTensorError(
            f"batch_size {batch_size} is smaller than the {x.batch_size} batch entries x holds."
        )
    return int(batch_size)


def _batch_counts(x: SparseTensor, batch_size: int) -> mx.array:
    return mx.zeros((batch_size,), dtype=mx.float32).at[_batch_index(x)].add(1.0)


def global_sum_pool(x: SparseTensor, batch_size: int | None = None) -> mx.array:
    """``(B, C)`` per-batch sums of the features; an empty batch entry sums to 0.

    ``batch_size`` (default ``x.batch_size``) keeps trailing empty entries.

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32), mx.ones((2, 1)))
    >>> global_sum_pool(x, batch_size=2).tolist()
    [[2.0], [0.0]]
    """
    b = _global_batch_size(x, batch_size)
    out = mx.zeros((b, x.num_channels), dtype=x.dtype)
    return out.at[_batch_index(x)].add(x.feats)


def global_avg_pool(x: SparseTensor, batch_size: int | None = None) -> mx.array:
    """``(B, C)`` per-batch means; an empty batch entry gets 0."""
    b = _global_batch_size(x, batch_size)
    counts = _batch_counts(x, b)
    sums = global_sum_pool(x, b).astype(mx.float32)
    return (sums / mx.maximum(counts, 1.0)[:, None]).astype(x.dtype)


def global_max_pool(
    x: SparseTensor, batch_size: int | None = None, *, empty: float | None = 0.0
) -> mx.array:
    """``(B, C)`` per-batch maxima.

    An empty batch entry (no rows with that batch index, below ``batch_size``)
    is filled with ``empty`` (default 0); ``empty=None`` raises instead.

    >>> x = SparseTensor(mx.array([[1, 0, 0, 0]], dtype=mx.int32), mx.full((1, 1), -3.0))
    >>> global_max_pool(x).tolist()
    [[0.0], [-3.0]]
    >>> global_max_pool(x, empty=None)
    Traceback (most recent call last):
    ...
    mlx_lattice.tensor.SparseTensorError: global_max_pool: batch entry 0 has no rows; pass empty= to fill it.
    """
    b = _global_batch_size(x, batch_size)
    counts = _batch_counts(x, b)
    if empty is None:
        missing = np.nonzero(np.array(counts) == 0)[0]
        if missing.size:
            raise SparseTensorError(
                f"global_max_pool: batch entry {int(missing[0])} has no rows; pass empty= to fill it."
            )
        fill = 0.0
    else:
        fill = float(empty)
    low = mx.full((b, x.num_channels), -mx.inf, dtype=x.dtype)
    out = low.at[_batch_index(x)].maximum(x.feats)
    return mx.where((counts > 0)[:, None], out, mx.array(fill, dtype=x.dtype))


def _same_coords(xs: Sequence[SparseTensor], what: str) -> None:
    first = xs[0]
    for x in xs[1:]:
        if x.manager is not first.manager or x.coordinate_key != first.coordinate_key:
            same = x.num_points == first.num_points and bool(mx.array_equal(x.coords, first.coords))
            if not same:
                raise SparseTensorError(f"{what} needs tensors on the same coordinates.")


def cat(*xs: SparseTensor) -> SparseTensor:
    """Concatenate features of tensors on the same coordinates (U-Net skips).

    Two tensors of one dtype (any: float, or a compiled graph's int8 codes)
    are joined by the extension's row copy (``concat_rows``: each row's two
    runs of bytes, over the kernels' threads, the bytes of
    ``mx.concatenate``; MLX's CPU concatenate copies element by element on
    one thread); other cases take ``mx.concatenate`` (which promotes mixed
    dtypes). Differentiable either way.

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32), mx.ones((2, 2)))
    >>> cat(x, x.replace(mx.array([[5.0], [6.0]]))).feats.tolist()
    [[1.0, 1.0, 5.0], [1.0, 1.0, 6.0]]
    """
    if not xs:
        raise SparseTensorError("cat needs at least one tensor.")
    _same_coords(xs, "cat")
    feats = [x.feats for x in xs]
    if len(feats) == 2 and feats[0].dtype == feats[1].dtype:
        return xs[0].replace(ext.concat_rows(feats[0], feats[1]))
    return xs[0].replace(mx.concatenate(feats, axis=1))


def add(x: SparseTensor, y: SparseTensor) -> SparseTensor:
    """Elementwise sum of two tensors on the same coordinates."""
    _same_coords((x, y), "add")
    return x.replace(x.feats + y.feats)


def mul(x: SparseTensor, y: SparseTensor) -> SparseTensor:
    """Elementwise product of two tensors on the same coordinates."""
    _same_coords((x, y), "mul")
    return x.replace(x.feats * y.feats)


def apply(x: SparseTensor, fn: Callable[[mx.array], mx.array]) -> SparseTensor:
    """``fn`` applied to the features (rows must be kept)."""
    return x.replace(fn(x.feats))


def relu(x: SparseTensor) -> SparseTensor:
    """Elementwise ReLU of the features (half precision computed in float32:
    3x faster forward+backward, 1.4x slower forward alone, measured)."""
    return x.replace(_in_float32(x.feats, lambda f: mx.maximum(f, 0)))


# -- feature layers: elementwise on the features, coordinates unchanged --------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_HALF = (mx.float16, mx.bfloat16)


def _in_float32(f: mx.array, fn: Callable[[mx.array], mx.array]) -> mx.array:
    """``fn(f)``, computed in float32 for half-precision ``f`` and cast back:
    MLX's CPU half-precision elementwise ops are several times slower than
    the two casts (measured by ``//benchmarks:sparse_layers``)."""
    if f.dtype in _HALF:
        return fn(f.astype(mx.float32)).astype(f.dtype)
    return fn(f)


def gelu(x: SparseTensor, approximate: Literal["none", "tanh"] = "none") -> SparseTensor:
    """GELU of the features: exact ``x * Phi(x)`` (``approximate="none"``) or
    the tanh form ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0]], dtype=mx.int32), mx.array([[1.0]]))
    >>> round(gelu(x).feats.item(), 4), round(gelu(x, approximate="tanh").feats.item(), 4)
    (0.8413, 0.8412)
    """
    if approximate == "none":
        return x.replace(_in_float32(x.feats, mlx_nn.gelu))
    if approximate == "tanh":

        def tanh_form(f: mx.array) -> mx.array:
            return 0.5 * f * (1.0 + mx.tanh(_SQRT_2_OVER_PI * (f + 0.044715 * f * f * f)))

        return x.replace(_in_float32(x.feats, tanh_form))
    raise SparseTensorError(f"approximate must be 'none' or 'tanh', got {approximate!r}.")


def silu(x: SparseTensor) -> SparseTensor:
    """SiLU (swish) of the features: ``x * sigmoid(x)``."""
    return x.replace(_in_float32(x.feats, lambda f: f * mx.sigmoid(f)))


def leaky_relu(x: SparseTensor, negative_slope: float = 0.01) -> SparseTensor:
    """Leaky ReLU of the features: ``x`` where positive, ``negative_slope * x`` elsewhere."""
    # max/min instead of a select: MLX's CPU select is ~10x slower (sparse_layers).
    pick = mx.maximum if negative_slope <= 1 else mx.minimum
    return x.replace(_in_float32(x.feats, lambda f: pick(f, negative_slope * f)))


def sigmoid(x: SparseTensor) -> SparseTensor:
    """Logistic sigmoid of the features."""
    return x.replace(_in_float32(x.feats, mx.sigmoid))


def tanh(x: SparseTensor) -> SparseTensor:
    """Hyperbolic tangent of the features."""
    return x.replace(_in_float32(x.feats, mx.tanh))


def softplus(x: SparseTensor, beta: float = 1.0) -> SparseTensor:
    """``log(1 + exp(beta * x)) / beta`` of the features (overflow-free)."""
    if not beta > 0:
        raise SparseTensorError(f"beta must be positive, got {beta!r}.")
    return x.replace(
        _in_float32(x.feats, lambda f: mx.logaddexp(beta * f, mx.zeros_like(f)) / beta)
    )


def dropout(
    x: SparseTensor, p: float = 0.5, *, training: bool = True, key: mx.array | None = None
) -> SparseTensor:
    """Zero each feature entry with probability ``p`` and scale the rest by ``1 / (1 - p)``.

    With ``training=False`` (or ``p == 0``) the tensor is returned as is.
    ``key`` is an ``mx.random`` key (default: MLX's global generator).
    """
    if not 0.0 <= p < 1.0:
        raise SparseTensorError(f"dropout probability p must be in [0, 1), got {p!r}.")
    if not training or p == 0.0:
        return x
    keep = mx.random.bernoulli(1.0 - p, x.feats.shape, key=key)
    return x.replace(mx.where(keep, x.feats / (1.0 - p), mx.zeros_like(x.feats)))


def _norm_params(
    x: SparseTensor, weight: mx.array | None, bias: mx.array | None, what: str
) -> None:
    for name, value in (("weight", weight), ("bias", bias)):
        if value is not None and tuple(value.shape) != (x.num_channels,):
            raise SparseTensorError(
                f"{what}: {name} must have shape ({x.num_channels},), got {tuple(value.shape)}."
            )


# MLX 0.32's CPU reductions over an axis of size 0 into a non-empty result
# (``mx.sum(mx.zeros((3, 0)), axis=-1)``, which the fast norms run) can spin
# forever in ``reduction_op``'s loop, intermittently. Empty features never
# reach one here: their norm is the empty array itself.


def layer_norm(
    x: SparseTensor,
    weight: mx.array | None = None,
    bias: mx.array | None = None,
    *,
    eps: float = 1e-5,
) -> SparseTensor:
    """Layer normalization over each point's channels (``mx.fast.layer_norm``).

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0]], dtype=mx.int32), mx.array([[1.0, 3.0]]))
    >>> [round(v, 3) for v in layer_norm(x).feats[0].tolist()]
    [-1.0, 1.0]
    """
    _norm_params(x, weight, bias, "layer_norm")
    if x.feats.size == 0:
        return x.replace(x.feats)  # nothing to normalize (the note above)
    # mx.fast norms accumulate half inputs in float32 themselves; upcasting
    # first measured no faster (//benchmarks:sparse_layers).
    w = None if weight is None else weight.astype(x.dtype)
    b = None if bias is None else bias.astype(x.dtype)
    return x.replace(mx.fast.layer_norm(x.feats, w, b, eps))


def rms_norm(x: SparseTensor, weight: mx.array | None = None, *, eps: float = 1e-5) -> SparseTensor:
    """RMS normalization over each point's channels: ``x / sqrt(mean(x^2) + eps) * weight``."""
    _norm_params(x, weight, None, "rms_norm")
    if x.feats.size == 0:
        return x.replace(x.feats)  # nothing to normalize (the note above)
    w = mx.ones((x.num_channels,), x.dtype) if weight is None else weight.astype(x.dtype)
    return x.replace(mx.fast.rms_norm(x.feats, w, eps))


def pointwise_relation(x: SparseTensor) -> KernelRelation:
    """The 1x1x1 relation of ``x``'s coordinate set (every row to itself),
    built once per set and kept by its manager."""
    return x.manager.memo(
        ("pointwise", x.coordinate_key),
        lambda: build_kernel_relation(x.coords, kernel_size=1, tensor_stride=x.tensor_stride),
    )


def linear(x: SparseTensor, weight: mx.array, bias: mx.array | None = None) -> SparseTensor:
    """``x @ weight.T (+ bias)`` on the features; ``weight`` is ``(Cout, Cin)``.

    Runs as a 1x1x1 sparse convolution over :func:`pointwise_relation` (the
    native GEMM kernels, with their gradients): on CPU this is several times
    faster than ``mx.matmul`` on the same features
    (``//benchmarks:sparse_layers``).

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0]], dtype=mx.int32), mx.array([[1.0, 2.0]]))
    >>> linear(x, mx.array([[1.0, 1.0], [0.0, 3.0]]), mx.array([0.5, 0.0])).feats.tolist()
    [[3.5, 6.0]]
    """
    if weight.ndim != 2 or int(weight.shape[1]) != x.num_channels:
        raise SparseTensorError(
            f"weight must be (Cout, {x.num_channels}), got shape {tuple(weight.shape)}."
        )
    mapped = mx.contiguous(weight.T.astype(x.dtype))[None]  # (K=1, Cin, Cout)
    out = core_ops.sparse_conv_features_from_relation(x.feats, mapped, pointwise_relation(x))
    if bias is not None:
        out = out + bias.astype(out.dtype)
    return x.replace(out)


def prune(x: SparseTensor, mask: mx.array | np.ndarray) -> SparseTensor:
    """Keep the rows where ``mask`` (``(N,)`` bool) is true, as a new coordinate set."""
    keep = np.asarray(mask)
    if keep.shape != (x.num_points,) or keep.dtype != np.bool_:
        raise SparseTensorError(
            f"mask must be a ({x.num_points},) bool array, got {keep.dtype} {keep.shape}."
        )
    rows = mx.array(np.nonzero(keep)[0].astype(np.int32))
    coords = x.coords[rows]
    key = x.manager.register(coords, x.tensor_stride, x.manager.new_tag())
    return x.at(key, x.feats[rows])
