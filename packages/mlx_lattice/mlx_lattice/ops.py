"""Functional sparse ops on :class:`~mlx_lattice.tensor.SparseTensor`.

Convolution weights are ``(Cout, kx, ky, kz, Cin)`` (MLX's ``conv3d``
layout) or quantized (:class:`~mlx_lattice.core.quantized.QuantizedWeight`);
the kernel size is read from the weight. Relations come from the input's
coordinate manager, so layers at one level share them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import mlx.core as mx
import mlx.nn as mlx_nn
import numpy as np

from mlx_lattice.core import ops as core_ops
from mlx_lattice.core.quantized import QuantizedWeight
from mlx_lattice.core.relations import KernelRelation, kernel_offsets, normalize_triple
from mlx_lattice.tensor import CoordinateKey, SparseTensor, SparseTensorError

__all__ = [
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
    "prune",
    "relu",
    "rms_norm",
    "sigmoid",
    "silu",
    "softplus",
    "subm_conv3d",
    "sum_pool3d",
    "tanh",
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


def _apply_conv(
    x: SparseTensor,
    weight: Weight,
    bias: mx.array | None,
    rel: KernelRelation,
    out_key: CoordinateKey,
) -> SparseTensor:
    if x.num_channels != _in_channels(weight):
        raise SparseTensorError(
            f"x has {x.num_channels} channels but the weight expects {_in_channels(weight)}."
        )
    if isinstance(weight, QuantizedWeight):
        feats = core_ops.sparse_quantized_conv_features_from_relation(x.feats, weight, rel)
    else:
        feats = core_ops.sparse_conv_features_from_relation(x.feats, weight, rel)
    if bias is not None:
        feats = feats + bias.astype(feats.dtype)
    return x.at(out_key, feats)


def conv3d(
    x: SparseTensor,
    weight: Weight,
    bias: mx.array | None = None,
    *,
    stride: int | Sequence[int] = 1,
    dilation: int | Sequence[int] = 1,
    kernel_size: int | Sequence[int] | None = None,
) -> SparseTensor:
    """Sparse 3-D convolution.

    With ``stride`` 1 the outputs are the input coordinates (as
    :func:`subm_conv3d`); otherwise the input coordinates floored to the
    coarser grid ``x.tensor_stride * stride``:
    ``out[q] = sum_k x[q + offset(k)] @ W_k (+ bias)``.

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32), mx.ones((2, 4)))
    >>> y = conv3d(x, mx.ones((8, 2, 2, 2, 4)), stride=2)
    >>> y.coords.tolist(), y.tensor_stride, y.feats[0, 0].item()
    ([[0, 0, 0, 0]], (2, 2, 2), 8.0)
    """
    size = _kernel_size(weight, kernel_size)
    strides = normalize_triple(stride, "stride")
    if strides == (1, 1, 1):
        return subm_conv3d(x, weight, bias, dilation=dilation, kernel_size=kernel_size)
    rel, out_key = x.manager.relation(
        x.coordinate_key, kernel_size=size, stride=strides, dilation=dilation, kind="forward"
    )
    return _apply_conv(x, weight, bias, rel, out_key)


def subm_conv3d(
    x: SparseTensor,
    weight: Weight,
    bias: mx.array | None = None,
    *,
    dilation: int | Sequence[int] = 1,
    kernel_size: int | Sequence[int] | None = None,
) -> SparseTensor:
    """Submanifold convolution: outputs exactly at the input coordinates."""
    size = _kernel_size(weight, kernel_size)
    rel, out_key = x.manager.relation(
        x.coordinate_key, kernel_size=size, dilation=dilation, kind="submanifold"
    )
    return _apply_conv(x, weight, bias, rel, out_key)


def _finer_stride(x: SparseTensor, stride: tuple[int, int, int]) -> tuple[int, int, int]:
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
    dilation: int | Sequence[int] = 1,
    kernel_size: int | Sequence[int] | None = None,
) -> SparseTensor:
    """Transposed convolution back onto the finer coordinates the manager
    already holds (those a strided :func:`conv3d` came from):
    ``out[p] = sum_k x[p - offset(k)] @ W_k (+ bias)``, offsets at the finer
    stride.
    """
    size = _kernel_size(weight, kernel_size)
    fine = _finer_stride(x, normalize_triple(stride, "stride"))
    out_key = (fine, x.coordinate_key[1])
    if not x.manager.has(out_key):
        raise SparseTensorError(
            f"no coordinates at tensor stride {fine} to transpose onto; run the matching strided "
            "conv3d first, or use generative_conv_transpose3d."
        )
    rel, _ = x.manager.relation(
        x.coordinate_key, out_key, kernel_size=size, dilation=dilation, kind="target"
    )
    return _apply_conv(x, weight, bias, rel, out_key)


def generative_conv_transpose3d(
    x: SparseTensor,
    weight: Weight,
    bias: mx.array | None = None,
    *,
    stride: int | Sequence[int] = 2,
    kernel_size: int | Sequence[int] | None = None,
) -> SparseTensor:
    """Transposed convolution that creates its outputs: every ``p + offset(k)``
    for input ``p`` and kernel offset ``k`` at the finer stride."""
    size = _kernel_size(weight, kernel_size)
    fine = _finer_stride(x, normalize_triple(stride, "stride"))
    offsets = kernel_offsets(size, 1, fine)
    coords = np.array(x.coords).astype(np.int64)
    grown = coords[:, None, 1:] + offsets[None]
    rows = np.concatenate(
        [np.repeat(coords[:, :1], len(offsets), axis=0), grown.reshape(-1, 3)], axis=1
    )
    rows = np.unique(rows, axis=0)
    if rows.size and (rows.min() < -(2**31) or rows.max() >= 2**31):
        raise SparseTensorError("generated coordinates leave the int32 range.")
    out_key = x.manager.register(mx.array(rows.astype(np.int32)), fine, x.manager.new_tag())
    rel, _ = x.manager.relation(x.coordinate_key, out_key, kernel_size=size, kind="target")
    return _apply_conv(x, weight, bias, rel, out_key)


def _pool(x: SparseTensor, kernel_size, stride, mode: str) -> SparseTensor:  # noqa: ANN001
    size = normalize_triple(kernel_size, "kernel_size", high=7)
    strides = normalize_triple(stride, "stride")
    rel, out_key = x.manager.relation(
        x.coordinate_key, kernel_size=size, stride=strides, kind="forward"
    )
    feats = core_ops.sparse_pool_features_from_relation(
        x.feats, rel, input_exclusive=size == strides, mode=mode
    )
    return x.at(out_key, feats)


def max_pool3d(
    x: SparseTensor, kernel_size: int | Sequence[int] = 2, stride: int | Sequence[int] = 2
) -> SparseTensor:
    """Max over the present inputs of each output's window."""
    return _pool(x, kernel_size, stride, "max")


def avg_pool3d(
    x: SparseTensor, kernel_size: int | Sequence[int] = 2, stride: int | Sequence[int] = 2
) -> SparseTensor:
    """Mean over the present inputs of each output's window."""
    return _pool(x, kernel_size, stride, "avg")


def sum_pool3d(
    x: SparseTensor, kernel_size: int | Sequence[int] = 2, stride: int | Sequence[int] = 2
) -> SparseTensor:
    """Sum over the present inputs of each output's window."""
    return _pool(x, kernel_size, stride, "sum")


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
    """Concatenate features of tensors on the same coordinates (U-Net skips)."""
    if not xs:
        raise SparseTensorError("cat needs at least one tensor.")
    _same_coords(xs, "cat")
    return xs[0].replace(mx.concatenate([x.feats for x in xs], axis=1))


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
    """Elementwise ReLU of the features."""
    return x.replace(mx.maximum(x.feats, 0))


# -- feature layers: elementwise on the features, coordinates unchanged --------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu(x: SparseTensor, approximate: Literal["none", "tanh"] = "none") -> SparseTensor:
    """GELU of the features: exact ``x * Phi(x)`` (``approximate="none"``) or
    the tanh form ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0]], dtype=mx.int32), mx.array([[1.0]]))
    >>> round(gelu(x).feats.item(), 4), round(gelu(x, approximate="tanh").feats.item(), 4)
    (0.8413, 0.8412)
    """
    f = x.feats
    if approximate == "none":
        return x.replace(mlx_nn.gelu(f))
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (f + 0.044715 * f * f * f)
        return x.replace(0.5 * f * (1.0 + mx.tanh(inner)))
    raise SparseTensorError(f"approximate must be 'none' or 'tanh', got {approximate!r}.")


def silu(x: SparseTensor) -> SparseTensor:
    """SiLU (swish) of the features: ``x * sigmoid(x)``."""
    return x.replace(x.feats * mx.sigmoid(x.feats))


def leaky_relu(x: SparseTensor, negative_slope: float = 0.01) -> SparseTensor:
    """Leaky ReLU of the features: ``x`` where positive, ``negative_slope * x`` elsewhere."""
    return x.replace(mx.where(x.feats > 0, x.feats, negative_slope * x.feats))


def sigmoid(x: SparseTensor) -> SparseTensor:
    """Logistic sigmoid of the features."""
    return x.replace(mx.sigmoid(x.feats))


def tanh(x: SparseTensor) -> SparseTensor:
    """Hyperbolic tangent of the features."""
    return x.replace(mx.tanh(x.feats))


def softplus(x: SparseTensor, beta: float = 1.0) -> SparseTensor:
    """``log(1 + exp(beta * x)) / beta`` of the features (overflow-free)."""
    if not beta > 0:
        raise SparseTensorError(f"beta must be positive, got {beta!r}.")
    f = x.feats
    return x.replace(mx.logaddexp(beta * f, mx.zeros_like(f)) / beta)


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
    return x.replace(mx.fast.layer_norm(x.feats, weight, bias, eps))


def rms_norm(x: SparseTensor, weight: mx.array | None = None, *, eps: float = 1e-5) -> SparseTensor:
    """RMS normalization over each point's channels: ``x / sqrt(mean(x^2) + eps) * weight``."""
    _norm_params(x, weight, None, "rms_norm")
    if weight is None:
        weight = mx.ones((x.num_channels,), dtype=x.dtype)
    return x.replace(mx.fast.rms_norm(x.feats, weight, eps))


def linear(x: SparseTensor, weight: mx.array, bias: mx.array | None = None) -> SparseTensor:
    """``x @ weight.T (+ bias)`` on the features; ``weight`` is ``(Cout, Cin)``."""
    if weight.ndim != 2 or int(weight.shape[1]) != x.num_channels:
        raise SparseTensorError(
            f"weight must be (Cout, {x.num_channels}), got shape {tuple(weight.shape)}."
        )
    out = x.feats @ weight.T
    if bias is not None:
        out = out + bias
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


def normalized_conv3d(
    x: SparseTensor,
    weight: mx.array,
    bias: mx.array | None = None,
    *,
    dilation: int | Sequence[int] = 1,
    eps: float = 1e-6,
) -> SparseTensor:
    """Submanifold convolution normalized by the weight energy each output sees.

    ``out[o] = (sum_k x[o + offset(k)] @ W_k) / sqrt(sum_k 1 @ (W_k * W_k) + eps)``
    with both sums over the offsets present at ``o``: an output with few
    neighbours is not attenuated against a dense one. The denominator is the
    convolution of all-ones features with the squared weight (the
    specialised float16 reduction when it applies).
    """
    size = _kernel_size(weight, None)
    rel, out_key = x.manager.relation(
        x.coordinate_key, kernel_size=size, dilation=dilation, kind="submanifold"
    )
    num = core_ops.sparse_conv_features_from_relation(x.feats, weight, rel)
    ones = mx.ones(x.feats.shape, dtype=x.dtype)
    squared = weight * weight
    den = core_ops.sparse_conv_normalization_denominator_from_relation(ones, squared, rel)
    if den is None:
        den = core_ops.sparse_conv_features_from_relation(ones, squared, rel)
    feats = num / mx.sqrt(den.astype(mx.float32) + eps).astype(num.dtype)
    if bias is not None:
        feats = feats + bias.astype(feats.dtype)
    return x.at(out_key, feats)
