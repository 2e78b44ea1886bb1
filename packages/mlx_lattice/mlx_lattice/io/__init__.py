"""Point clouds from files: readers for KITTI ``.bin``/``.label``, PLY,
LAS/LAZ (through ``laspy``), PCD and NumPy files, a binary PLY writer
(points with labels, colours or any per-point values), and labelled
datasets on disk (a SemanticKITTI tree, a folder of labelled files) for
training.

>>> from mlx_lattice.io import PointCloudFormatError, read_points
>>> try:
...     read_points("cloud.txt")
... except PointCloudFormatError as e:
...     print(e)
cloud.txt: unknown point cloud suffix '.txt' (known: .bin, .ply, .las, .laz, .pcd, .npy, .npz).
"""

from mlx_lattice.io import semantickitti
from mlx_lattice.io.datasets import PointCloudDataset, folder_dataset, semantickitti_dataset
from mlx_lattice.io.readers import (
    LABEL_FIELDS,
    LAS_FEATURES,
    SUFFIXES,
    PointCloud,
    PointCloudFormatError,
    read_kitti,
    read_las,
    read_npy,
    read_npz,
    read_pcd,
    read_ply,
    read_points,
)
from mlx_lattice.io.writers import write_ply

__all__ = [
    "LABEL_FIELDS",
    "LAS_FEATURES",
    "SUFFIXES",
    "PointCloud",
    "PointCloudDataset",
    "PointCloudFormatError",
    "folder_dataset",
    "read_kitti",
    "read_las",
    "read_npy",
    "read_npz",
    "read_pcd",
    "read_ply",
    "read_points",
    "semantickitti",
    "semantickitti_dataset",
    "write_ply",
]
