"""Run a saved segmentation model on one scan.

``./bazelw run //examples:segment -- --model model.safetensors --points scan.bin
[--out labels.npy] [--labels-out DIR [--label-map map.json]] [--ply-out scan.ply]
[--picture scan.png] [--nocompiled]``

``--model`` is a model file (``mlx_lattice.models.save_model``; the demo's
``--save``) or an exported artifact (``mlx_lattice.export.export_model``;
the demo's ``.mlxl`` files, run without the model classes). Either carries
the architecture, voxel size, class names and the input features the model
declares (``occupancy``, ``height``, ``intensity``, ``r,g,b``, ...), so no
other flag is needed: the features are built from the scan exactly as
declared, and a scan that lacks one is an error naming the feature and the
file. Any file ``mlx_lattice.io.read_points`` reads works as ``--points``.
An artifact runs as its compiled inference graph (``mlx_lattice.compile``:
norms folded into the convolutions, fused epilogues, int8 activations
between calibrated static-scale layers); ``--nocompiled`` runs it op for op
as the exported model's ``eval()`` forward pass.

Outputs, at least one of them: ``--out`` gets one int32 class index per
point (into the model's class names; ``.npy``); ``--labels-out DIR`` a
SemanticKITTI-style ``.label`` file named after the scan (one uint32 raw
semantic id per point); ``--ply-out`` a binary PLY with the points, their
class colour (``red``, ``green``, ``blue``; the pictures' colours) and a
``label`` property (the class index); ``--picture`` a top-down PNG.

The ``.label`` ids: ``--label-map FILE.json``, an object of each of the
model's class names to its id (0 to 65535, e.g. ``{"ground": 40,
"building": 50, "car": 10, "pole": 80, "vegetation": 70}``); without one,
each class's SemanticKITTI raw id by name (``LEARNING_MAP_INV`` of its
training class), which needs every class to be a SemanticKITTI class name:
the demo's ``ground`` is none, so its models need a map (the error message
prints one to start from).

Prints the time of each stage: load, read, voxelize (for an artifact:
features; it voxelizes in the forward stage), forward, write (the files),
picture.
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
    "labels-out", None, "directory for a SemanticKITTI-style .label file of the predictions"
)
_LABEL_MAP = flags.DEFINE_string(
    "label-map",
    None,
    "JSON object of each class name of the model to its id in the --labels-out file "
    "(default: SemanticKITTI's raw ids, for classes with SemanticKITTI names)",
)
_PLY_OUT = flags.DEFINE_string(
    "ply-out", None, "a PLY of the points with class colours and a label property"
)
_PICTURE = flags.DEFINE_string("picture", None, "a top-down PNG of the predicted classes")
_COMPILED = flags.DEFINE_boolean(
    "compiled",
    True,
    "run an artifact as its compiled inference graph (mlx_lattice.compile: folded norms, fused "
    "epilogues, int8 between static layers); --nocompiled runs it op for op",
)
OUTPUTS = ("out", "labels-out", "ply-out", "picture")
flags.mark_flags_as_required(["model", "points"])
flags.register_validator(
    "out", lambda path: path is None or Path(path).suffix == ".npy", message="--out must be a .npy path"
)
flags.register_multi_flags_validator(
    OUTPUTS,
    lambda values: any(values.values()),
    message="no output: give at least one of --out, --labels-out, --ply-out, --picture",
)
flags.register_multi_flags_validator(
    ["label-map", "labels-out"],
    lambda values: values["label-map"] is None or values["labels-out"] is not None,
    message="--label-map sets the ids of the --labels-out file: give --labels-out too",
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
    compiled: bool = False  # an artifact run as its compiled inference graph


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


def _voxel_count(points: np.ndarray, voxel_size: float) -> int:
    """Occupied voxels of edge ``voxel_size`` (one key per voxel: ~10x faster
    than ``np.unique(axis=0)``, which took longer than the forward).

    >>> _voxel_count(np.array([[0.1, 0, 0], [0.2, 0, 0], [1.1, 0, -3]]), 0.5)
    2
    """
    cells = np.floor(points / voxel_size).astype(np.int64)
    cells -= cells.min(axis=0)
    dims = cells.max(axis=0) + 1
    if float(np.prod(dims.astype(np.float64))) >= 2.0**62:
        return len(np.unique(cells, axis=0))
    return len(np.unique(np.ravel_multi_index(tuple(cells.T), tuple(dims))))


def load(path: Path, *, compiled: bool = True) -> Model:
    """A save_model file or an export artifact at ``path`` (an artifact as
    its compiled inference graph unless ``compiled`` is false)."""
    import mlx.core as mx

    from mlx_lattice import export

    if export.FORMAT in _safetensors_metadata(path):
        try:
            net = export.load(path, compiled=compiled)
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
            voxels = _voxel_count(points, float(net.voxel_size))
            return (points, feats), voxels

        def predict_artifact(inp: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
            scores = net.predict_points(*inp)  # voxelizes the points itself
            return np.array(mx.argmax(scores, axis=1)).astype(np.int32)

        kinds = {
            (n["quant"]["bits"], n["quant"]["act_bits"]) for n in net.graph["nodes"] if "quant" in n
        }
        quant = f", quantized ({len(kinds)} forms)" if kinds else ""
        run = ", compiled graph" if net.compiled else ", op for op"
        return Model(
            f"{net.model_type} artifact (format version {net.graph['version']}){quant}{run}",
            float(net.voxel_size),
            tuple(classes),
            net.features,
            prepare_artifact,
            predict_artifact,
            "features",
            net.compiled,
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


def _new_file(path: Path) -> Path:
    """``path`` with its folder made and an earlier regular file there
    removed: ext4 writes a file truncated and rewritten in place back to
    disk at close, which made rewriting the outputs several times slower
    than writing them anew (``mlx_lattice.io.write_ply`` does the same)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and not path.is_symlink():
        path.unlink()
    return path


def read_label_map(path: Path) -> dict[str, int]:
    """``--label-map``'s JSON object: class name -> id (an int in [0, 65535],
    the semantic half of a ``.label`` word)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"--label-map: cannot read {path} ({e.strerror or e}).") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise InputError(f"--label-map: {path} is not JSON ({e}).") from None
    if not isinstance(data, dict):
        raise InputError(
            f"--label-map: {path} must hold a JSON object of class names to ids, "
            f"got a {type(data).__name__}."
        )
    for name, value in data.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0xFFFF:
            raise InputError(
                f"--label-map: {path}: the id of {name!r} must be an integer in [0, 65535], "
                f"got {json.dumps(value)}."
            )
    return data


def label_ids(class_names: Sequence[str], label_map: dict[str, int] | None) -> np.ndarray:
    """The ``.label`` id (uint32) of each class: ``label_map``'s, or without
    one SemanticKITTI's raw id of the class of that name
    (``LEARNING_MAP_INV``).

    >>> label_ids(["road", "car"], None).tolist()
    [40, 10]
    >>> label_ids(["ground", "car"], {"ground": 72, "car": 10, "truck": 18}).tolist()
    [72, 10]
    >>> try:
    ...     label_ids(["ground", "car"], None)
    ... except InputError as e:
    ...     print(str(e).split(" (")[0], "...", str(e).split(". ")[-1])
    --labels-out: the model's class 'ground' is not a SemanticKITTI class ... Pass --label-map FILE.json, a JSON object of each class name to its id (0-65535), for this model {"ground": ID, "car": 10} with an ID of your choice for 'ground'.
    """
    from mlx_lattice.io.semantickitti import CLASS_NAMES, LEARNING_MAP_INV

    kitti = {name: LEARNING_MAP_INV[k + 1] for k, name in enumerate(CLASS_NAMES)}
    if label_map is not None:
        missing = [name for name in class_names if name not in label_map]
        if missing:
            raise InputError(
                f"--label-map has no id for the model's class{'es' if len(missing) > 1 else ''} "
                f"{', '.join(map(repr, missing))} (it maps {', '.join(map(repr, label_map))})."
            )
        return np.array([label_map[name] for name in class_names], np.uint32)
    unknown = [name for name in class_names if name not in kitti]
    if unknown:
        example = ", ".join(f'"{name}": {kitti.get(name, "ID")}' for name in class_names)
        raise InputError(
            f"--labels-out: the model's class {unknown[0]!r} is not a SemanticKITTI class "
            f"({', '.join(CLASS_NAMES)}), so its .label id is unknown. Pass --label-map "
            f"FILE.json, a JSON object of each class name to its id (0-65535), for this "
            f"model {{{example}}} with an ID of your choice for "
            f"{', '.join(map(repr, unknown))}."
        )
    return np.array([kitti[name] for name in class_names], np.uint32)


def write_ply(path: Path, points: np.ndarray, labels: np.ndarray, class_names: Sequence[str]) -> None:
    """A binary little-endian PLY (``mlx_lattice.io.write_ply``): ``x y z``
    float, ``red green blue`` uchar (the class colours of the pictures) and
    ``label`` int (class index)."""
    from examples.palette import colour_columns
    from mlx_lattice.io import write_ply as write

    colours = colour_columns(labels, len(class_names))
    classes = ",".join(name.replace(" ", "_") for name in class_names)
    write(
        path,
        points,
        {**colours, "label": labels.astype(np.int32, copy=False)},
        comments=[f"segment: label is the class index; classes {classes}"],
    )


def _write_outputs(
    model: Model, cloud: Any, points_path: Path, labels: np.ndarray, ids: np.ndarray | None,
    times: dict[str, float],
) -> list[str]:
    """Write the outputs the flags ask for (timing the write and picture
    stages into ``times``); returns a line for each file written."""
    start = time.perf_counter()
    written = []
    if _OUT.value:
        out = _new_file(_user_path(_OUT.value))
        np.save(out, labels.astype(np.int32))
        written.append(f"labels: {out}")
    if ids is not None:
        label_file = _new_file(_user_path(_LABELS_OUT.value) / (points_path.stem + ".label"))
        ids[labels].astype("<u4").tofile(label_file)
        written.append(f"{'mapped' if _LABEL_MAP.value else 'SemanticKITTI'} labels: {label_file}")
    if _PLY_OUT.value:
        ply = _user_path(_PLY_OUT.value)
        ply.parent.mkdir(parents=True, exist_ok=True)
        write_ply(ply, cloud.points, labels, model.class_names)
        written.append(f"PLY: {ply}")
    if written:
        times["write"] = time.perf_counter() - start
    if _PICTURE.value:
        from examples.pictures import top_down_png

        start = time.perf_counter()
        extent = float(np.percentile(np.abs(cloud.points[:, :2]), 98)) or 1.0
        png = top_down_png(
            _user_path(_PICTURE.value),
            cloud.points,
            [("prediction", labels)],
            model.class_names,
            extent=extent,
        )
        times["picture"] = time.perf_counter() - start
        written.append(f"picture: {png}")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """Label the scan of ``argv``'s flags (without the program name;
    ``None``: the command line); 0, or 2 with an error message on stderr."""
    cli.parsed(argv)

    from mlx_lattice import MlxLatticeError
    from mlx_lattice.io import PointCloudFormatError, read_points

    times: dict[str, float] = {}
    points_path = _user_path(_POINTS.value)
    try:
        start = time.perf_counter()
        model = load(_user_path(_MODEL.value), compiled=_COMPILED.value)
        times["load model"] = time.perf_counter() - start
        ids = None
        if _LABELS_OUT.value:  # before the forward: a wrong map fails at once
            label_map = read_label_map(_user_path(_LABEL_MAP.value)) if _LABEL_MAP.value else None
            ids = label_ids(model.class_names, label_map)
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
    except (InputError, PointCloudFormatError, MlxLatticeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        written = _write_outputs(model, cloud, points_path, labels, ids, times)
    except (OSError, MlxLatticeError) as e:  # an unwritable --out, a full disk, ...
        print(f"error: cannot write the outputs: {e}", file=sys.stderr)
        return 2

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
    return 0


if __name__ == "__main__":
    cli.run(main)
