"""Sparse 3-D convolution on MLX.

* :class:`SparseTensor` (coordinates, features, tensor stride) and
  :func:`sparse_collate`;
* :mod:`mlx_lattice.ops`: functional sparse convolution, pooling and
  feature ops; :mod:`mlx_lattice.nn`: the same as ``mlx.nn.Module`` layers;
* :func:`quantize`: rule-based quantization of convolution and linear layers
  through ``quantrules``; :func:`to_quantized` for one layer;
* :func:`compile`: a model's inference graph (norms folded into the
  convolutions, fused epilogues); :func:`calibrate`: static activation
  scales from a few scans;
* :mod:`mlx_lattice.core`: coordinates, kernel relations, quantized weights
  and the ops layer over the native MLX primitives;
* :mod:`mlx_lattice.data`: a seeded synthetic LiDAR scan;
* :mod:`mlx_lattice.io`: point cloud files (KITTI, PLY, PCD, LAS/LAZ, NumPy)
  and labelled datasets on disk (SemanticKITTI, a folder of labelled files);
* :func:`retain_freed_memory`: faster CPU training steps on glibc (freed
  arrays stay in the process for reuse).
"""

from mlx_lattice._caches import clear_caches, set_weight_cache_budget, weight_cache_info
from mlx_lattice._errors import MlxLatticeError, MlxLatticeTypeError
from mlx_lattice._isa import (
    get_kernel_isa,
    get_kernel_l2_bytes,
    get_kernel_names,
    set_kernel_isa,
    set_kernel_l2_bytes,
)
from mlx_lattice._memory import retain_freed_memory
from mlx_lattice._threads import get_num_threads, set_num_threads
from mlx_lattice._version import __version__
from mlx_lattice.inference import calibrate, compile
from mlx_lattice.nn import to_quantized
from mlx_lattice.quantize import QuantizationReport, calibrate_activation_scales, quantize
from mlx_lattice.tensor import CoordinateManager, SparseTensor, SparseTensorError, sparse_collate

__all__ = [
    "CoordinateManager",
    "MlxLatticeError",
    "MlxLatticeTypeError",
    "QuantizationReport",
    "SparseTensor",
    "SparseTensorError",
    "__version__",
    "calibrate",
    "calibrate_activation_scales",
    "clear_caches",
    "compile",
    "get_kernel_isa",
    "get_kernel_l2_bytes",
    "get_kernel_names",
    "get_num_threads",
    "quantize",
    "retain_freed_memory",
    "set_kernel_isa",
    "set_kernel_l2_bytes",
    "set_num_threads",
    "set_weight_cache_budget",
    "sparse_collate",
    "to_quantized",
    "weight_cache_info",
]
