"""Labelled scans on disk: a SemanticKITTI tree and a folder of labelled
point files, as :class:`~mlx_lattice.data.LidarScan` s for
:func:`mlx_lattice.data.make_batch` and the training helpers of
:mod:`mlx_lattice.models`.

Scans are read when asked for (:meth:`PointCloudDataset.scan`), so a
dataset object holds only file names.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from mlx_lattice.data.lidar import LidarScan
from mlx_lattice.data.segmentation import SegmentationBatch, make_batch
from mlx_lattice.io import semantickitti
from mlx_lattice.io.readers import PointCloud, PointCloudFormatError, read_kitti, read_points

__all__ = [
    "PointCloudDataset",
    "folder_dataset",
    "semantickitti_dataset",
]

PathLike = str | os.PathLike[str]

_FOLDER_SUFFIXES = (".ply", ".las", ".laz", ".pcd", ".npz")


@dataclass(frozen=True)
class PointCloudDataset:
    """Labelled scans on disk.

    ``files[i]`` is scan ``i``'s point file and ``label_files[i]`` its
    separate label file (SemanticKITTI) or ``None`` (labels inside the point
    file). :meth:`scan` returns training labels: ``0..len(class_names)-1``
    and ``ignore_label`` (``len(class_names)``) for points that score nothing.
    """

    files: tuple[Path, ...]
    label_files: tuple[Path | None, ...]
    class_names: tuple[str, ...]
    layout: str
    label_map: dict[int, int] | None = None

    @property
    def ignore_label(self) -> int:
        """The training label of ignored points (one past the last class)."""
        return len(self.class_names)

    def __len__(self) -> int:
        return len(self.files)

    def scan(self, index: int) -> LidarScan:
        """Scan ``index``: points (float32) and int32 training labels."""
        path, label_path = self.files[index], self.label_files[index]
        if self.layout == "semantickitti":
            if label_path is None:
                raise PointCloudFormatError(f"{path}: a SemanticKITTI scan needs its .label file.")
            cloud = read_kitti(path, label_path)
            raw = cloud.labels if cloud.labels is not None else np.zeros(0, np.int64)
            return LidarScan(cloud.points, semantickitti.training_labels(raw), _intensity(cloud))
        cloud = read_points(path)
        if cloud.labels is None:
            raise PointCloudFormatError(f"{path}: no label field (a folder dataset needs labels).")
        return LidarScan(cloud.points, self._map(path, cloud.labels), _intensity(cloud))

    def _map(self, path: Path, raw: np.ndarray) -> np.ndarray:
        k = self.ignore_label
        if self.label_map is not None:
            lut = self.label_map
            out = np.array([lut.get(int(v), k) for v in np.unique(raw)], np.int32)
            return out[np.searchsorted(np.unique(raw), raw)]
        if raw.size and (raw.min() < 0 or raw.max() > k):
            raise PointCloudFormatError(
                f"{path}: labels must lie in [0, {k}] ({k}: ignored) for classes "
                f"{', '.join(self.class_names)}; got [{raw.min()}, {raw.max()}] "
                "(pass label_map to map raw values)."
            )
        return raw.astype(np.int32)

    def subset(self, indices: Sequence[int]) -> PointCloudDataset:
        """The scans at ``indices``, in that order."""
        return replace(
            self,
            files=tuple(self.files[i] for i in indices),
            label_files=tuple(self.label_files[i] for i in indices),
        )

    def split(
        self, validation: float = 0.2, *, seed: int = 0
    ) -> tuple[PointCloudDataset, PointCloudDataset]:
        """A seeded shuffle split into training and validation scans;
        ``validation`` is the fraction held out (at least one scan when the
        dataset has two or more and the fraction is positive).

        >>> ds = PointCloudDataset(tuple(Path(f"{i}.ply") for i in range(5)), (None,) * 5, ("a",), "folder")
        >>> train, val = ds.split(0.4, seed=1)
        >>> len(train), len(val), sorted(train.files + val.files) == sorted(ds.files)
        (3, 2, True)
        """
        if not 0.0 <= validation < 1.0:
            raise ValueError(f"validation must be a fraction in [0, 1), got {validation!r}.")
        order = np.random.default_rng(seed).permutation(len(self))
        n_val = round(validation * len(self))
        if validation > 0 and len(self) >= 2:
            n_val = min(max(n_val, 1), len(self) - 1)
        return self.subset(order[n_val:].tolist()), self.subset(order[:n_val].tolist())

    def batches(
        self, voxel_size: float, *, batch_size: int = 1, seed: int | None = 0
    ) -> Iterator[SegmentationBatch]:
        """One pass over the scans, ``batch_size`` scans per
        :func:`~mlx_lattice.data.make_batch` (the last batch may be smaller),
        in a seeded shuffled order (``seed=None``: file order)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        order = (
            np.arange(len(self))
            if seed is None
            else np.random.default_rng(seed).permutation(len(self))
        )
        for start in range(0, len(order), batch_size):
            yield make_batch(
                [self.scan(int(i)) for i in order[start : start + batch_size]], voxel_size
            )


def _intensity(cloud: PointCloud) -> np.ndarray | None:
    """The cloud's ``intensity`` field as float32 (``None``: it has none)."""
    if cloud.features is None or "intensity" not in cloud.feature_names:
        return None
    return cloud.features[:, cloud.feature_names.index("intensity")].astype(np.float32)


def semantickitti_dataset(
    root: PathLike, sequences: Sequence[str] | str = "train"
) -> PointCloudDataset:
    """Scans of a SemanticKITTI tree: ``root/sequences/NN/velodyne/*.bin``
    with ``root/sequences/NN/labels/*.label``.

    ``sequences`` names sequences (``["00", "08"]``) or an official split
    (``"train"``, ``"valid"``; :data:`~mlx_lattice.io.semantickitti.SPLITS`);
    sequences of the split that are not on disk are skipped, named ones must
    exist. Labels go through the learning map
    (:func:`~mlx_lattice.io.semantickitti.training_labels`).

    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> (root / "sequences/08/velodyne").mkdir(parents=True); (root / "sequences/08/labels").mkdir()
    >>> np.zeros((2, 4), np.float32).tofile(root / "sequences/08/velodyne/000000.bin")
    >>> np.array([10, 0], np.uint32).tofile(root / "sequences/08/labels/000000.label")
    >>> ds = semantickitti_dataset(root, "valid")
    >>> len(ds), ds.scan(0).labels.tolist(), ds.class_names[0]
    (1, [0, 19], 'car')
    """
    base = Path(root) / "sequences"
    if not base.is_dir():
        raise PointCloudFormatError(
            f"{os.fspath(root)}: no 'sequences' folder (not a SemanticKITTI tree)."
        )
    named = isinstance(sequences, str) and sequences in semantickitti.SPLITS
    seqs = (
        semantickitti.SPLITS[sequences]
        if named
        else ((sequences,) if isinstance(sequences, str) else tuple(sequences))
    )
    files: list[Path] = []
    labels: list[Path | None] = []
    for seq in seqs:
        scans = base / seq / "velodyne"
        if not scans.is_dir():
            if named:
                continue
            raise PointCloudFormatError(f"{scans}: no such sequence folder.")
        for scan in sorted(scans.glob("*.bin")):
            label = base / seq / "labels" / (scan.stem + ".label")
            if not label.is_file():
                raise PointCloudFormatError(f"{scan}: no label file {label}.")
            files.append(scan)
            labels.append(label)
    if not files:
        raise PointCloudFormatError(
            f"{os.fspath(root)}: no labelled scans in sequences {', '.join(seqs)}."
        )
    return PointCloudDataset(
        tuple(files), tuple(labels), semantickitti.CLASS_NAMES, "semantickitti"
    )


def folder_dataset(
    root: PathLike,
    *,
    class_names: Sequence[str] | None = None,
    label_map: dict[int, int] | None = None,
) -> PointCloudDataset:
    """Every ``.ply``, ``.las``, ``.laz``, ``.pcd`` and ``.npz`` file under
    ``root`` (sorted, recursively), each with a label field (PLY/PCD:
    ``label`` or another of :data:`~mlx_lattice.io.readers.LABEL_FIELDS`;
    LAS: ``classification``; npz: ``labels``).

    Labels are used as they are (``0..K-1``, ``K`` ignored), or sent through
    ``label_map`` (raw value -> class; values it lacks are ignored). Without
    ``class_names`` the classes are named ``class0``, ... up to the largest
    label found (every file is read once to find it).

    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> np.savez(root / "a.npz", points=np.zeros((3, 3)), labels=np.array([5, 7, 9]))
    >>> ds = folder_dataset(root, class_names=["x", "y"], label_map={5: 0, 7: 1})
    >>> ds.scan(0).labels.tolist(), ds.ignore_label
    ([0, 1, 2], 2)
    """
    base = Path(root)
    if not base.is_dir():
        raise PointCloudFormatError(f"{os.fspath(root)}: no such folder.")
    files = tuple(
        sorted(p for p in base.rglob("*") if p.suffix.lower() in _FOLDER_SUFFIXES and p.is_file())
    )
    if not files:
        raise PointCloudFormatError(
            f"{os.fspath(root)}: no point files ({', '.join(_FOLDER_SUFFIXES)}) in the folder."
        )
    if class_names is None:
        if label_map is not None:
            top = max(label_map.values(), default=-1)
        else:
            top = -1
            for f in files:
                labels = read_points(f).labels
                if labels is None:
                    raise PointCloudFormatError(
                        f"{f}: no label field (a folder dataset needs labels)."
                    )
                top = max(top, int(labels.max()) if labels.size else -1)
        class_names = tuple(f"class{i}" for i in range(top + 1))
    if not class_names:
        raise PointCloudFormatError(f"{os.fspath(root)}: no classes (no labels found).")
    return PointCloudDataset(files, (None,) * len(files), tuple(class_names), "folder", label_map)
