"""Run a saved segmentation model on one scan.

``./bazelw run //examples:segment -- --model model.safetensors --points scan.bin
--out labels.npy [--labels-out DIR] [--ply-out scan.ply] [--picture scan.png]``

``--model`` is a model file (``mlx_lattice.models.save_model``; the demo's
``--save``) or an exported artifact (``mlx_lattice.export.export_model``;
the demo's ``.mlxl`` files, run without the model classes). Either carries
the architecture, voxel size, class names and the input features the model
declares (``occupancy``, ``height``, ``intensity``, ``r,g,b``, ...), so no
other flag is needed: the features are built from the scan exactly as
declared, and a scan that lacks one is an error naming the feature and the
file. Any file ``mlx_lattice.io.read_points`` reads works as ``--points``.

Outputs: ``--out`` gets one int32 class index per point (into the model's
class names; ``.npy``); ``--labels-out DIR`` a SemanticKITTI ``.label``
file named after the scan (one uint32 raw semantic id per point: each
class, by name, mapped back with ``LEARNING_MAP_INV``); ``--ply-out`` a
binary PLY with the points, their class colour (``red``, ``green``,
``blue``) and a ``label`` property (the class index); ``--picture`` a
top-down PNG. Prints the time of each stage: load, read, voxelize (for an
artifact: features; it voxelizes in the forward stage), forward, write.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from absl import flags

from examples import cli

_MODEL = flags.DEFINE_string(
    "model", None, "model file (.safetensors from save_model) or exported artifact (export_model)"
)
_POINTS = flags.DEFINE_string(
    "points", None, "point cloud (.bin .ply .las .laz .pcd .npy .npz)"
)
_OUT = flags.DEFINE_string("out", None, "per-point class indices (.npy)")
_LABELS_OUT = flags.DEFINE_string(
    "labels-out", None, "directory for a SemanticKITTI .label file of the predictions"
)
_PLY_OUT = flags.DEFINE_string(
    "ply-out", None, "a PLY of the points with class colours and a label property"
)
_PICTURE = flags.DEFINE_string("picture", None, "a top-down PNG of the predicted classes")
flags.mark_flags_as_required(["model", "points", "out"])
flags.register_validator(
    "out", lambda path: path is None or Path(path).suffix == ".npy", message="--out must be a .npy path"
)


def _user_path(arg: str) -> Path:
    """``arg`` relative to where ``bazel run`` was started (it changes the cwd)."""
    path = Path(arg)
    if not path.is_absolute() and "BUILD_WORKING_DIRECTORY" in os.environ:
        path = Path(os.environ["BUILD_WORKING_DIRECTORY"]) / path
    return path


class InputError(Exception):
    """A model, scan or output that cannot be used (the message says why)."""


@dataclass
class Model:
    """What segment needs of a model file or an artifact."""

    description: str
    voxel_size: float
    class_names: tuple[str, ...]
    features: tuple[str, ...]
    # (points, the file's per-point fields, source) -> (input, voxel count)
    prepare: Callable[[np.ndarray, dict, str], tuple[Any, int]]
    # input -> class per point
    predict: Callable[[Any], np.ndarray]
    prepare_stage: str  # what prepare does, for the timings


def _safetensors_metadata(path: Path) -> dict:
    """The ``__metadata__`` of a safetensors file's header ({} if unreadable)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100_000_000:
                return {}
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError):
        return {}
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def load(path: Path) -> Model:
    """A save_model file or an export artifact at ``path``."""
    import mlx.core as mx

    from mlx_lattice import export

    if export.FORMAT in _safetensors_metadata(path):
        try:
            net = export.load(path)
        except export.ExportError as e:
            raise InputError(f"{path}: {e}") from None
        if net.voxel_size is None:
            raise InputError(f"{path}: the artifact stores no voxel size (export it with voxel_size=).")
        if net.features is None:
            raise InputError(f"{path}: the artifact declares no input features (export it with features=).")
        classes = net.class_names or tuple(
            f"class {k}" for k in range(int(net.graph.get("num_classes") or 0))
        )

        def prepare_artifact(points: np.ndarray, values: dict, source: str) -> tuple[Any, int]:
            from mlx_lattice.data import point_feature_columns

            feats = point_feature_columns(points, net.features, values, source=source)
            voxels = len(np.unique(np.floor(points / net.voxel_size).astype(np.int64), axis=0))
            return (points, feats), voxels

        def predict_artifact(inp: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
            scores = net.predict_points(*inp)  # voxelizes the points itself
            return np.array(mx.argmax(scores, axis=1)).astype(np.int32)

        kinds = {
            (n["quant"]["bits"], n["quant"]["act_bits"]) for n in net.graph["nodes"] if "quant" in n
        }
        quant = f", quantized ({len(kinds)} forms)" if kinds else ""
        return Model(
            f"{net.model_type} artifact (format version {net.graph['version']}){quant}",
            float(net.voxel_size),
            tuple(classes),
            net.features,
            prepare_artifact,
            predict_artifact,
            "features",
        )
    from mlx_lattice.models import ModelFileError, load_model

    try:
        saved = load_model(path)
    except ModelFileError as e:
        raise InputError(str(e)) from None

    def prepare_saved(points: np.ndarray, values: dict, source: str) -> tuple[Any, int]:
        inp = saved.prepare(points, values, source=source)
        mx.eval(inp.tensor.coords, inp.tensor.feats)
        return inp, inp.tensor.num_points

    quant = f", quantized ({len(saved.report.quantized)} layers)" if saved.report else ""
    return Model(
        f"{saved.architecture} widths {saved.model.widths}{quant}",
        saved.voxel_size,
        saved.class_names,
        saved.features,
        prepare_saved,
        saved.predict,
        "voxelize",
    )


def semantickitti_ids(labels: np.ndarray, class_names: Sequence[str]) -> np.ndarray:
    """Raw SemanticKITTI ids (uint32) of class indices: each class, by name,
    is a SemanticKITTI training class, written back with ``LEARNING_MAP_INV``.

    >>> semantickitti_ids(np.array([0, 1, 1]), ["road", "car"]).tolist()
    [40, 10, 10]
    """
    from mlx_lattice.io.semantickitti import CLASS_NAMES, LEARNING_MAP_INV

    raw = []
    for name in class_names:
        if name not in CLASS_NAMES:
            raise InputError(
                f"--labels-out: the model's class {name!r} is not a SemanticKITTI class "
                f"({', '.join(CLASS_NAMES)})."
            )
        raw.append(LEARNING_MAP_INV[CLASS_NAMES.index(name) + 1])
    return np.asarray(raw, np.uint32)[labels]


def write_ply(path: Path, points: np.ndarray, labels: np.ndarray, class_names: Sequence[str]) -> None:
    """A binary little-endian PLY: ``x y z`` float, ``red green blue`` uchar
    (the class colours of the pictures) and ``label`` int (class index)."""
    from examples.pictures import class_colours

    colours = np.asarray(class_colours(len(class_names)), np.uint8)
    vertex = np.empty(
        len(points),
        dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("red", "u1"), ("green", "u1"),
               ("blue", "u1"), ("label", "<i4")],
    )  # fmt: skip
    vertex["x"], vertex["y"], vertex["z"] = points[:, 0], points[:, 1], points[:, 2]
    rgb = colours[labels]
    vertex["red"], vertex["green"], vertex["blue"] = rgb[:, 0], rgb[:, 1], rgb[:, 2]
    vertex["label"] = labels
    header = (
        "ply\nformat binary_little_endian 1.0\n"
        "comment segment: label is the class index; classes "
        + ",".join(name.replace(" ", "_") for name in class_names)
        + f"\nelement vertex {len(points)}\n"
        "property float x\nproperty float y\nproperty float z\n"
        "property uchar red\nproperty uchar green\nproperty uchar blue\n"
        "property int label\nend_header\n"
    )
    with open(path, "wb") as f:
        f.write(header.encode("ascii"))
        f.write(vertex.tobytes())


def main(argv: Sequence[str] | None = None) -> int:
    """Label the scan of ``argv``'s flags (without the program name;
    ``None``: the command line); 0, or 2 with an error message on stderr."""
    cli.parsed(argv)
    out = _user_path(_OUT.value)

    from mlx_lattice import MlxLatticeError
    from mlx_lattice.io import PointCloudFormatError, read_points

    times: dict[str, float] = {}
    points_path = _user_path(_POINTS.value)
    try:
        start = time.perf_counter()
        model = load(_user_path(_MODEL.value))
        times["load model"] = time.perf_counter() - start
        start = time.perf_counter()
        cloud = read_points(points_path)
        times["read"] = time.perf_counter() - start
        if len(cloud) == 0:
            raise InputError(f"{_POINTS.value}: the scan has no points")
        values = {}
        if cloud.features is not None:
            values = {n: cloud.features[:, i] for i, n in enumerate(cloud.feature_names)}
        start = time.perf_counter()
        inp, voxels = model.prepare(cloud.points, values, str(points_path))
        times[model.prepare_stage] = time.perf_counter() - start
        start = time.perf_counter()
        labels = model.predict(inp)
        times["forward"] = time.perf_counter() - start
        raw = semantickitti_ids(labels, model.class_names) if _LABELS_OUT.value else None
    except (InputError, PointCloudFormatError, MlxLatticeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, labels.astype(np.int32))
    written = [f"labels: {out}"]
    if raw is not None:
        label_dir = _user_path(_LABELS_OUT.value)
        label_dir.mkdir(parents=True, exist_ok=True)
        label_file = label_dir / (points_path.stem + ".label")
        raw.astype("<u4").tofile(label_file)
        written.append(f"SemanticKITTI labels: {label_file}")
    if _PLY_OUT.value:
        ply = _user_path(_PLY_OUT.value)
        ply.parent.mkdir(parents=True, exist_ok=True)
        write_ply(ply, cloud.points, labels, model.class_names)
        written.append(f"PLY: {ply}")
    times["write"] = time.perf_counter() - start

    print(
        f"model: {model.description}, voxel size {model.voxel_size} m, "
        f"{len(model.class_names)} classes, features {','.join(model.features)}"
    )
    print(f"scan: {_POINTS.value}: {len(cloud)} points, {voxels} voxels")
    for stage, took in times.items():
        print(f"  {stage:12s} {took * 1e3:9.1f} ms")
    counts = np.bincount(labels, minlength=len(model.class_names))
    print("points per class: " + ", ".join(
        f"{name} {c}" for name, c in zip(model.class_names, counts, strict=True) if c
    ))  # fmt: skip
    print("\n".join(written))
    if _PICTURE.value:
        from examples.pictures import top_down_png

        extent = float(np.percentile(np.abs(cloud.points[:, :2]), 98)) or 1.0
        png = top_down_png(
            _user_path(_PICTURE.value),
            cloud.points,
            [("prediction", labels)],
            model.class_names,
            extent=extent,
        )
        print(f"picture: {png}")
    return 0


if __name__ == "__main__":
    cli.run(main)
