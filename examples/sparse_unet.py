"""A MinkUNet-style sparse U-Net: an encoder of strided stages, a decoder of
transposed convolutions back onto the encoder's coordinates with skip
connections, and a per-voxel classification head.

Module paths (as ``quantrules`` sees them): ``stem/conv``,
``encoder/block1/down``, ``encoder/block1/conv``, ..., ``decoder/block3/up``,
``decoder/block3/conv``, ..., ``head``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as mnn

from mlx_lattice import SparseTensor, nn, ops

__all__ = ["DecoderStage", "EncoderStage", "SparseUNet", "Unit"]


class Unit(mnn.Module):
    """Submanifold 3x3x3 conv, batch norm, ReLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.SubMConv3d(cin, cout, 3, bias=False)
        self.norm = nn.BatchNorm(cout)

    def __call__(self, x: SparseTensor) -> SparseTensor:
        return ops.relu(self.norm(self.conv(x)))


class EncoderStage(mnn.Module):
    """Strided 2x2x2 conv to the coarser grid, then a unit."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.down = nn.Conv3d(cin, cout, kernel_size=2, stride=2, bias=False)
        self.down_norm = nn.BatchNorm(cout)
        self.conv = nn.SubMConv3d(cout, cout, 3, bias=False)
        self.norm = nn.BatchNorm(cout)

    def __call__(self, x: SparseTensor, trace: dict | None = None) -> SparseTensor:
        x = ops.relu(self.down_norm(_traced(self.down, x, trace, "down")))
        return ops.relu(self.norm(_traced(self.conv, x, trace, "conv")))


class DecoderStage(mnn.Module):
    """Transposed 2x2x2 conv onto the finer (encoder) coordinates, skip
    concatenation, then a unit."""

    def __init__(self, cin: int, cskip: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose3d(cin, cout, kernel_size=2, stride=2, bias=False)
        self.up_norm = nn.BatchNorm(cout)
        self.conv = nn.SubMConv3d(cout + cskip, cout, 3, bias=False)
        self.norm = nn.BatchNorm(cout)

    def __call__(
        self, x: SparseTensor, skip: SparseTensor, trace: dict | None = None
    ) -> SparseTensor:
        x = ops.relu(self.up_norm(_traced(self.up, x, trace, "up")))
        x = ops.cat(x, skip)
        return ops.relu(self.norm(_traced(self.conv, x, trace, "conv")))


def _traced(layer: mnn.Module, x: SparseTensor, trace: dict | None, name: str) -> SparseTensor:
    """Run ``layer``; with a trace, evaluate it and record output and time."""
    if trace is None:
        return layer(x)
    start = time.perf_counter()
    out = layer(x)
    mx.eval(out.feats)
    trace[f"{trace['prefix']}/{name}"] = (out.feats, time.perf_counter() - start)
    return out


class _Stages(mnn.Module):
    def __init__(self, stages: Sequence[mnn.Module]) -> None:
        super().__init__()
        for i, stage in enumerate(stages):
            setattr(self, f"block{i + 1}", stage)

    def stages(self) -> list:
        return [self[f"block{i + 1}"] for i in range(len(self))]


class SparseUNet(mnn.Module):
    """Encoder-decoder over ``len(widths) - 1`` levels.

    >>> import numpy as np
    >>> x = SparseTensor(mx.array(np.array([[0, i, j, 0] for i in range(4) for j in range(4)], np.int32)),
    ...                  mx.ones((16, 1)))
    >>> SparseUNet(1, 5, widths=(4, 8, 8)).eval()(x).feats.shape
    (16, 5)
    """

    def __init__(
        self, in_channels: int = 1, num_classes: int = 4, widths: Sequence[int] = (16, 32, 64, 96)
    ) -> None:
        super().__init__()
        widths = tuple(widths)
        self.stem = Unit(in_channels, widths[0])
        self.encoder = _Stages(
            [EncoderStage(a, b) for a, b in itertools.pairwise(widths)]
        )
        ups = []
        for level in range(len(widths) - 1, 0, -1):
            cin = widths[level]
            ups.append(DecoderStage(cin, widths[level - 1], widths[level - 1]))
        self.decoder = _Stages(ups)
        self.head = nn.Linear(widths[0], num_classes)

    def __call__(self, x: SparseTensor, trace: dict | None = None) -> SparseTensor:
        if trace is not None:
            trace["prefix"] = "stem"
        x = (
            self.stem(x)
            if trace is None
            else ops.relu(self.stem.norm(_traced(self.stem.conv, x, trace, "conv")))
        )
        skips = [x]
        for i, stage in enumerate(self.encoder.stages()):
            if trace is not None:
                trace["prefix"] = f"encoder/block{i + 1}"
            x = stage(x, trace)
            skips.append(x)
        skips.pop()
        for i, stage in enumerate(self.decoder.stages()):
            if trace is not None:
                trace["prefix"] = f"decoder/block{i + 1}"
            x = stage(x, skips.pop(), trace)
        if trace is not None:
            trace["prefix"] = ""
            start = time.perf_counter()
            out = self.head(x)
            mx.eval(out.feats)
            trace["head"] = (out.feats, time.perf_counter() - start)
            trace.pop("prefix")
            return out
        return self.head(x)
