"""Fused feature ops for training: batch norm (+ ReLU) with a hand-written
backward, and dense linear layers through the native GEMM kernels.

MLX's autodiff of ``mlx.nn.BatchNorm`` followed by a ReLU runs a chain of
elementwise passes over the ``(N, C)`` features (the mean and variance are
computed three times in training mode, and the backward pass differentiates
each step). :func:`batch_norm_train` computes the statistics once, in
float32 whatever the features' dtype, and its backward pass is the closed
form (two reductions and one fused affine map). On the CPU and on Apple GPUs
(Metal) both passes are native primitives (``ext.batch_norm_train``:
float32, float16 and bfloat16 features read and written in their own dtype,
so a half-precision network pays no casts and no half-precision elementwise
ops for its norms); on other devices the same closed form runs as MLX ops on
float32 copies.
``//benchmarks:sparse_unet`` measures the training step it serves.

:func:`batch_norm_eval` is the eval-mode norm (given running statistics)
as one native map in the features' own dtype: through MLX ops a float16
network's norms cost two casts and several float32 passes each, more than
its float16 convolutions save.

:func:`add` sums two same-shaped arrays in their own dtype natively: on the
CPU MLX's float16 and bfloat16 elementwise ops are many times slower than
float32 ones (autodiff's sum of the two gradients of a half-precision skip
tensor, for one).

:func:`bias_relu` and :func:`bias_relu_add` are the epilogues of a layer
whose eval-mode norm is folded into it (:func:`mlx_lattice.compile`): bias,
ReLU and, for the second, a skip addition after the ReLU, in one pass.

:func:`dense_linear` runs ``x @ W.T + b`` on a plain ``(N, Cin)`` array as a
1x1x1 sparse convolution over an identity relation (built once per row count
and kept): on the CPU the native GEMM kernels are several times faster than
``mx.matmul`` on these shapes, and their gradients come with them.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx
import numpy as np

from mlx_lattice._errors import MlxLatticeError
from mlx_lattice._native import ext
from mlx_lattice.core import ops as core_ops
from mlx_lattice.core.relations import KernelRelation, build_kernel_relation

__all__ = [
    "add",
    "batch_norm_eval",
    "batch_norm_train",
    "bias_relu",
    "bias_relu_add",
    "dense_linear",
    "identity_relation",
]

_F32 = mx.float32


def _stats(xf: mx.array) -> tuple[mx.array, mx.array]:
    mean = mx.mean(xf, axis=0)
    var = mx.mean(mx.square(xf - mean), axis=0)  # two-pass: no cancellation
    return mean, var


def _make(eps: float, relu: bool) -> object:
    # x is float32 here: batch_norm_train casts half-precision features
    # outside, where MLX differentiates the casts as casts (inside, the
    # backward pass would cast x again and recompute the mask).
    @mx.custom_function
    def fused(x: mx.array, weight: mx.array, bias: mx.array) -> tuple[mx.array, ...]:
        mean, var = _stats(x)
        scale = weight.astype(_F32) * mx.rsqrt(var + eps)
        shift = bias.astype(_F32) - mean * scale
        y = x * scale + shift
        if relu:
            y = mx.maximum(y, 0)
        return y, mean, var

    @fused.vjp
    def fused_vjp(
        primals: tuple[mx.array, ...], cotangents: tuple[mx.array, ...], outputs: tuple
    ) -> tuple[mx.array, ...]:
        x, weight, bias = primals
        y, mean, var = outputs
        n = x.shape[0]
        xf = x
        rstd = mx.rsqrt(var + eps)
        w32 = weight.astype(_F32)
        g = cotangents[0]
        if relu:
            # The ReLU's mask as sign(y) (y >= 0): a unary op and a same-dtype
            # product, several times faster on the CPU than mx.where with a
            # scalar or a product with a bool mask.
            g = g * mx.sign(y)
        dbias = mx.sum(g, axis=0)
        # sum(g * xhat) with xhat = (x - mean) * rstd, without forming xhat.
        dweight = (mx.sum(g * xf, axis=0) - mean * dbias) * rstd
        # dx = a * (g - (dbias + xhat * dweight) / n) = g * a + x * c + d
        a = w32 * rstd
        c = -a * rstd * dweight / n
        d = -a * dbias / n - mean * c
        dx = g * a + (xf * c + d)
        return (
            dx,
            dweight.astype(weight.dtype),
            dbias.astype(bias.dtype),
        )

    return fused


_FUSED: dict[tuple[float, bool], object] = {}

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def batch_norm_train(
    x: mx.array,
    weight: mx.array,
    bias: mx.array,
    *,
    eps: float = 1e-5,
    relu: bool = False,
) -> tuple[mx.array, mx.array, mx.array]:
    """Training-mode batch norm of ``(N, C)`` features over the rows, with an
    optional ReLU: ``y = max((x - mean) / sqrt(var + eps) * weight + bias, 0)``.

    Statistics and the affine map run in float32 (on the CPU: two-pass
    statistics accumulated in double over fixed row blocks, bitwise the same
    for any thread count; on Metal the same blocks with compensated float32
    sums, independent of the grid); ``y`` comes back in ``x``'s dtype, rounded once
    from the float32 result. Returns ``(y, mean, var)`` with the biased
    float32 batch statistics (for running averages; they carry no
    gradient). Gradients flow to ``x``, ``weight`` and ``bias`` through the
    closed-form backward pass. ``x`` is float32, float16 or bfloat16 with at
    least one row; bad arguments raise ``ValueError`` naming them.

    >>> x = mx.array([[1.0, 0.0], [3.0, 4.0]])
    >>> y, mean, var = batch_norm_train(x, mx.ones((2,)), mx.zeros((2,)), eps=0.0, relu=True)
    >>> y.tolist(), mean.tolist(), var.tolist()
    ([[0.0, 0.0], [1.0, 1.0]], [2.0, 2.0], [1.0, 4.0])
    """
    if not isinstance(x, mx.array) or x.ndim != 2 or int(x.shape[0]) < 1:
        shape = tuple(x.shape) if isinstance(x, mx.array) else type(x).__name__
        raise MlxLatticeError(f"x must be (N, C) with N >= 1 rows, got shape {shape}.")
    if x.dtype not in _FLOATS:
        raise MlxLatticeError(f"x must be float32, float16 or bfloat16, got {x.dtype}.")
    c = int(x.shape[1])
    for name, p in (("weight", weight), ("bias", bias)):
        if not isinstance(p, mx.array) or p.shape != (c,):
            shape = tuple(p.shape) if isinstance(p, mx.array) else type(p).__name__
            raise MlxLatticeError(f"{name} must be ({c},), got shape {shape}.")
        if p.dtype not in _FLOATS:
            raise MlxLatticeError(f"{name} must be float32, float16 or bfloat16, got {p.dtype}.")
    if not (isinstance(eps, int | float) and 0 <= eps < float("inf")):
        raise MlxLatticeError(f"eps must be a finite number >= 0, got {eps!r}.")
    if native_norms():
        y, mean, var = ext.batch_norm_train(x, weight, bias, eps=float(eps), relu=bool(relu))
        return y, mx.stop_gradient(mean), mx.stop_gradient(var)
    key = (float(eps), bool(relu))
    fn = _FUSED.get(key)
    if fn is None:
        fn = _FUSED[key] = _make(*key)
    y, mean, var = fn(x.astype(_F32), weight, bias)  # type: ignore[operator]
    return y.astype(x.dtype), mx.stop_gradient(mean), mx.stop_gradient(var)


def native_norms() -> bool:
    """Whether the native batch norm primitives run on the default device
    (the CPU, or an Apple GPU through Metal)."""
    return mx.default_device() == mx.cpu or mx.metal.is_available()


def batch_norm_eval(
    x: mx.array,
    mean: mx.array,
    var: mx.array,
    weight: mx.array | None = None,
    bias: mx.array | None = None,
    *,
    eps: float = 1e-5,
    relu: bool = False,
) -> mx.array:
    """Eval-mode batch norm of ``(N, C)`` features with given statistics
    (running averages), then a ReLU if ``relu``:
    ``y = max((x - mean) * weight / sqrt(var + eps) + bias, 0)``, ``weight``
    and ``bias`` optional.

    ``scale = weight * rsqrt(var + eps)`` is formed in float32 (as
    ``mlx.nn.BatchNorm`` forms its factors); the map runs as one native pass
    (``ext.batch_norm_eval``) in float32 per element and is rounded once to
    ``x``'s dtype (float32, float16 or bfloat16), so half-precision features
    pay no casts and no half-precision MLX ops. Differentiable in every
    argument; on devices without the native kernels (neither the CPU nor
    Metal) the same expression runs as MLX ops on float32 copies. Bad
    arguments raise ``ValueError`` naming them.

    >>> x = mx.array([[1.0, 0.0], [3.0, 4.0]])
    >>> batch_norm_eval(x, mx.array([2.0, 2.0]), mx.array([1.0, 4.0]), eps=0.0, relu=True).tolist()
    [[0.0, 0.0], [1.0, 1.0]]
    """
    if native_norms():
        return ext.batch_norm_eval(x, mean, var, weight, bias, eps=float(eps), relu=bool(relu))
    scale = mx.rsqrt(var.astype(_F32) + eps)
    if weight is not None:
        scale = weight.astype(_F32) * scale
    y = (x.astype(_F32) - mean.astype(_F32)) * scale
    if bias is not None:
        y = y + bias.astype(_F32)
    if relu:
        y = mx.maximum(y, 0)
    return y.astype(x.dtype)


def bias_relu(x: mx.array, bias: mx.array, *, relu: bool = True) -> mx.array:
    """``max(x + bias, 0)`` (``x + bias`` without ``relu``) of ``(N, C)``
    features with a ``(C,)`` float32 bias, in one pass: the epilogue of a
    convolution whose batch norm is folded into its weights
    (:func:`mlx_lattice.compile`). Each value is ``x + bias`` computed in
    float32 and rounded once to ``x``'s dtype: it is
    :func:`batch_norm_eval` with mean 0, variance 1 and ``eps`` 0, whose
    scale ``rsqrt(1) = 1`` is exact, so the sum is the only rounding.

    >>> bias_relu(mx.array([[1.0, -3.0]]), mx.array([0.5, 1.0])).tolist()
    [[1.5, 0.0]]
    """
    if not isinstance(bias, mx.array) or bias.ndim != 1:
        shape = tuple(bias.shape) if isinstance(bias, mx.array) else type(bias).__name__
        raise MlxLatticeError(f"bias must be a (C,) array, got {shape}.")
    c = int(bias.shape[0])
    if not isinstance(x, mx.array) or x.ndim != 2 or int(x.shape[1]) != c:
        shape = tuple(x.shape) if isinstance(x, mx.array) else type(x).__name__
        raise MlxLatticeError(f"x must be (N, {c}) for a bias of {c} channels, got {shape}.")
    zeros, ones = _unit_stats(c)
    return batch_norm_eval(x, zeros, ones, None, bias, eps=0.0, relu=relu)


def bias_relu_add(
    x: mx.array, bias: mx.array, residual: mx.array, *, relu: bool = True
) -> mx.array:
    """``max(x + bias, 0) + residual`` (``x + bias + residual`` without
    ``relu``) of ``(N, C)`` features: the epilogue of a linear layer whose
    batch norm is folded into it and whose output a skip addition reads
    (SPVCNN's point branch, :func:`mlx_lattice.compile`), the add after the
    ReLU as in that graph. For float32 ``x`` and ``residual`` on the CPU it
    is one native pass (``ext.bias_relu_add``) instead of two; its values
    are those of :func:`bias_relu` followed by ``+ residual`` (each
    operation in float32, rounded once, in that order), bit for bit.
    Other dtypes and devices take those two passes. Inference only (no
    gradient).

    >>> bias_relu_add(mx.array([[1.0, -3.0]]), mx.array([0.5, 1.0]), mx.array([[1.0, 2.0]])).tolist()
    [[2.5, 2.0]]
    """
    for name, v in (("x", x), ("residual", residual)):
        if not isinstance(v, mx.array) or v.ndim != 2:
            shape = tuple(v.shape) if isinstance(v, mx.array) else type(v).__name__
            raise MlxLatticeError(f"{name} must be an (N, C) array, got {shape}.")
    c = int(x.shape[1])
    if not isinstance(bias, mx.array) or tuple(bias.shape) != (c,):
        shape = tuple(bias.shape) if isinstance(bias, mx.array) else type(bias).__name__
        raise MlxLatticeError(f"bias must be ({c},) for x of {c} channels, got {shape}.")
    if residual.shape != x.shape:
        raise MlxLatticeError(
            f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}."
        )
    if x.dtype == _F32 and residual.dtype == _F32 and mx.default_device() == mx.cpu:
        return ext.bias_relu_add(x, bias, residual, relu=bool(relu))
    return bias_relu(x, bias, relu=relu) + residual


_UNIT_STATS: dict[int, tuple[mx.array, mx.array]] = {}


def _unit_stats(c: int) -> tuple[mx.array, mx.array]:
    stats = _UNIT_STATS.get(c)
    if stats is None:
        stats = _UNIT_STATS[c] = (mx.zeros((c,), _F32), mx.ones((c,), _F32))
    return stats


_IDENTITY: OrderedDict[int, KernelRelation] = OrderedDict()
_IDENTITY_KEEP = 8


def identity_relation(n: int) -> KernelRelation:
    """The 1x1x1 relation joining row ``i`` to row ``i`` of an ``n``-row set
    (the last few sizes are kept).

    >>> identity_relation(3).n_edges
    3
    """
    if not isinstance(n, int | np.integer) or n < 1:
        raise MlxLatticeError(f"n must be an int >= 1, got {n!r}.")
    n = int(n)
    rel = _IDENTITY.get(n)
    if rel is not None:
        _IDENTITY.move_to_end(n)
        return rel
    i = np.arange(n, dtype=np.int64)
    coords = np.stack(
        [np.zeros_like(i), i & 1023, (i >> 10) & 1023, i >> 20], axis=1
    ).astype(np.int32)
    rel = build_kernel_relation(coords, kernel_size=1)
    _IDENTITY[n] = rel
    while len(_IDENTITY) > _IDENTITY_KEEP:
        _IDENTITY.popitem(last=False)
    return rel


def dense_linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """``x @ weight.T (+ bias)`` for a plain ``(N, Cin)`` array, ``weight``
    ``(Cout, Cin)``, through the native GEMM kernels (a 1x1x1 convolution over
    :func:`identity_relation`), in ``x``'s dtype.

    >>> dense_linear(mx.array([[1.0, 2.0]]), mx.array([[1.0, 1.0], [0.0, 3.0]]), mx.array([0.5, 0.0])).tolist()
    [[3.5, 6.0]]
    """
    if x.ndim != 2 or weight.ndim != 2 or int(weight.shape[1]) != int(x.shape[1]):
        raise MlxLatticeError(
            f"x must be (N, Cin) and weight (Cout, Cin), got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}."
        )
    if int(x.shape[0]) == 0:
        out = mx.zeros((0, int(weight.shape[0])), dtype=x.dtype)
    else:
        mapped = mx.contiguous(weight.T.astype(x.dtype))[None]  # (K=1, Cin, Cout)
        out = core_ops.sparse_conv_features_from_relation(
            x, mapped, identity_relation(int(x.shape[0]))
        )
    if bias is not None:
        out = out + bias.astype(out.dtype)
    return out


def add(a: mx.array, b: mx.array) -> mx.array:
    """``a + b`` for same-shaped float32, float16 or bfloat16 arrays, in their
    dtype: each sum is computed in float32 and rounded once (round to nearest
    even), which for float16 and bfloat16 is the correctly rounded IEEE sum
    (for float16 the bits of NumPy's float16 add, signed zeros and
    infinities included). No broadcasting. On the CPU and on Apple GPUs a
    native primitive (F16C conversions of blocks on x86; a Metal kernel);
    elsewhere ``a + b``. Differentiable in both (the cotangent passes to
    each); ``mx.compile``, ``jvp`` and ``vmap`` work. Bad arguments raise
    ``ValueError`` naming them.

    >>> add(mx.array([1.0, 2.0], dtype=mx.float16), mx.array([0.5, -2.0], dtype=mx.float16)).tolist()
    [1.5, 0.0]
    """
    for name, v in (("a", a), ("b", b)):
        if not isinstance(v, mx.array):
            raise MlxLatticeError(f"{name} must be an mx.array, got {type(v).__name__}.")
        if v.dtype not in _FLOATS:
            raise MlxLatticeError(f"{name} must be float32, float16 or bfloat16, got {v.dtype}.")
    if b.dtype != a.dtype:
        raise MlxLatticeError(f"b must have a's dtype {a.dtype}, got {b.dtype}.")
    if b.shape != a.shape:
        raise MlxLatticeError(f"b must have a's shape {tuple(a.shape)}, got {tuple(b.shape)}.")
    if mx.default_device() == mx.cpu or mx.metal.is_available():
        return ext.feature_add(a, b)
    return a + b
