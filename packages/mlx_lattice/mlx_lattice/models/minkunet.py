"""MinkUNet: a sparse U-Net for per-voxel segmentation.

An encoder of strided 2x2x2 stages, a decoder of transposed convolutions back
onto the encoder's coordinates with skip concatenation, and a per-voxel
classification head. Every stage ends with ``depth`` submanifold 3x3x3
units (conv, batch norm, ReLU).

Module paths (as ``quantrules`` sees them): ``stem/conv``,
``encoder/block1/down``, ``encoder/block1/conv``, ``encoder/block1/conv2``
(depth 2), ..., ``decoder/block1/up``, ``decoder/block1/conv``, ...,
``head``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as mlx_nn

from mlx_lattice import fused, nn, ops
from mlx_lattice.tensor import SparseTensor, SparseTensorError

__all__ = ["DecoderStage", "EncoderStage", "FloatBatchNorm", "MinkUNet", "Stem", "Trace"]

#: Per traced layer: its output features and the seconds it took (evaluated).
Trace = dict


class FloatBatchNorm(nn.BatchNorm):
    """Batch norm whose statistics and affine map run in float32 whatever the
    features' dtype; the result comes back in the input dtype. In training on
    float32 features ``relu`` is one fused step with a closed-form backward
    pass (:func:`mlx_lattice.fused.batch_norm_train`).

    MLX's CPU half-precision elementwise ops are several times slower than
    float32 ones, and float16 batch statistics lose precision; one cast each
    way is cheaper than the norm in float16. (Now the behaviour of
    :class:`mlx_lattice.nn.BatchNorm` itself; kept as the model's named type.)
    """


def _run(layer: mlx_nn.Module, x, trace: Trace | None, path: str):  # noqa: ANN001
    """Run ``layer`` on a tensor or array; with a trace, evaluate it and
    record its output features and time."""
    if trace is None:
        return layer(x)
    start = time.perf_counter()
    out = layer(x)
    feats = out.feats if isinstance(out, SparseTensor) else out
    mx.eval(feats)
    trace[path] = (feats, time.perf_counter() - start)
    return out


_HALF = (mx.float16, mx.bfloat16)


@mx.custom_function
def _fork(x: mx.array) -> tuple[mx.array, mx.array]:
    return x, x


@_fork.vjp
def _fork_vjp(primals: tuple, cotangents: tuple, outputs: tuple) -> tuple[mx.array]:
    a, b = cotangents
    return (fused.add(a, b),)


def _skip(x: SparseTensor) -> tuple[SparseTensor, SparseTensor]:
    """``(x, x)`` for a U-Net skip: the tensor goes on down the encoder and
    across to the decoder. Autodiff sums the two gradients; for
    half-precision features on the CPU that sum is
    :func:`mlx_lattice.fused.add` (native, the correctly rounded sum: the
    bits of MLX's half-precision add, ~7x faster)."""
    if x.dtype not in _HALF or mx.default_device() != mx.cpu or x.num_points == 0:
        return x, x
    down, across = _fork(x.feats)
    return x.replace(down), x.replace(across)


def _check_depth(depth: int) -> int:
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise SparseTensorError(f"depths must be ints >= 1, got {depth!r}.")
    return depth


class _Units(mlx_nn.Module):
    """``depth`` submanifold units named ``conv``/``norm``, ``conv2``/``norm2``, ..."""

    def _add_units(self, cin: int, cout: int, depth: int) -> None:
        self.depth = _check_depth(depth)
        for i in range(depth):
            suffix = "" if i == 0 else str(i + 1)
            setattr(
                self, "conv" + suffix, nn.SubMConv3d(cin if i == 0 else cout, cout, 3, bias=False)
            )
            setattr(self, "norm" + suffix, FloatBatchNorm(cout))

    def _units(self, x: SparseTensor, trace: Trace | None, prefix: str) -> SparseTensor:
        for i in range(self.depth):
            suffix = "" if i == 0 else str(i + 1)
            x = _run(self["conv" + suffix], x, trace, f"{prefix}conv{suffix}")
            x = self["norm" + suffix].relu(x)
        return x


class Stem(_Units):
    """Submanifold units at the input resolution."""

    def __init__(self, cin: int, cout: int, depth: int = 1) -> None:
        super().__init__()
        self._add_units(cin, cout, depth)

    def __call__(
        self, x: SparseTensor, trace: Trace | None = None, prefix: str = ""
    ) -> SparseTensor:
        return self._units(x, trace, prefix)


class EncoderStage(_Units):
    """Strided 2x2x2 conv to the coarser grid, then ``depth`` units."""

    def __init__(self, cin: int, cout: int, depth: int = 1) -> None:
        super().__init__()
        self.down = nn.Conv3d(cin, cout, kernel_size=2, stride=2, bias=False)
        self.down_norm = FloatBatchNorm(cout)
        self._add_units(cout, cout, depth)

    def __call__(
        self, x: SparseTensor, trace: Trace | None = None, prefix: str = ""
    ) -> SparseTensor:
        x = self.down_norm.relu(_run(self.down, x, trace, prefix + "down"))
        return self._units(x, trace, prefix)


class DecoderStage(_Units):
    """Transposed 2x2x2 conv onto the finer (encoder) coordinates, skip
    concatenation, then ``depth`` units."""

    def __init__(self, cin: int, cskip: int, cout: int, depth: int = 1) -> None:
        super().__init__()
        self.up = nn.ConvTranspose3d(cin, cout, kernel_size=2, stride=2, bias=False)
        self.up_norm = FloatBatchNorm(cout)
        self._add_units(cout + cskip, cout, depth)

    def __call__(
        self, x: SparseTensor, skip: SparseTensor, trace: Trace | None = None, prefix: str = ""
    ) -> SparseTensor:
        x = self.up_norm.relu(_run(self.up, x, trace, prefix + "up"))
        return self._units(ops.cat(x, skip), trace, prefix)


class _Stages(mlx_nn.Module):
    def __init__(self, stages: Sequence[mlx_nn.Module]) -> None:
        super().__init__()
        self.count = len(stages)
        for i, stage in enumerate(stages):
            setattr(self, f"block{i + 1}", stage)

    def stages(self) -> list:
        return [self[f"block{i + 1}"] for i in range(self.count)]


def _depths(depths: int | Sequence[int], levels: int) -> tuple[int, ...]:
    if isinstance(depths, int):
        return (_check_depth(depths),) * levels
    out = tuple(_check_depth(d) for d in depths)
    if len(out) != levels:
        raise SparseTensorError(
            f"depths must be an int or one per level ({levels}, like widths), got {len(out)}."
        )
    return out


class MinkUNet(mlx_nn.Module):
    """Encoder-decoder over ``len(widths) - 1`` levels.

    Args:
        in_channels: input feature channels.
        num_classes: output channels of the per-voxel head.
        widths: channels per level, finest first (at least two levels).
        depths: submanifold units per level (an int for all levels, or one
            per level); the decoder stage of a level repeats its depth.

    >>> import numpy as np
    >>> x = SparseTensor(mx.array(np.array([[0, i, j, 0] for i in range(4) for j in range(4)], np.int32)),
    ...                  mx.ones((16, 2)))
    >>> model = MinkUNet(2, 5, widths=(4, 8, 8), depths=(1, 2, 1))
    >>> model.eval()(x).feats.shape
    (16, 5)
    >>> sorted(p for p, _ in model.named_modules() if p.endswith("conv2"))
    ['decoder.block1.conv2', 'encoder.block1.conv2']
    """

    def __init__(
        self,
        in_channels: int = 2,
        num_classes: int = 5,
        widths: Sequence[int] = (16, 32, 64, 96),
        depths: int | Sequence[int] = 1,
    ) -> None:
        super().__init__()
        widths = tuple(int(w) for w in widths)
        if len(widths) < 2 or min(widths) < 1:
            raise SparseTensorError(f"widths must be >= 2 positive ints, got {widths}.")
        if in_channels < 1 or num_classes < 1:
            raise SparseTensorError(
                f"in_channels and num_classes must be >= 1, got {in_channels} and {num_classes}."
            )
        depth = _depths(depths, len(widths))
        self.widths, self.depths = widths, depth
        self.in_channels, self.num_classes = int(in_channels), int(num_classes)
        self.stem = Stem(in_channels, widths[0], depth[0])
        self.encoder = _Stages(
            [
                EncoderStage(a, b, d)
                for (a, b), d in zip(itertools.pairwise(widths), depth[1:], strict=True)
            ]
        )
        self.decoder = _Stages(
            [
                DecoderStage(widths[level], widths[level - 1], widths[level - 1], depth[level - 1])
                for level in range(len(widths) - 1, 0, -1)
            ]
        )
        self.head = nn.Linear(widths[0], num_classes)

    def features(self, x: SparseTensor, trace: Trace | None = None) -> SparseTensor:
        """The decoder's last features (before the head), on ``x``'s coordinates."""
        x = self.stem(x, trace, "stem/")
        skips = []
        for i, stage in enumerate(self.encoder.stages()):
            x, skip = _skip(x)
            skips.append(skip)
            x = stage(x, trace, f"encoder/block{i + 1}/")
        for i, stage in enumerate(self.decoder.stages()):
            x = stage(x, skips.pop(), trace, f"decoder/block{i + 1}/")
        return x

    def __call__(self, x: SparseTensor, trace: Trace | None = None) -> SparseTensor:
        """Per-voxel class scores ``(N, num_classes)``.

        With a ``trace`` dict, every convolution and the head are evaluated
        one by one and their outputs and times recorded under their module paths.
        """
        return _run(self.head, self.features(x, trace), trace, "head")
