"""The example sparse U-Net, now :class:`mlx_lattice.models.MinkUNet`.

Kept importable for code that used it: ``SparseUNet`` is ``MinkUNet`` with
this module's old defaults (one input channel, four classes), and the stage
classes are re-exported.

>>> import numpy as np
>>> from mlx_lattice import SparseTensor
>>> x = SparseTensor(mx.array(np.array([[0, i, j, 0] for i in range(4) for j in range(4)], np.int32)),
...                  mx.ones((16, 1)))
>>> SparseUNet(1, 5, widths=(4, 8, 8)).eval()(x).feats.shape
(16, 5)
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx  # noqa: F401  (doctest namespace)

from mlx_lattice.models import DecoderStage, EncoderStage, MinkUNet, Stem

__all__ = ["DecoderStage", "EncoderStage", "MinkUNet", "SparseUNet", "Unit"]

#: The stem's unit (submanifold conv, batch norm, ReLU).
Unit = Stem


class SparseUNet(MinkUNet):
    """:class:`~mlx_lattice.models.MinkUNet` with ``in_channels=1, num_classes=4`` defaults."""

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 4,
        widths: Sequence[int] = (16, 32, 64, 96),
        depths: int | Sequence[int] = 1,
    ) -> None:
        super().__init__(in_channels, num_classes, widths, depths)
