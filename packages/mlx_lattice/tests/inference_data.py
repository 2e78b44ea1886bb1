"""Shared test data of the export and compiled-graph suites
(``test_export.py``, ``test_inference.py``): the quantized forms, seeded
scans, MinkUNet / SPVCNN models with norms away from their defaults
(calibrated when static), their inputs, and the committed version-2
artifact. Loaded by path (this project's pytest runs with
``--import-mode=importlib``, so test files cannot import one another); its
``load`` loads the other shared modules the same way."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import mlx.nn as mlx_nn
import numpy as np

import mlx_lattice
import quantrules as qr
from mlx_lattice import quantize
from mlx_lattice.models import SPVCNN, MinkUNet, point_cloud_input

__all__ = [
    "FORMS",
    "GOLDEN",
    "GOLDEN_EXPECTED",
    "STATIC",
    "VOXEL",
    "cloud",
    "load",
    "model",
    "model_input",
    "points",
    "randomize_norms",
]

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "export_v2_spvcnn.mlxl"
GOLDEN_EXPECTED = DATA / "export_v2_spvcnn_expected.npz"
VOXEL = 0.25

#: Static-scale int8 activations for the convolutions (linear layers have none).
STATIC = qr.Rule(
    op_names=("sparse_conv",),
    weight_qtype="int8",
    act_qtype="int8",
    act_static_scale=True,
    tile_size=32,
)
#: Every form mlx_lattice.quantize produces (group 32; narrow layers too).
FORMS: dict[str, list[qr.Rule] | None] = {
    "float": None,
    "int8": [qr.Rule(weight_qtype="int8", tile_size=32)],
    "int4": [qr.Rule(weight_qtype="int4", tile_size=32)],
    "w8a8": [qr.Rule(weight_qtype="int8", act_qtype="int8", tile_size=32)],
    "w4a8": [qr.Rule(weight_qtype="int4", act_qtype="int8", tile_size=32)],
    "w8a8-static": [STATIC, qr.Rule(weight_qtype="int8", act_qtype="int8", tile_size=32)],
}


def load(name: str) -> ModuleType:
    """The shared test module ``tests/<name>.py``, loaded by path."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def points(rng: np.random.Generator, n: int, extent: float) -> tuple[np.ndarray, np.ndarray]:
    """``n`` points uniform in ``[0, extent)^3`` and three standard normal features each."""
    pts = rng.uniform(0, extent, (n, 3)).astype(np.float32)
    return pts, rng.standard_normal((n, 3)).astype(np.float32)


def randomize_norms(model: mlx_nn.Module, rng: np.random.Generator) -> None:
    """Norm statistics and affine parameters away from the defaults (some
    factors negative), so that every norm changes its input and every fold
    its layer."""
    for _, m in model.named_modules():
        if isinstance(m, mlx_nn.BatchNorm):
            n = int(m.running_mean.shape[0])
            m.running_mean = mx.array(rng.normal(0, 0.3, n).astype(np.float32))
            m.running_var = mx.array(rng.uniform(0.3, 3.0, n).astype(np.float32))
            sign = np.where(rng.uniform(size=n) < 0.2, -1.0, 1.0)
            m.weight = mx.array((sign * rng.uniform(0.5, 1.5, n)).astype(np.float32))
            m.bias = mx.array(rng.normal(0, 0.2, n).astype(np.float32))


def cloud(pts: np.ndarray, feats: np.ndarray, dtype=mx.float32):
    """The points voxelized at ``VOXEL``, their features in ``dtype``."""
    return point_cloud_input(pts, mx.array(feats).astype(dtype), VOXEL)


def model_input(arch: str, pts: np.ndarray, feats: np.ndarray, dtype=mx.float32):
    """What ``arch`` reads: an SPVCNN the point cloud input, a MinkUNet its voxels."""
    inp = cloud(pts, feats, dtype)
    return inp if arch == "SPVCNN" else inp.tensor


def model(arch: str, form: str, rng: np.random.Generator, calib: tuple[np.ndarray, np.ndarray]):
    """An eval() ``arch`` (three levels, depths 1, 2, 1) in ``form``; a
    static form calibrated on the scan ``calib`` (points, features)."""
    cls = MinkUNet if arch == "MinkUNet" else SPVCNN
    net = cls(3, 5, widths=(16, 32, 32), depths=(1, 2, 1))
    randomize_norms(net, rng)
    net.eval()
    if FORMS[form] is not None:
        quantize(net, FORMS[form], allow_growth=True)
    if form.endswith("static"):
        mlx_lattice.calibrate(net, [model_input(arch, *calib)])
    return net
