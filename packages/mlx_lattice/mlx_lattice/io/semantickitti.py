"""The SemanticKITTI label tables: raw label ids, the learning map onto the
19 training classes (as in the dataset's ``semantic-kitti.yaml``), and the
class names.

Raw ``.label`` words hold the semantic id in their low 16 bits.
:data:`LEARNING_MAP` sends each raw id to ``0`` (unlabeled, ignored in
training and scoring) or a class ``1..19``; :func:`training_labels` shifts
that to the training convention of this package: classes ``0..18``
(:data:`CLASS_NAMES`) and :data:`IGNORE_LABEL` (``19``) for unlabeled points.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "CLASS_NAMES",
    "IGNORE_LABEL",
    "LEARNING_MAP",
    "LEARNING_MAP_INV",
    "RAW_LABEL_NAMES",
    "SPLITS",
    "training_labels",
]

#: Raw semantic ids of the ``.label`` files and their names.
RAW_LABEL_NAMES: dict[int, str] = {
    0: "unlabeled", 1: "outlier", 10: "car", 11: "bicycle", 13: "bus", 15: "motorcycle",
    16: "on-rails", 18: "truck", 20: "other-vehicle", 30: "person", 31: "bicyclist",
    32: "motorcyclist", 40: "road", 44: "parking", 48: "sidewalk", 49: "other-ground",
    50: "building", 51: "fence", 52: "other-structure", 60: "lane-marking", 70: "vegetation",
    71: "trunk", 72: "terrain", 80: "pole", 81: "traffic-sign", 99: "other-object",
    252: "moving-car", 253: "moving-bicyclist", 254: "moving-person",
    255: "moving-motorcyclist", 256: "moving-on-rails", 257: "moving-bus",
    258: "moving-truck", 259: "moving-other-vehicle",
}  # fmt: skip

#: Raw id -> learning class (0: unlabeled / ignored, 1..19: the classes).
LEARNING_MAP: dict[int, int] = {
    0: 0, 1: 0, 10: 1, 11: 2, 13: 5, 15: 3, 16: 5, 18: 4, 20: 5, 30: 6, 31: 7, 32: 8,
    40: 9, 44: 10, 48: 11, 49: 12, 50: 13, 51: 14, 52: 0, 60: 9, 70: 15, 71: 16, 72: 17,
    80: 18, 81: 19, 99: 0, 252: 1, 253: 7, 254: 6, 255: 8, 256: 5, 257: 5, 258: 4, 259: 5,
}  # fmt: skip

#: Learning class -> the raw id it is written back as.
LEARNING_MAP_INV: dict[int, int] = {
    0: 0, 1: 10, 2: 11, 3: 15, 4: 18, 5: 20, 6: 30, 7: 31, 8: 32, 9: 40, 10: 44, 11: 48,
    12: 49, 13: 50, 14: 51, 15: 70, 16: 71, 17: 72, 18: 80, 19: 81,
}  # fmt: skip

#: Training class ``k`` (0..18) is learning class ``k + 1``.
CLASS_NAMES: tuple[str, ...] = (
    "car", "bicycle", "motorcycle", "truck", "other-vehicle", "person", "bicyclist",
    "motorcyclist", "road", "parking", "sidewalk", "other-ground", "building", "fence",
    "vegetation", "trunk", "terrain", "pole", "traffic-sign",
)  # fmt: skip

#: The training label of unlabeled points (learning class 0 and unknown raw ids).
IGNORE_LABEL = len(CLASS_NAMES)

#: The official sequence splits (the test sequences 11-21 have no labels).
SPLITS: dict[str, tuple[str, ...]] = {
    "train": ("00", "01", "02", "03", "04", "05", "06", "07", "09", "10"),
    "valid": ("08",),
    "test": tuple(f"{s:02d}" for s in range(11, 22)),
}

_LUT = np.full(1 << 16, IGNORE_LABEL, np.int32)
for _raw, _cls in LEARNING_MAP.items():
    _LUT[_raw] = _cls - 1 if _cls else IGNORE_LABEL


def training_labels(raw: np.ndarray) -> np.ndarray:
    """Training labels (int32, ``0..18`` and :data:`IGNORE_LABEL`) of raw
    ``.label`` words or semantic ids (the high 16 instance bits are dropped;
    raw ids outside the table are unlabeled).

    >>> training_labels(np.array([10, 252, 40, 60, 0, 52, (3 << 16) | 81, 1234])).tolist()
    [0, 0, 8, 8, 19, 19, 18, 19]
    """
    return _LUT[np.asarray(raw, np.int64) & 0xFFFF]
