"""Sparse layers as ``mlx.nn.Module`` subclasses.

Parameters are plain ``mx.array`` attributes, so ``save_weights`` /
``load_weights``, ``mlx.optimizers`` and ``nn.value_and_grad`` work as for
any MLX model. Convolution weights are ``(Cout, kx, ky, kz, Cin)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as mlx_nn
import numpy as np

from mlx_lattice import fused, ops
from mlx_lattice._errors import MlxLatticeError, MlxLatticeTypeError
from mlx_lattice.core import ops as core_ops
from mlx_lattice.core.quantized import (
    SUPPORTED_BITS,
    SUPPORTED_GROUP_SIZES,
    QuantizedWeight,
    check_act_scale,
)
from mlx_lattice.core.relations import normalize_triple
from mlx_lattice.tensor import SparseTensor

__all__ = [
    "DENSE_NATIVE_ROWS",
    "GELU",
    "AvgPool3d",
    "BatchNorm",
    "Conv3d",
    "ConvTranspose3d",
    "Dropout",
    "Features",
    "GenerativeConvTranspose3d",
    "GlobalAvgPool",
    "GlobalMaxPool",
    "GlobalSumPool",
    "LayerNorm",
    "LeakyReLU",
    "Linear",
    "MaxPool3d",
    "NormalizedConvTranspose3d",
    "NormalizedGenerativeConvTranspose3d",
    "NormalizedSubMConv3d",
    "PoolTranspose3d",
    "QuantizedConv",
    "QuantizedLinear",
    "RMSNorm",
    "ReLU",
    "Sequential",
    "SiLU",
    "Sigmoid",
    "Softplus",
    "SubMConv3d",
    "SumPool3d",
    "Tanh",
    "TrilinearUpsample3d",
    "batch_norm_features",
    "fake_quantize_rows",
    "is_sparse_conv",
    "to_quantized",
]


@dataclass(frozen=True)
class ConvConfig:
    """Static settings of a convolution layer (kept out of the parameter tree).

    ``padding`` ``None`` centres the window (see :func:`mlx_lattice.ops.conv3d`);
    ``eps`` is set on weight-normalized layers only.
    """

    in_channels: int
    out_channels: int
    kernel_size: tuple[int, int, int]
    stride: tuple[int, int, int]
    dilation: tuple[int, int, int]
    kind: str  # "conv", "subm", "transpose", "generative"
    padding: tuple[int, int, int] | None = None
    eps: float | None = None


@dataclass(frozen=True)
class QuantSettings:
    """How a :class:`QuantizedConv` / :class:`QuantizedLinear` is quantized.

    ``act_bits``: inputs are fake-quantized to signed ``act_bits`` integers
    per row (symmetric, dynamic) before the product; ``None`` keeps them float.
    ``act_static``: one calibrated static activation scale for every row
    instead (:class:`QuantizedConv` only).
    """

    group_size: int
    bits: int
    storage_in_channels: int
    act_bits: int | None = None
    act_static: bool = False


@dataclass(frozen=True)
class PoolConfig:
    """Window of a pooling layer."""

    kernel_size: tuple[int, int, int]
    stride: tuple[int, int, int]
    padding: tuple[int, int, int] | None = None
    dilation: tuple[int, int, int] = (1, 1, 1)


def _init_weight(config: ConvConfig) -> mx.array:
    k = config.kernel_size
    scale = math.sqrt(1.0 / (config.in_channels * k[0] * k[1] * k[2]))
    return mx.random.uniform(-scale, scale, (config.out_channels, *k, config.in_channels))


def _padding(padding: int | Sequence[int] | None) -> tuple[int, int, int] | None:
    return None if padding is None else normalize_triple(padding, "padding", low=0)


def _config(
    in_channels: int,
    out_channels: int,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int],
    dilation: int | Sequence[int],
    kind: str,
    padding: int | Sequence[int] | None = None,
    eps: float | None = None,
) -> ConvConfig:
    for name, value in (("in_channels", in_channels), ("out_channels", out_channels)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
            raise MlxLatticeError(f"{name} must be a positive int, got {value!r}.")
    if eps is not None and not eps >= 0:
        raise MlxLatticeError(f"eps must be >= 0, got {eps!r}.")
    return ConvConfig(
        int(in_channels),
        int(out_channels),
        normalize_triple(kernel_size, "kernel_size", high=7),
        normalize_triple(stride, "stride"),
        normalize_triple(dilation, "dilation"),
        kind,
        _padding(padding),
        eps,
    )


def fake_quantize_rows(x: mx.array, bits: int, *, scale: float | None = None) -> mx.array:
    """Symmetric dynamic quantize-dequantize of each row of ``x`` to signed ``bits``.

    ``scale = max|row| / (2**(bits-1) - 1)``, ``round(x / scale) * scale``;
    an all-zero row stays zero. This models an integer activation path; the
    arithmetic stays in float (the integer kernel is a separate issue). The
    gradient passes straight through (the identity), so layers before a
    fake-quantized one still train. A given ``scale`` (finite, > 0) is one
    static scale for every row; values beyond ``qmax * scale`` saturate.

    >>> fake_quantize_rows(mx.array([[1.0, -0.5, 0.26]]), 2).tolist()
    [[1.0, -0.0, 0.0]]
    >>> fake_quantize_rows(mx.array([[1.0, -0.5, 0.26]]), 2, scale=0.25).tolist()
    [[0.25, -0.25, 0.25]]
    """
    qmax = float(2 ** (bits - 1) - 1)
    if scale is not None:
        static = mx.array(check_act_scale(scale, "scale"), dtype=x.dtype)
        quantized = mx.clip(mx.round(x / static), -qmax, qmax) * static
        return x + mx.stop_gradient(quantized - x)
    if x.size == 0:
        return x  # no rows or no channels: nothing to quantize (an empty max can hang in MLX)
    scale = mx.max(mx.abs(x), axis=-1, keepdims=True) / qmax
    safe = mx.where(scale > 0, scale, mx.ones_like(scale))
    quantized = mx.clip(mx.round(x / safe), -qmax, qmax) * safe
    return x + mx.stop_gradient(quantized - x)


class _SparseConv(mlx_nn.Module):
    def __init__(self, config: ConvConfig, bias: bool) -> None:
        super().__init__()
        self.config = config
        self.weight = _init_weight(config)
        if bias:
            self.bias = mx.zeros((config.out_channels,))

    def _weight(self) -> mx.array | QuantizedWeight:
        return self.weight

    def _input(self, x: SparseTensor) -> SparseTensor:
        return x

    def __call__(self, x: SparseTensor, coordinates: ops.Coordinates | None = None) -> SparseTensor:
        c = self.config
        bias = self.get("bias")
        weight = self._weight()
        x = self._input(x)
        if c.eps is not None:
            if c.kind == "subm":
                if coordinates is not None:
                    raise MlxLatticeError(
                        "a submanifold layer's outputs are its inputs; no coordinates=."
                    )
                return ops.normalized_subm_conv3d(x, weight, bias, dilation=c.dilation, eps=c.eps)  # type: ignore[arg-type]
            fn = (
                ops.normalized_conv_transpose3d
                if c.kind == "transpose"
                else ops.normalized_generative_conv_transpose3d
            )
            return fn(
                x,
                weight,  # type: ignore[arg-type]
                bias,
                stride=c.stride,
                padding=c.padding,
                dilation=c.dilation,
                coordinates=coordinates,
                eps=c.eps,
            )
        if c.kind == "subm":
            if coordinates is not None:
                raise MlxLatticeError("a submanifold layer's outputs are its inputs; no coordinates=.")
            return ops.subm_conv3d(x, weight, bias, dilation=c.dilation, kernel_size=c.kernel_size)
        fn = {
            "conv": ops.conv3d,
            "transpose": ops.conv_transpose3d,
            "generative": ops.generative_conv_transpose3d,
        }[c.kind]
        return fn(
            x,
            weight,
            bias,
            stride=c.stride,
            padding=c.padding,
            dilation=c.dilation,
            kernel_size=c.kernel_size,
            coordinates=coordinates,
        )

    def to_quantized(
        self, *, bits: int = 4, group_size: int = 64, act_bits: int | None = None
    ) -> QuantizedConv:
        """This layer with its weight quantized (see :meth:`QuantizedConv.from_conv`)."""
        return QuantizedConv.from_conv(self, bits=bits, group_size=group_size, act_bits=act_bits)

    def _extra_repr(self) -> str:
        c = self.config
        return (
            f"{c.in_channels}, {c.out_channels}, kernel_size={c.kernel_size}, stride={c.stride}, "
            f"padding={c.padding}, dilation={c.dilation}, bias={'bias' in self}"
            + ("" if c.eps is None else f", eps={c.eps}")
        )


class Conv3d(_SparseConv):
    """Sparse convolution; ``stride`` > 1 moves to the coarser grid; ``padding``
    moves the window as in a dense convolution; call with ``coordinates=`` for
    an explicit output support (see :func:`mlx_lattice.ops.conv3d`).

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
        padding: int | Sequence[int] | None = None,
    ) -> None:
        super().__init__(
            _config(in_channels, out_channels, kernel_size, stride, dilation, "conv", padding),
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
        super().__init__(_config(in_channels, out_channels, kernel_size, 1, dilation, "subm"), bias)


class ConvTranspose3d(_SparseConv):
    """Transposed convolution to the finer grid: onto the coordinates the
    matching strided layer came from (or ``coordinates=`` at call time), or
    (``generative=True``, same as :class:`GenerativeConvTranspose3d`) onto new ones."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int] = 2,
        stride: int | Sequence[int] = 2,
        dilation: int | Sequence[int] = 1,
        bias: bool = True,
        generative: bool = False,
        padding: int | Sequence[int] | None = None,
    ) -> None:
        kind = "generative" if generative else "transpose"
        super().__init__(
            _config(in_channels, out_channels, kernel_size, stride, dilation, kind, padding), bias
        )


class GenerativeConvTranspose3d(_SparseConv):
    """Transposed convolution that creates its outputs (every input moved by
    every kernel offset at the finer stride); see
    :func:`mlx_lattice.ops.generative_conv_transpose3d`."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int] = 2,
        stride: int | Sequence[int] = 2,
        dilation: int | Sequence[int] = 1,
        bias: bool = True,
        padding: int | Sequence[int] | None = None,
    ) -> None:
        super().__init__(
            _config(
                in_channels, out_channels, kernel_size, stride, dilation, "generative", padding
            ),
            bias,
        )


class NormalizedSubMConv3d(_SparseConv):
    """Weight-normalized submanifold convolution
    (:func:`mlx_lattice.ops.normalized_subm_conv3d`; ``eps`` default ``1e-6``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int] = 3,
        dilation: int | Sequence[int] = 1,
        bias: bool = True,
        eps: float = 1e-6,
    ) -> None:
        super().__init__(
            _config(in_channels, out_channels, kernel_size, 1, dilation, "subm", None, eps), bias
        )


class NormalizedConvTranspose3d(_SparseConv):
    """Weight-normalized transposed convolution
    (:func:`mlx_lattice.ops.normalized_conv_transpose3d`; ``eps`` default ``1e-6``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int] = 2,
        stride: int | Sequence[int] = 2,
        dilation: int | Sequence[int] = 1,
        bias: bool = True,
        padding: int | Sequence[int] | None = None,
        eps: float = 1e-6,
    ) -> None:
        super().__init__(
            _config(
                in_channels, out_channels, kernel_size, stride, dilation, "transpose", padding, eps
            ),
            bias,
        )


class NormalizedGenerativeConvTranspose3d(_SparseConv):
    """Weight-normalized generative transposed convolution
    (:func:`mlx_lattice.ops.normalized_generative_conv_transpose3d`; ``eps`` default ``1e-6``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int] = 2,
        stride: int | Sequence[int] = 2,
        dilation: int | Sequence[int] = 1,
        bias: bool = True,
        padding: int | Sequence[int] | None = None,
        eps: float = 1e-6,
    ) -> None:
        super().__init__(
            _config(
                in_channels,
                out_channels,
                kernel_size,
                stride,
                dilation,
                "generative",
                padding,
                eps,
            ),
            bias,
        )


class QuantizedConv(_SparseConv):
    """A convolution layer with group-affine quantized weights (inference).

    Made by :func:`mlx_lattice.quantize` (or :meth:`from_conv`,
    :func:`to_quantized`); the packed weight, scales and biases are arrays of
    the module, so they save and load with the model. The layer is frozen.
    With ``act_bits`` the input features are quantized per row (symmetric,
    dynamic scale); with ``act_bits=8`` on the CPU the convolution runs the
    integer kernel (int8 activations x weight codes -> int32, a float
    epilogue), otherwise the features are fake-quantized
    (:func:`fake_quantize_rows`) before a float-activation convolution.

    ``act_static=True`` (with ``act_bits``): one static activation scale for
    every row, the array ``act_scale`` of the module (saved and loaded with
    the model; 0 until :func:`mlx_lattice.calibrate_activation_scales` sets
    it from the inputs of a few batches). The integer kernel then applies the
    scale once per output row instead of once per edge and skips the per-row
    maximum. Calling an uncalibrated layer raises ``ValueError``.
    """

    def __init__(
        self,
        config: ConvConfig,
        weight: QuantizedWeight,
        bias: mx.array | None,
        act_bits: int | None = None,
        act_static: bool = False,
    ) -> None:
        mlx_nn.Module.__init__(self)
        if config.eps is not None:
            raise MlxLatticeError("weight-normalized convolutions are not quantized (eps is set).")
        _check_act_bits(act_bits)
        if act_static and act_bits is None:
            raise MlxLatticeError("act_static (a static activation scale) needs act_bits.")
        self.config = config
        self.weight = weight.weight
        self.scales = weight.scales
        self.biases = weight.biases
        self.quantization = QuantSettings(
            weight.group_size, weight.bits, weight.storage_in_channels, act_bits, bool(act_static)
        )
        if act_static:
            # 0: not calibrated yet (a calibrated scale is > 0).
            self.act_scale = mx.array(0.0, dtype=mx.float32)
        if bias is not None:
            self.bias = bias
        self.freeze()

    @classmethod
    def from_conv(
        cls,
        conv: _SparseConv,
        *,
        bits: int = 4,
        group_size: int = 64,
        act_bits: int | None = None,
        act_static: bool = False,
    ) -> QuantizedConv:
        """Quantize a float convolution layer's weight (``Cin`` zero-padded to a
        multiple of ``group_size`` in storage)."""
        if isinstance(conv, QuantizedConv):
            raise MlxLatticeError("conv is already quantized.")
        qw = QuantizedWeight.from_float(conv.weight, bits=bits, group_size=group_size)
        return cls(conv.config, qw, conv.get("bias"), act_bits, act_static)

    def _integer_kernel(self) -> bool:
        # int8 activations run the native int8 x weight-code kernel on the CPU;
        # other widths, and other devices, fake-quantize in MLX ops.
        return self.quantization.act_bits == 8 and mx.default_device() == mx.cpu

    def _weight(self, *, for_call: bool = True) -> QuantizedWeight:
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
            act_bits=8 if self._integer_kernel() else None,
            act_scale=self._static_scale() if for_call and self._integer_kernel() else None,
        )

    def _static_scale(self) -> float | None:
        """The calibrated static activation scale (None: dynamic scales, or
        calibration in progress)."""
        if not self.quantization.act_static or id(self) in _calibration_maxima:
            return None
        value = float(self.act_scale.item())
        if value == 0.0:
            raise MlxLatticeError(
                "this QuantizedConv has a static activation scale that is not calibrated: run "
                "mlx_lattice.calibrate_activation_scales(model, batches) first (or load "
                "calibrated weights)."
            )
        return check_act_scale(value, "act_scale")

    def _input(self, x: SparseTensor) -> SparseTensor:
        bits = self.quantization.act_bits
        if bits is not None and id(self) in _calibration_maxima:
            peak = float(mx.max(mx.abs(x.feats)).item()) if x.feats.size else 0.0
            if not math.isfinite(peak):
                raise MlxLatticeError("calibration input has non-finite features.")
            _calibration_maxima[id(self)] = max(_calibration_maxima[id(self)], peak)
        if bits is None or self._integer_kernel():
            return x
        return x.replace(fake_quantize_rows(x.feats, bits, scale=self._static_scale()))

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight, scales and biases."""
        return self._weight(for_call=False).nbytes


# id(layer) -> max|input| seen, for the QuantizedConv layers being calibrated
# (calibrating_activations); they run with dynamic scales meanwhile.
_calibration_maxima: dict[int, float] = {}


@contextmanager
def calibrating_activations(layers: Sequence[QuantizedConv]) -> Iterator[dict[int, float]]:
    """Record max|input| of ``layers`` (by ``id``) while inside the block."""
    for layer in layers:
        _calibration_maxima[id(layer)] = 0.0
    try:
        yield _calibration_maxima
    finally:
        for layer in layers:
            _calibration_maxima.pop(id(layer), None)


def _check_act_bits(act_bits: int | None) -> None:
    if act_bits is not None and (
        not isinstance(act_bits, int) or isinstance(act_bits, bool) or not 2 <= act_bits <= 8
    ):
        raise MlxLatticeError(f"act_bits must be None or an int in [2, 8], got {act_bits!r}.")


def is_sparse_conv(module: mlx_nn.Module) -> bool:
    """Whether ``module`` is one of this module's convolution layers."""
    return isinstance(module, _SparseConv)


class _Pool(mlx_nn.Module):
    _mode = "max"

    def __init__(
        self,
        kernel_size: int | Sequence[int] = 2,
        stride: int | Sequence[int] = 2,
        padding: int | Sequence[int] | None = None,
        dilation: int | Sequence[int] = 1,
    ) -> None:
        super().__init__()
        self.window = PoolConfig(
            normalize_triple(kernel_size, "kernel_size", high=7),
            normalize_triple(stride, "stride"),
            _padding(padding),
            normalize_triple(dilation, "dilation"),
        )

    def __call__(self, x: SparseTensor) -> SparseTensor:
        w = self.window
        return ops.pool3d(
            x, w.kernel_size, w.stride, padding=w.padding, dilation=w.dilation, mode=self._mode
        )  # type: ignore[arg-type]


class MaxPool3d(_Pool):
    """Max pooling over the present inputs of each window (:func:`mlx_lattice.ops.pool3d`)."""

    _mode = "max"


class AvgPool3d(_Pool):
    """Average pooling over the present inputs of each window."""

    _mode = "avg"


class SumPool3d(_Pool):
    """Sum pooling over the present inputs of each window."""

    _mode = "sum"


class PoolTranspose3d(mlx_nn.Module):
    """Unpooling to the finer grid (:func:`mlx_lattice.ops.pool_transpose3d`);
    call with ``coordinates=`` for an explicit output support."""

    def __init__(
        self,
        kernel_size: int | Sequence[int] = 2,
        stride: int | Sequence[int] = 2,
        dilation: int | Sequence[int] = 1,
        mode: str = "sum",
    ) -> None:
        super().__init__()
        if mode not in ("max", "avg", "sum"):
            raise MlxLatticeError(f"mode must be 'max', 'avg' or 'sum', got {mode!r}.")
        self.window = PoolConfig(
            normalize_triple(kernel_size, "kernel_size", high=7),
            normalize_triple(stride, "stride"),
            None,
            normalize_triple(dilation, "dilation"),
        )
        self._mode = mode

    def __call__(self, x: SparseTensor, coordinates: ops.Coordinates | None = None) -> SparseTensor:
        w = self.window
        return ops.pool_transpose3d(
            x,
            w.kernel_size,
            w.stride,
            dilation=w.dilation,
            coordinates=coordinates,
            mode=self._mode,  # type: ignore[arg-type]
        )


class TrilinearUpsample3d(mlx_nn.Module):
    """Trilinear upsampling (:func:`mlx_lattice.ops.trilinear_upsample3d`): by
    ``stride``, or onto the ``target`` passed at call time."""

    def __init__(self, stride: int | Sequence[int] | None = None) -> None:
        super().__init__()
        self._stride = None if stride is None else normalize_triple(stride, "stride")

    def __call__(self, x: SparseTensor, target: SparseTensor | None = None) -> SparseTensor:
        if target is not None:
            return ops.trilinear_upsample3d(x, target)
        if self._stride is None:
            raise MlxLatticeError("TrilinearUpsample3d without a stride needs a target tensor.")
        return ops.trilinear_upsample3d(x, stride=self._stride)


def batch_norm_features(norm: mlx_nn.BatchNorm, f: mx.array, *, relu: bool = False) -> mx.array:
    """``norm(f)`` (an ``mlx.nn.BatchNorm``, its mode and running statistics
    honoured), then a ReLU if ``relu``, on a plain ``(N, C)`` array, computed
    in float32 and returned in ``f``'s dtype. In training, with an affine
    norm that tracks running statistics and at least two rows, this is
    :func:`mlx_lattice.fused.batch_norm_train` for float32, float16 and
    bfloat16 features alike (statistics once, closed-form backward; on the
    CPU native kernels that read and write the features' own dtype). In
    eval mode with running statistics it is
    :func:`mlx_lattice.fused.batch_norm_eval` (one native map in the
    features' dtype, the ReLU fused); otherwise ``mlx.nn.BatchNorm`` itself
    on float32 features.

    >>> batch_norm_features(mlx_nn.BatchNorm(1), mx.array([[1.0], [3.0]]), relu=True).round(4).tolist()
    [[0.0], [1.0]]

    A norm built for another channel count raises :class:`MlxLatticeError`
    (instead of broadcasting its statistics over the features), and so does
    training on fewer than two rows (no batch statistics).
    """
    channels = int(f.shape[-1]) if f.ndim else 0
    for name in ("weight", "bias", "running_mean", "running_var"):
        if name in norm and tuple(norm[name].shape) != (channels,):
            raise MlxLatticeError(
                f"BatchNorm {name} has shape {tuple(norm[name].shape)}, the features have "
                f"{channels} channels (shape {tuple(f.shape)})."
            )
    if norm.training and f.ndim == 2 and int(f.shape[0]) < 2:
        raise MlxLatticeError(
            f"BatchNorm training needs at least two rows (points) per channel, got {f.shape[0]}."
        )
    if (
        norm.training
        and f.dtype in (mx.float32, mx.float16, mx.bfloat16)
        and "weight" in norm
        and "running_mean" in norm
        and f.ndim == 2
        and int(f.shape[0]) > 1
    ):
        y, mean, var = fused.batch_norm_train(f, norm.weight, norm.bias, eps=norm.eps, relu=relu)
        n, mu = int(f.shape[0]), norm.momentum
        rm, rv = norm.running_mean, norm.running_var
        norm.running_mean = ((1 - mu) * rm + mu * mean).astype(rm.dtype)
        norm.running_var = ((1 - mu) * rv + mu * var * (n / (n - 1))).astype(rv.dtype)
        return y
    if (
        not norm.training
        and f.dtype in (mx.float32, mx.float16, mx.bfloat16)
        and "running_mean" in norm
        and f.ndim == 2
    ):
        return fused.batch_norm_eval(
            f,
            norm.running_mean,
            norm.running_var,
            norm.get("weight"),
            norm.get("bias"),
            eps=norm.eps,
            relu=relu,
        )
    if f.dtype in (mx.float16, mx.bfloat16):
        stats = {k: norm[k].dtype for k in ("running_mean", "running_var") if k in norm}
        y = mlx_nn.BatchNorm.__call__(norm, f.astype(mx.float32))
        for k, dtype in stats.items():
            norm[k] = norm[k].astype(dtype)
    else:
        y = mlx_nn.BatchNorm.__call__(norm, f)
    if relu:
        y = mx.maximum(y, 0)
    return y.astype(f.dtype)


class BatchNorm(mlx_nn.BatchNorm):
    """``mlx.nn.BatchNorm`` over the features of a sparse tensor (statistics
    over all points of the batch; ``train()`` / ``eval()`` as usual).

    Statistics and the affine map run in float32 whatever the features'
    dtype (MLX's CPU half-precision elementwise ops are several times slower
    than the casts, and half-precision statistics lose precision); the result
    comes back in the input dtype and running statistics keep their dtype. In
    training (affine, running statistics tracked) the norm runs as
    :func:`mlx_lattice.fused.batch_norm_train` for every float dtype: the
    statistics computed once and a closed-form backward pass; in eval mode
    (running statistics) :func:`mlx_lattice.fused.batch_norm_eval`, one
    native map in the features' dtype. :meth:`relu` fuses the ReLU that
    usually follows (see :func:`batch_norm_features`).

    >>> x = SparseTensor(mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32),
    ...                  mx.array([[1.0, -2.0], [3.0, 2.0]]))
    >>> BatchNorm(2).relu(x).feats.round(3).tolist()
    [[0.0, 0.0], [1.0, 1.0]]
    """

    def _forward(self, x: SparseTensor, relu: bool) -> SparseTensor:
        return x.replace(batch_norm_features(self, x.feats, relu=relu))

    def __call__(self, x: SparseTensor) -> SparseTensor:  # type: ignore[override]
        return self._forward(x, relu=False)

    def relu(self, x: SparseTensor) -> SparseTensor:
        """``relu(self(x))`` in one fused step (the ReLU in float32 too)."""
        return self._forward(x, relu=True)


class ReLU(mlx_nn.Module):
    """ReLU of the features."""

    def __call__(self, x: SparseTensor) -> SparseTensor:
        return ops.relu(x)


#: Plain ``(N, Cin)`` arrays with at least this many rows go through the
#: native GEMM in :class:`Linear` (below it ``mx.matmul`` is as fast).
DENSE_NATIVE_ROWS = 4096


class Linear(mlx_nn.Linear):
    """``mlx.nn.Linear`` over the features, run as a 1x1x1 sparse convolution
    (:func:`mlx_lattice.ops.linear`); plain 2-D float arrays of at least
    :data:`DENSE_NATIVE_ROWS` rows (SPVCNN's per-point layers) go through the
    same native kernels (:func:`mlx_lattice.fused.dense_linear`), other arrays
    through ``mlx.nn.Linear``."""

    def __call__(self, x: SparseTensor | mx.array) -> SparseTensor | mx.array:  # type: ignore[override]
        if isinstance(x, SparseTensor):
            return ops.linear(x, self.weight, self.get("bias"))
        return self._dense(x, with_bias=True)

    def without_bias(self, x: mx.array) -> mx.array:
        """``x @ weight.T`` for a plain array, by the route :meth:`__call__`
        takes, leaving out the bias (for a training-mode batch norm after
        it, which cancels the bias anyway).

        >>> layer = Linear(3, 2)
        >>> x = mx.ones((4, 3))
        >>> bool(mx.allclose(layer.without_bias(x) + layer.bias, layer(x)))
        True
        """
        return self._dense(x, with_bias=False)

    def _dense(self, x: mx.array, *, with_bias: bool) -> mx.array:
        if (
            x.ndim == 2
            and int(x.shape[0]) >= DENSE_NATIVE_ROWS
            and x.dtype in (mx.float32, mx.float16, mx.bfloat16)
        ):
            return fused.dense_linear(x, self.weight, self.get("bias") if with_bias else None)
        return super().__call__(x) if with_bias else x @ self.weight.T

    def to_quantized(  # type: ignore[override]
        self,
        group_size: int = 64,
        bits: int = 4,
        mode: str = "affine",
        *,
        act_bits: int | None = None,
    ) -> QuantizedLinear:
        """This layer as a :class:`QuantizedLinear` (affine mode only)."""
        if mode != "affine":
            raise MlxLatticeError(f"mlx_lattice quantized layers use mode 'affine', got {mode!r}.")
        return QuantizedLinear.from_linear(
            self, bits=bits, group_size=group_size, act_bits=act_bits
        )


class QuantizedLinear(mlx_nn.Module):
    """A linear layer with group-affine quantized weights (``mx.quantize``
    layout, groups along the input features; inputs zero-padded in storage to a
    multiple of ``group_size``), over features or plain arrays. Frozen; with
    ``act_bits`` the input is fake-quantized per row first.

    >>> layer = Linear(64, 8)
    >>> q = QuantizedLinear.from_linear(layer, bits=8, group_size=64)
    >>> x = mx.random.normal((5, 64))
    >>> bool(mx.abs(q(x) - layer(x)).max() < 0.05)
    True
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight: mx.array,
        scales: mx.array,
        biases: mx.array,
        bias: mx.array | None,
        settings: QuantSettings,
    ) -> None:
        super().__init__()
        _check_act_bits(settings.act_bits)
        self.in_features = in_features
        self.out_features = out_features
        self.weight, self.scales, self.biases = weight, scales, biases
        if bias is not None:
            self.bias = bias
        self.quantization = settings
        self.freeze()

    @classmethod
    def from_linear(
        cls,
        linear: mlx_nn.Linear,
        *,
        bits: int = 4,
        group_size: int = 64,
        act_bits: int | None = None,
    ) -> QuantizedLinear:
        """Quantize an ``mlx.nn.Linear`` (or :class:`Linear`) layer's weight."""
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise MlxLatticeError(
                f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}."
            )
        if bits not in SUPPORTED_BITS:
            raise MlxLatticeError(f"bits must be one of {SUPPORTED_BITS}, got {bits}.")
        w = linear.weight
        out_features, in_features = (int(d) for d in w.shape)
        storage = -(-in_features // group_size) * group_size
        if storage != in_features:
            w = mx.pad(w, [(0, 0), (0, storage - in_features)])
        packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
        settings = QuantSettings(group_size, bits, storage, act_bits)
        return cls(in_features, out_features, packed, scales, biases, linear.get("bias"), settings)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight, scales and biases."""
        return int(self.weight.nbytes + self.scales.nbytes + self.biases.nbytes)

    def _apply(self, x: mx.array) -> mx.array:
        q = self.quantization
        if int(x.shape[-1]) != self.in_features:
            raise MlxLatticeError(
                f"x has {x.shape[-1]} features but the layer expects {self.in_features}."
            )
        if q.act_bits is not None:
            x = fake_quantize_rows(x, q.act_bits)
        if q.storage_in_channels != self.in_features:
            pad = [(0, 0)] * (x.ndim - 1) + [(0, q.storage_in_channels - self.in_features)]
            x = mx.pad(x, pad)
        out = mx.quantized_matmul(
            x,
            self.weight,
            self.scales,
            self.biases,
            transpose=True,
            group_size=q.group_size,
            bits=q.bits,
        )
        bias = self.get("bias")
        return out if bias is None else out + bias

    def _pointwise(self, x: SparseTensor) -> mx.array:
        """Sparse features through the native quantized 1x1x1 convolution."""
        q = self.quantization
        if x.num_channels != self.in_features:
            raise MlxLatticeError(
                f"x has {x.num_channels} features but the layer expects {self.in_features}."
            )
        feats = x.feats if q.act_bits is None else fake_quantize_rows(x.feats, q.act_bits)
        weight = QuantizedWeight(
            self.weight[None],
            self.scales[None],
            self.biases[None],
            self.in_features,
            self.out_features,
            q.storage_in_channels,
            q.group_size,
            q.bits,
        )
        out = core_ops.sparse_quantized_conv_features_from_relation(
            feats, weight, ops.pointwise_relation(x)
        )
        bias = self.get("bias")
        return out if bias is None else out + bias.astype(out.dtype)

    def __call__(self, x: SparseTensor | mx.array) -> SparseTensor | mx.array:
        if isinstance(x, SparseTensor):
            return x.replace(self._pointwise(x))
        return self._apply(x)

    def _extra_repr(self) -> str:
        q = self.quantization
        return (
            f"{self.in_features}, {self.out_features}, bits={q.bits}, group_size={q.group_size}, "
            f"act_bits={q.act_bits}, bias={'bias' in self}"
        )


def to_quantized(
    layer: mlx_nn.Module, *, bits: int = 4, group_size: int = 64, act_bits: int | None = None
) -> mlx_nn.Module:
    """A quantized copy of one layer: a sparse convolution becomes a
    :class:`QuantizedConv`, a linear layer a :class:`QuantizedLinear`.

    For whole models use :func:`mlx_lattice.quantize` (rules per module path).

    >>> q = to_quantized(SubMConv3d(32, 16), bits=8, group_size=32)
    >>> type(q).__name__, q.quantization.bits
    ('QuantizedConv', 8)
    """
    if isinstance(layer, _SparseConv):
        return QuantizedConv.from_conv(layer, bits=bits, group_size=group_size, act_bits=act_bits)
    if isinstance(layer, mlx_nn.Linear):
        return QuantizedLinear.from_linear(
            layer, bits=bits, group_size=group_size, act_bits=act_bits
        )
    raise MlxLatticeTypeError(
        f"layer must be a sparse convolution or a linear layer, got {type(layer).__name__}."
    )


# -- feature layers --------------------------------------------------------------------------


class GELU(mlx_nn.Module):
    """GELU of the features, exact (``approximate="none"``) or the tanh form."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise MlxLatticeError(f"approximate must be 'none' or 'tanh', got {approximate!r}.")
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
            raise MlxLatticeError(f"beta must be positive, got {beta!r}.")
        self._beta = float(beta)

    def __call__(self, x: SparseTensor) -> SparseTensor:
        return ops.softplus(x, self._beta)


class Dropout(mlx_nn.Module):
    """Dropout of feature entries while training; the identity after ``eval()``."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise MlxLatticeError(f"dropout probability p must be in [0, 1), got {p!r}.")
        self._p = float(p)

    def __call__(self, x: SparseTensor) -> SparseTensor:
        return ops.dropout(x, self._p, training=self.training)


class LayerNorm(mlx_nn.LayerNorm):
    """``mlx.nn.LayerNorm`` over each point's channels (parameters ``weight``,
    ``bias``; :func:`mlx_lattice.ops.layer_norm`)."""

    def __call__(self, x: SparseTensor | mx.array) -> SparseTensor | mx.array:  # type: ignore[override]
        if isinstance(x, SparseTensor):
            return ops.layer_norm(x, self.get("weight"), self.get("bias"), eps=self.eps)
        return super().__call__(x)


class RMSNorm(mlx_nn.RMSNorm):
    """``mlx.nn.RMSNorm`` over each point's channels (parameter ``weight``;
    :func:`mlx_lattice.ops.rms_norm`)."""

    def __call__(self, x: SparseTensor | mx.array) -> SparseTensor | mx.array:  # type: ignore[override]
        if isinstance(x, SparseTensor):
            return ops.rms_norm(x, self.get("weight"), eps=self.eps)
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
