"""Sparse layers as ``mlx.nn.Module`` subclasses.

Parameters are plain ``mx.array`` attributes, so ``save_weights`` /
``load_weights``, ``mlx.optimizers`` and ``nn.value_and_grad`` work as for
any MLX model. Convolution weights are ``(Cout, kx, ky, kz, Cin)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as mlx_nn

from mlx_lattice import ops
from mlx_lattice.core.quantized import QuantizedWeight
from mlx_lattice.core.relations import normalize_triple
from mlx_lattice.tensor import SparseTensor

__all__ = [
    "GELU",
    "AvgPool3d",
    "BatchNorm",
    "Conv3d",
    "ConvTranspose3d",
    "Dropout",
    "Features",
    "GlobalAvgPool",
    "GlobalMaxPool",
    "GlobalSumPool",
    "LayerNorm",
    "LeakyReLU",
    "Linear",
    "MaxPool3d",
    "QuantizedConv",
    "RMSNorm",
    "ReLU",
    "Sequential",
    "SiLU",
    "Sigmoid",
    "Softplus",
    "SubMConv3d",
    "Tanh",
    "is_sparse_conv",
]


@dataclass(frozen=True)
class ConvConfig:
    """Static settings of a convolution layer (kept out of the parameter tree)."""

    in_channels: int
    out_channels: int
    kernel_size: tuple[int, int, int]
    stride: tuple[int, int, int]
    dilation: tuple[int, int, int]
    kind: str  # "conv", "subm", "transpose", "generative"


@dataclass(frozen=True)
class QuantSettings:
    """How a :class:`QuantizedConv` weight is packed."""

    group_size: int
    bits: int
    storage_in_channels: int


@dataclass(frozen=True)
class PoolConfig:
    """Window of a pooling layer."""

    kernel_size: tuple[int, int, int]
    stride: tuple[int, int, int]


def _init_weight(config: ConvConfig) -> mx.array:
    k = config.kernel_size
    scale = math.sqrt(1.0 / (config.in_channels * k[0] * k[1] * k[2]))
    return mx.random.uniform(-scale, scale, (config.out_channels, *k, config.in_channels))


class _SparseConv(mlx_nn.Module):
    def __init__(self, config: ConvConfig, bias: bool) -> None:
        super().__init__()
        self.config = config
        self.weight = _init_weight(config)
        if bias:
            self.bias = mx.zeros((config.out_channels,))

    def _weight(self) -> mx.array | QuantizedWeight:
        return self.weight

    def __call__(self, x: SparseTensor) -> SparseTensor:
        c = self.config
        bias = self.get("bias")
        weight = self._weight()
        if c.kind == "subm":
            return ops.subm_conv3d(x, weight, bias, dilation=c.dilation, kernel_size=c.kernel_size)
        if c.kind == "conv":
            return ops.conv3d(
                x, weight, bias, stride=c.stride, dilation=c.dilation, kernel_size=c.kernel_size
            )
        if c.kind == "transpose":
            return ops.conv_transpose3d(
                x, weight, bias, stride=c.stride, dilation=c.dilation, kernel_size=c.kernel_size
            )
        return ops.generative_conv_transpose3d(
            x, weight, bias, stride=c.stride, kernel_size=c.kernel_size
        )

    def _extra_repr(self) -> str:
        c = self.config
        return (
            f"{c.in_channels}, {c.out_channels}, kernel_size={c.kernel_size}, stride={c.stride}, "
            f"dilation={c.dilation}, bias={'bias' in self}"
        )


class Conv3d(_SparseConv):
    """Sparse convolution; ``stride`` > 1 moves to the coarser grid.

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0], [0, 1, 1, 0]], dtype=mx.int32), mx.ones((2, 3)))
    >>> Conv3d(3, 8, kernel_size=2, stride=2)(x).tensor_stride
    (2, 2, 2)
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int] = 3,
        stride: int | Sequence[int] = 1,
        dilation: int | Sequence[int] = 1,
        bias: bool = True,
    ) -> None:
        super().__init__(
            ConvConfig(
                in_channels,
                out_channels,
                normalize_triple(kernel_size, "kernel_size", high=7),
                normalize_triple(stride, "stride"),
                normalize_triple(dilation, "dilation"),
                "conv",
            ),
            bias,
        )


class SubMConv3d(_SparseConv):
    """Submanifold convolution: outputs exactly at the input coordinates."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int] = 3,
        dilation: int | Sequence[int] = 1,
        bias: bool = True,
    ) -> None:
        super().__init__(
            ConvConfig(
                in_channels,
                out_channels,
                normalize_triple(kernel_size, "kernel_size", high=7),
                (1, 1, 1),
                normalize_triple(dilation, "dilation"),
                "subm",
            ),
            bias,
        )


class ConvTranspose3d(_SparseConv):
    """Transposed convolution to the finer grid: onto the coordinates the
    matching strided layer came from, or (``generative=True``) onto new ones."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int] = 2,
        stride: int | Sequence[int] = 2,
        dilation: int | Sequence[int] = 1,
        bias: bool = True,
        generative: bool = False,
    ) -> None:
        super().__init__(
            ConvConfig(
                in_channels,
                out_channels,
                normalize_triple(kernel_size, "kernel_size", high=7),
                normalize_triple(stride, "stride"),
                normalize_triple(dilation, "dilation"),
                "generative" if generative else "transpose",
            ),
            bias,
        )


class QuantizedConv(_SparseConv):
    """A convolution layer with group-affine quantized weights (inference).

    Made by :func:`mlx_lattice.quantize` (or :meth:`from_conv`); the packed
    weight, scales and biases are arrays of the module, so they save and load
    with the model. The layer is frozen.
    """

    def __init__(self, config: ConvConfig, weight: QuantizedWeight, bias: mx.array | None) -> None:
        mlx_nn.Module.__init__(self)
        self.config = config
        self.weight = weight.weight
        self.scales = weight.scales
        self.biases = weight.biases
        self.quantization = QuantSettings(
            weight.group_size, weight.bits, weight.storage_in_channels
        )
        if bias is not None:
            self.bias = bias
        self.freeze()

    @classmethod
    def from_conv(cls, conv: _SparseConv, *, bits: int = 4, group_size: int = 64) -> QuantizedConv:
        """Quantize a float convolution layer's weight."""
        qw = QuantizedWeight.from_float(conv.weight, bits=bits, group_size=group_size)
        return cls(conv.config, qw, conv.get("bias"))

    def _weight(self) -> QuantizedWeight:
        q = self.quantization
        group_size, bits, storage = q.group_size, q.bits, q.storage_in_channels
        return QuantizedWeight(
            self.weight,
            self.scales,
            self.biases,
            self.config.in_channels,
            self.config.out_channels,
            storage,
            group_size,
            bits,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight, scales and biases."""
        return self._weight().nbytes


def is_sparse_conv(module: mlx_nn.Module) -> bool:
    """Whether ``module`` is one of this module's convolution layers."""
    return isinstance(module, _SparseConv)


class _Pool(mlx_nn.Module):
    _mode = "max"

    def __init__(
        self, kernel_size: int | Sequence[int] = 2, stride: int | Sequence[int] = 2
    ) -> None:
        super().__init__()
        self.window = PoolConfig(
            normalize_triple(kernel_size, "kernel_size", high=7), normalize_triple(stride, "stride")
        )

    def __call__(self, x: SparseTensor) -> SparseTensor:
        fn = ops.max_pool3d if self._mode == "max" else ops.avg_pool3d
        return fn(x, self.window.kernel_size, self.window.stride)


class MaxPool3d(_Pool):
    """Max pooling over the present inputs of each window."""

    _mode = "max"


class AvgPool3d(_Pool):
    """Average pooling over the present inputs of each window."""

    _mode = "avg"


class BatchNorm(mlx_nn.BatchNorm):
    """``mlx.nn.BatchNorm`` over the features of a sparse tensor (statistics
    over all points of the batch; ``train()`` / ``eval()`` as usual)."""

    def __call__(self, x: SparseTensor) -> SparseTensor:  # type: ignore[override]
        return x.replace(super().__call__(x.feats))


class ReLU(mlx_nn.Module):
    """ReLU of the features."""

    def __call__(self, x: SparseTensor) -> SparseTensor:
        return ops.relu(x)


class Linear(mlx_nn.Linear):
    """``mlx.nn.Linear`` over the features (a 1x1x1 convolution); also takes plain arrays."""

    def __call__(self, x: SparseTensor | mx.array) -> SparseTensor | mx.array:  # type: ignore[override]
        if isinstance(x, SparseTensor):
            return x.replace(super().__call__(x.feats))
        return super().__call__(x)


# -- feature layers --------------------------------------------------------------------------


class GELU(mlx_nn.Module):
    """GELU of the features, exact (``approximate="none"``) or the tanh form."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}.")
        self._approximate = approximate

    def __call__(self, x: SparseTensor) -> SparseTensor:
        return ops.gelu(x, self._approximate)  # type: ignore[arg-type]


class SiLU(mlx_nn.Module):
    """SiLU (swish) of the features."""

    def __call__(self, x: SparseTensor) -> SparseTensor:
        return ops.silu(x)


class LeakyReLU(mlx_nn.Module):
    """Leaky ReLU of the features."""

    def __init__(self, negative_slope: float = 0.01) -> None:
        super().__init__()
        self._negative_slope = float(negative_slope)

    def __call__(self, x: SparseTensor) -> SparseTensor:
        return ops.leaky_relu(x, self._negative_slope)


class Sigmoid(mlx_nn.Module):
    """Logistic sigmoid of the features."""

    def __call__(self, x: SparseTensor) -> SparseTensor:
        return ops.sigmoid(x)


class Tanh(mlx_nn.Module):
    """Hyperbolic tangent of the features."""

    def __call__(self, x: SparseTensor) -> SparseTensor:
        return ops.tanh(x)


class Softplus(mlx_nn.Module):
    """``log(1 + exp(beta * x)) / beta`` of the features."""

    def __init__(self, beta: float = 1.0) -> None:
        super().__init__()
        if not beta > 0:
            raise ValueError(f"beta must be positive, got {beta!r}.")
        self._beta = float(beta)

    def __call__(self, x: SparseTensor) -> SparseTensor:
        return ops.softplus(x, self._beta)


class Dropout(mlx_nn.Module):
    """Dropout of feature entries while training; the identity after ``eval()``."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability p must be in [0, 1), got {p!r}.")
        self._p = float(p)

    def __call__(self, x: SparseTensor) -> SparseTensor:
        return ops.dropout(x, self._p, training=self.training)


class LayerNorm(mlx_nn.LayerNorm):
    """``mlx.nn.LayerNorm`` over each point's channels (parameters ``weight``, ``bias``)."""

    def __call__(self, x: SparseTensor | mx.array) -> SparseTensor | mx.array:  # type: ignore[override]
        if isinstance(x, SparseTensor):
            return x.replace(super().__call__(x.feats))
        return super().__call__(x)


class RMSNorm(mlx_nn.RMSNorm):
    """``mlx.nn.RMSNorm`` over each point's channels (parameter ``weight``)."""

    def __call__(self, x: SparseTensor | mx.array) -> SparseTensor | mx.array:  # type: ignore[override]
        if isinstance(x, SparseTensor):
            return x.replace(super().__call__(x.feats))
        return super().__call__(x)


class Features(mlx_nn.Module):
    """Apply any array -> array layer (e.g. an ``mlx.nn`` module) to the features,
    so it can sit in an ``mlx.nn.Sequential`` of sparse layers.

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0]], dtype=mx.int32), mx.array([[-2.0]]))
    >>> mlx_nn.Sequential(Features(mlx_nn.ReLU()), Sigmoid())(x).feats.item()
    0.5
    """

    def __init__(self, layer: mlx_nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def __call__(self, x: SparseTensor) -> SparseTensor:
        return x.replace(self.layer(x.feats))


#: ``mlx.nn.Sequential`` works with sparse layers as is (each layer gets the
#: previous one's ``SparseTensor``); re-exported for convenience.
Sequential = mlx_nn.Sequential


# -- global pooling --------------------------------------------------------------------------


class _GlobalPool(mlx_nn.Module):
    def __init__(self, batch_size: int | None = None) -> None:
        super().__init__()
        self._batch_size = batch_size


class GlobalSumPool(_GlobalPool):
    """``(B, C)`` per-batch sums (see :func:`mlx_lattice.ops.global_sum_pool`)."""

    def __call__(self, x: SparseTensor) -> mx.array:
        return ops.global_sum_pool(x, self._batch_size)


class GlobalAvgPool(_GlobalPool):
    """``(B, C)`` per-batch means; empty entries get 0."""

    def __call__(self, x: SparseTensor) -> mx.array:
        return ops.global_avg_pool(x, self._batch_size)


class GlobalMaxPool(_GlobalPool):
    """``(B, C)`` per-batch maxima; empty entries get ``empty`` (default 0, ``None`` raises)."""

    def __init__(self, batch_size: int | None = None, empty: float | None = 0.0) -> None:
        super().__init__(batch_size)
        self._empty = empty

    def __call__(self, x: SparseTensor) -> mx.array:
        return ops.global_max_pool(x, self._batch_size, empty=self._empty)
