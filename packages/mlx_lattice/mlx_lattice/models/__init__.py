"""Model zoo: sparse segmentation networks built from :mod:`mlx_lattice.nn`.

* :class:`MinkUNet`: a sparse U-Net (configurable widths and depths);
* :class:`SPVCNN`: the U-Net with a point branch fused through
  :mod:`mlx_lattice.geometry` (devoxelize / voxelize), scoring every point;
* :func:`cross_entropy` and :func:`train_step` helpers for per-voxel training;
* :func:`save_model` / :func:`load_model`: weights and configuration in one
  ``.safetensors`` file (float or quantized models).

Every model is an ``mlx.nn.Module``: ``save_weights`` / ``load_weights``,
``mlx.optimizers`` and :func:`mlx_lattice.quantize` work on it as on any layer.
"""

from mlx_lattice.models.files import (
    ModelFileError,
    SavedModel,
    load_model,
    point_features,
    save_model,
)
from mlx_lattice.models.minkunet import (
    DecoderStage,
    EncoderStage,
    FloatBatchNorm,
    MinkUNet,
    Stem,
    Trace,
)
from mlx_lattice.models.spvcnn import SPVCNN, PointBranch, PointCloudInput, point_cloud_input
from mlx_lattice.models.training import class_weights, cross_entropy, predict, train_step

__all__ = [
    "SPVCNN",
    "DecoderStage",
    "EncoderStage",
    "FloatBatchNorm",
    "MinkUNet",
    "ModelFileError",
    "PointBranch",
    "PointCloudInput",
    "SavedModel",
    "Stem",
    "Trace",
    "class_weights",
    "cross_entropy",
    "load_model",
    "point_cloud_input",
    "point_features",
    "predict",
    "save_model",
    "train_step",
]
