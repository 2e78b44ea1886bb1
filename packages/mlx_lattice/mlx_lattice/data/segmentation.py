"""Labelled built-in data for semantic segmentation: several seeded scans
split into training and validation sets, voxelized into model inputs with a
label per voxel, and the scores (confusion matrix, per-class IoU, mIoU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_lattice.data.lidar import CLASS_NAMES, LidarScan, SceneConfig, synthetic_lidar_scan
from mlx_lattice.tensor import SparseTensor, SparseTensorError

__all__ = [
    "DEFAULT_FEATURES",
    "HEIGHT_SCALE",
    "LabelledScans",
    "SegmentationBatch",
    "confusion_matrix",
    "iou_per_class",
    "labelled_scans",
    "make_batch",
    "mean_iou",
    "parse_features",
    "point_feature_columns",
    "voxel_labels",
]

#: Metres per unit of the height feature (z / HEIGHT_SCALE).
HEIGHT_SCALE = 4.0
#: The input features of a model that declares none: occupancy and height.
DEFAULT_FEATURES = ("occupancy", "height")
# Short feature names and the point-file fields they read.
_ALIASES = {"r": "red", "g": "green", "b": "blue"}


def parse_features(spec: str | Sequence[str]) -> tuple[str, ...]:
    """A list of input feature names from ``"occupancy,height,intensity"``
    or a sequence; names are non-empty, without spaces, and distinct.

    >>> parse_features("occupancy, height,r,g,b")
    ('occupancy', 'height', 'r', 'g', 'b')
    """
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip() if isinstance(n, str) else n for n in names]
    if not names or not all(isinstance(n, str) and n and " " not in n for n in names):
        raise SparseTensorError(f"features must be non-empty names without spaces, got {spec!r}.")
    if len(set(names)) != len(names):
        raise SparseTensorError(f"features must be distinct, got {spec!r}.")
    return tuple(names)


def point_feature_columns(
    points: np.ndarray,
    names: Sequence[str],
    values: dict[str, np.ndarray] | None = None,
    *,
    source: str = "points",
) -> np.ndarray:
    """The ``(P, len(names))`` float32 input features of ``(P, 3)`` points,
    one column per name, in order: ``occupancy`` (1), ``height``
    (``z / HEIGHT_SCALE``), and any other name read as it is from
    ``values`` (a point file's per-point fields by name, e.g.
    ``intensity``, ``red``; ``r``, ``g``, ``b`` read ``red``, ``green``,
    ``blue``).

    A name ``values`` lacks raises :class:`~mlx_lattice.tensor.SparseTensorError`
    naming the feature and ``source`` (the file).

    >>> pts = np.array([[0.0, 0.0, 2.0], [1.0, 0.0, 4.0]], np.float32)
    >>> point_feature_columns(pts, ["occupancy", "height", "intensity"],
    ...                       {"intensity": np.array([0.5, 0.25])}).tolist()
    [[1.0, 0.5, 0.5], [1.0, 1.0, 0.25]]
    """
    return _columns64(points, names, values, source).astype(np.float32)


def _columns64(
    points: np.ndarray, names: Sequence[str], values: dict | None, source: str
) -> np.ndarray:
    """:func:`point_feature_columns` in float64 (voxel means are taken in float64)."""
    pts = np.asarray(points, np.float64)
    given = dict(values or {})
    columns = []
    for name in names:
        if name == "occupancy":
            columns.append(np.ones(len(pts)))
        elif name == "height":
            columns.append(pts[:, 2] / HEIGHT_SCALE)
        else:
            field = _ALIASES.get(name, name)
            if field not in given:
                have = ", ".join(sorted(given)) or "none"
                raise SparseTensorError(
                    f"{source}: has no {name!r} feature"
                    + (f" (field {field!r})" if field != name else "")
                    + f"; the model takes {','.join(names)}; the file's per-point fields: {have}."
                )
            column = np.asarray(given[field], np.float64).reshape(-1)
            if len(column) != len(pts):
                raise SparseTensorError(
                    f"{source}: feature {name!r} has {len(column)} values for {len(pts)} points."
                )
            columns.append(column)
    return np.stack(columns, axis=1) if columns else np.zeros((len(pts), 0))


@dataclass(frozen=True)
class LabelledScans:
    """A training and a validation split of labelled scans, and the seeds
    they were drawn with (scan ``i`` of a split is ``synthetic_lidar_scan(seeds[i])``)."""

    train: tuple[LidarScan, ...]
    validation: tuple[LidarScan, ...]
    train_seeds: tuple[int, ...]
    validation_seeds: tuple[int, ...]
    class_names: tuple[str, ...] = CLASS_NAMES


def labelled_scans(
    n_train: int = 4,
    n_validation: int = 2,
    *,
    seed: int = 0,
    config: SceneConfig | None = None,
) -> LabelledScans:
    """Seeded scans with a label per point, split into train and validation.

    Training scan ``i`` uses seed ``seed + i``, validation scan ``j`` seed
    ``seed + n_train + j``: different streets, never shared between the splits.

    >>> data = labelled_scans(2, 1, seed=3, config=SceneConfig(beams=8, azimuth_steps=64))
    >>> len(data.train), len(data.validation), data.train_seeds, data.validation_seeds
    (2, 1, (3, 4), (5,))
    >>> data.class_names
    ('ground', 'building', 'car', 'pole', 'vegetation')
    """
    for name, value in (("n_train", n_train), ("n_validation", n_validation)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise SparseTensorError(f"{name} must be an int >= 0, got {value!r}.")
    if n_train + n_validation == 0:
        raise SparseTensorError("n_train + n_validation must be at least 1.")
    train_seeds = tuple(seed + i for i in range(n_train))
    val_seeds = tuple(seed + n_train + j for j in range(n_validation))
    return LabelledScans(
        train=tuple(synthetic_lidar_scan(s, config) for s in train_seeds),
        validation=tuple(synthetic_lidar_scan(s, config) for s in val_seeds),
        train_seeds=train_seeds,
        validation_seeds=val_seeds,
    )


def voxel_labels(point_to_voxel: np.ndarray, labels: np.ndarray, num_voxels: int) -> np.ndarray:
    """The most frequent point label in each voxel (ties: the smaller label).

    >>> voxel_labels(np.array([0, 0, 0, 1]), np.array([2, 1, 2, 3]), 2).tolist()
    [2, 3]
    """
    p2v = np.asarray(point_to_voxel, dtype=np.int64)
    lab = np.asarray(labels, dtype=np.int64)
    if p2v.shape != lab.shape or p2v.ndim != 1:
        raise SparseTensorError(
            f"point_to_voxel and labels must be (P,) alike, got {p2v.shape} and {lab.shape}."
        )
    if p2v.size and (p2v.min() < 0 or p2v.max() >= num_voxels):
        raise SparseTensorError(f"point_to_voxel must index [0, {num_voxels}).")
    if lab.size and lab.min() < 0:
        raise SparseTensorError("labels must be >= 0.")
    n_classes = int(lab.max()) + 1 if lab.size else 1
    votes = np.zeros((num_voxels, n_classes), np.int64)
    np.add.at(votes, (p2v, lab), 1)
    return votes.argmax(axis=1).astype(np.int32)


@dataclass(frozen=True)
class SegmentationBatch:
    """Model input for a batch of scans: voxel ``tensor`` (features: by
    default occupancy and height ``z / HEIGHT_SCALE``, averaged over the
    voxel's points),
    ``labels`` per voxel (majority of its points), and per point its voxel
    row and label, to score predictions on the points."""

    tensor: SparseTensor
    labels: mx.array
    point_to_voxel: np.ndarray
    point_labels: np.ndarray


def make_batch(
    scans: Sequence[LidarScan],
    voxel_size: float,
    features: Sequence[str] = DEFAULT_FEATURES,
) -> SegmentationBatch:
    """Voxelize labelled scans into one batch (scan ``i`` gets batch index
    ``i``), each voxel's features the mean of its points'
    (:func:`point_feature_columns` of ``features``; ``intensity`` is the
    scans' own, and a scan without one raises ``SparseTensorError``).

    >>> scan = synthetic_lidar_scan(0, SceneConfig(beams=8, azimuth_steps=128))
    >>> b = make_batch([scan], 0.5)
    >>> b.tensor.num_channels, b.labels.shape[0] == b.tensor.num_points, len(b.point_labels) == len(scan.points)
    (2, True, True)
    """
    if not (isinstance(voxel_size, int | float) and np.isfinite(voxel_size) and voxel_size > 0):
        raise SparseTensorError(f"voxel_size must be a positive finite number, got {voxel_size!r}.")
    if not scans:
        raise SparseTensorError("scans must hold at least one scan.")
    names = parse_features(features)
    columns = [
        _columns64(
            s.points,
            names,
            {} if s.intensity is None else {"intensity": s.intensity},
            f"scan {i}",
        )
        for i, s in enumerate(scans)
    ]
    labels = np.concatenate([s.labels for s in scans]).astype(np.int32)
    tensor, inverse = _voxel_means([s.points for s in scans], columns, voxel_size)
    n = tensor.num_points
    return SegmentationBatch(
        tensor,
        mx.array(voxel_labels(inverse, labels, n)),
        inverse.astype(np.int32),
        labels,
    )


def _voxel_means(
    points: Sequence[np.ndarray], columns: Sequence[np.ndarray], voxel_size: float
) -> tuple[SparseTensor, np.ndarray]:
    """The voxels of the point sets (set ``i`` in batch ``i``) with the
    float64 mean of each feature column over their points, and each point's
    voxel row."""
    pts = np.concatenate(points).astype(np.float64)
    batch = np.concatenate([np.full(len(p), i) for i, p in enumerate(points)])
    cells = np.floor(pts / voxel_size).astype(np.int64)
    keys = np.concatenate([batch[:, None].astype(np.int64), cells], axis=1)
    coords, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    n = len(coords)
    counts = np.bincount(inverse, minlength=n).astype(np.float64)
    per_point = np.concatenate(columns)
    means = [np.bincount(inverse, weights=c, minlength=n) / counts for c in per_point.T]
    feats = np.stack(means, axis=1).astype(np.float32) if means else np.zeros((n, 0), np.float32)
    tensor = SparseTensor(mx.array(coords.astype(np.int32)), mx.array(feats), check=False)
    return tensor, inverse


def confusion_matrix(pred: np.ndarray, truth: np.ndarray, num_classes: int) -> np.ndarray:
    """``(num_classes, num_classes)`` counts; row = true class, column = predicted.

    >>> confusion_matrix(np.array([0, 1, 1]), np.array([0, 1, 0]), 2).tolist()
    [[1, 1], [0, 1]]
    """
    p = np.asarray(pred, dtype=np.int64).reshape(-1)
    t = np.asarray(truth, dtype=np.int64).reshape(-1)
    if p.shape != t.shape:
        raise SparseTensorError(f"pred and truth must match, got {p.shape} and {t.shape}.")
    if p.size and (min(p.min(), t.min()) < 0 or max(p.max(), t.max()) >= num_classes):
        raise SparseTensorError(f"pred and truth must lie in [0, {num_classes}).")
    return np.bincount(t * num_classes + p, minlength=num_classes**2).reshape(
        num_classes, num_classes
    )


def iou_per_class(confusion: np.ndarray) -> np.ndarray:
    """IoU of each class, ``TP / (TP + FP + FN)``; NaN for a class that is
    neither present nor predicted.

    >>> iou_per_class(np.array([[1, 1], [0, 1]])).round(3).tolist()
    [0.5, 0.5]
    """
    cm = np.asarray(confusion, dtype=np.float64)
    tp = np.diag(cm)
    union = cm.sum(0) + cm.sum(1) - tp
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, tp / union, np.nan)


def mean_iou(confusion: np.ndarray) -> float:
    """Mean IoU over the classes that are present or predicted.

    >>> mean_iou(np.array([[2, 0, 0], [0, 1, 1], [0, 0, 0]]))
    0.5
    """
    return float(np.nanmean(iou_per_class(confusion)))
