"""The engine of mlx_lattice: coordinates, kernel relations, quantized
weights and the ops layer over the native primitives."""

from mlx_lattice.core.coordinates import check_coordinates
from mlx_lattice.core.quantized import QuantizedWeight
from mlx_lattice.core.relations import (
    KernelRelation,
    RelationContract,
    RelationCSR,
    RelationEdges,
    SortedImplicitGemmView,
    build_kernel_relation,
    kernel_offsets,
)

__all__ = [
    "KernelRelation",
    "QuantizedWeight",
    "RelationCSR",
    "RelationContract",
    "RelationEdges",
    "SortedImplicitGemmView",
    "build_kernel_relation",
    "check_coordinates",
    "kernel_offsets",
]
