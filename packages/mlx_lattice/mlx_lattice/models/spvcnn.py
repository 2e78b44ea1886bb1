"""SPVCNN: a sparse U-Net with a point branch (point-voxel fusion).

Points carry their own features next to the voxel U-Net (MinkUNet's stem,
encoder and decoder). At three places the branches meet: after the stem,
at the coarsest level and after the decoder, the voxel features are
interpolated at the points (:func:`mlx_lattice.geometry.devoxelize`,
trilinear between voxel centres) and added to a per-point MLP of the point
features; the sum is averaged back onto the voxels
(:func:`mlx_lattice.geometry.voxelize`) for the next voxel stage. The head
scores every point, so predictions keep the points' full resolution. The
point branch runs in float32 whatever the voxels' dtype (half-precision
voxel features are interpolated as float32; the voxel means are rounded
back to the voxels' dtype once).

Module paths: those of :class:`MinkUNet` (``stem/conv``,
``encoder/block1/down``, ..., ``decoder/block3/conv``) plus
``point/mlp1/linear`` (fine -> coarsest width), ``point/mlp2/linear``
(coarsest -> fine width) and ``head``.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as mlx_nn
import numpy as np  # noqa: F401 (the doctests use it)

from mlx_lattice import nn
from mlx_lattice._pointcloud import PointCloudInput, point_cloud_input
from mlx_lattice.models.minkunet import MinkUNet, Trace, _run, _skip
from mlx_lattice.tensor import SparseTensorError

# Defined in mlx_lattice._pointcloud (which mlx_lattice.export runs without
# importing this package); public, and documented, here.
PointCloudInput.__module__ = point_cloud_input.__module__ = __name__

__all__ = ["SPVCNN", "PointBranch", "PointCloudInput", "point_cloud_input"]


class PointBranch(mlx_nn.Module):
    """Per-point Linear (native GEMM for large point sets), batch norm (in
    float32) and ReLU.

    In training mode the norm subtracts the batch mean, so the linear bias
    cancels from the output and its gradient is zero: the step skips the
    ``(P, cout)`` bias add (and its gradient's column sum) and adds the bias
    to the running mean's update instead, which stays that of the norm of
    ``linear(z)``. A quantized linear layer (``mlx_lattice.quantize``) keeps
    the plain path."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.linear = nn.Linear(cin, cout)
        self.norm = mlx_nn.BatchNorm(cout)

    def __call__(self, z: mx.array) -> mx.array:
        norm, bias = self.norm, self.linear.get("bias")
        plain = type(self.linear) is nn.Linear  # not a QuantizedLinear (packed codes)
        if not plain or not norm.training or bias is None or "running_mean" not in norm:
            return nn.batch_norm_features(norm, self.linear(z), relu=True).astype(z.dtype)
        h = self.linear.without_bias(z)
        y = nn.batch_norm_features(norm, h, relu=True)
        # batch_norm_features set running_mean = (1 - m) * rm + m * mean(h);
        # the norm of linear(z) = h + bias has mean(h) + bias.
        rm = norm.running_mean
        norm.running_mean = (rm + norm.momentum * mx.stop_gradient(bias)).astype(rm.dtype)
        return y.astype(z.dtype)


class _PointMLPs(mlx_nn.Module):
    def __init__(self, fine: int, coarse: int) -> None:
        super().__init__()
        self.mlp1 = PointBranch(fine, coarse)
        self.mlp2 = PointBranch(coarse, fine)


class SPVCNN(MinkUNet):
    """MinkUNet with a point branch fused at the stem, the coarsest level and
    the decoder's end; scores every point.

    >>> pts = np.random.default_rng(0).uniform(0, 2, (200, 3)).astype(np.float32)
    >>> inp = point_cloud_input(pts, np.ones((200, 2), np.float32), 0.25)
    >>> SPVCNN(2, 5, widths=(4, 8, 8)).eval()(inp).shape
    (200, 5)
    """

    def __init__(
        self,
        in_channels: int = 2,
        num_classes: int = 5,
        widths: Sequence[int] = (16, 32, 64, 96),
        depths: int | Sequence[int] = 1,
    ) -> None:
        super().__init__(in_channels, num_classes, widths, depths)
        self.point = _PointMLPs(self.widths[0], self.widths[-1])

    def __call__(self, inp: PointCloudInput, trace: Trace | None = None) -> mx.array:  # type: ignore[override]
        """Per-point class scores ``(P, num_classes)``."""
        if not isinstance(inp, PointCloudInput):
            raise SparseTensorError(
                f"SPVCNN takes a PointCloudInput (see point_cloud_input), got {type(inp).__name__}."
            )
        # The point branch runs in float32 whatever the voxels' dtype: on the
        # CPU MLX's half-precision elementwise ops and casts over the (P, C)
        # point arrays cost more than the float32 GEMMs and norms they feed.
        f32 = mx.float32
        x = self.stem(inp.tensor, trace, "stem/")
        z0 = inp.to_points(x, f32)
        x = inp.to_voxels(x, z0)
        # Each skip forks its tensor (MinkUNet's _skip): in half precision the
        # two gradients are summed natively, not by MLX's CPU half add.
        skips = []
        for i, stage in enumerate(self.encoder.stages()):
            x, skip = _skip(x)
            skips.append(skip)
            x = stage(x, trace, f"encoder/block{i + 1}/")
        z1 = inp.to_points(x, f32) + self.point.mlp1(z0)
        x = inp.to_voxels(x, z1)
        for i, stage in enumerate(self.decoder.stages()):
            x = stage(x, skips.pop(), trace, f"decoder/block{i + 1}/")
        z2 = inp.to_points(x, f32) + self.point.mlp2(z1)
        return _run(self.head, z2, trace, "head")
