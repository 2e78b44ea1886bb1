"""Built-in data: a seeded synthetic LiDAR scene with a semantic label per
point, labelled train/validation splits and segmentation scores, so demos
and tests need no download."""

from mlx_lattice.data.lidar import (
    CLASS_NAMES,
    LidarScan,
    SceneConfig,
    synthetic_lidar_scan,
    voxelize_points,
)
from mlx_lattice.data.segmentation import (
    DEFAULT_FEATURES,
    HEIGHT_SCALE,
    LabelledScans,
    SegmentationBatch,
    confusion_matrix,
    iou_per_class,
    labelled_scans,
    make_batch,
    mean_iou,
    parse_features,
    point_feature_columns,
    voxel_labels,
)

__all__ = [
    "CLASS_NAMES",
    "DEFAULT_FEATURES",
    "HEIGHT_SCALE",
    "LabelledScans",
    "LidarScan",
    "SceneConfig",
    "SegmentationBatch",
    "confusion_matrix",
    "iou_per_class",
    "labelled_scans",
    "make_batch",
    "mean_iou",
    "parse_features",
    "point_feature_columns",
    "synthetic_lidar_scan",
    "voxel_labels",
    "voxelize_points",
]
