"""The engine of mlx_lattice: coordinates, kernel relations, quantized
weights, the ops layer over the native primitives, and the dataflow choice."""

from mlx_lattice.core.coordinates import check_coordinates
from mlx_lattice.core.dataflow import (
    DataflowError,
    get_dataflow,
    record_dataflows,
    set_dataflow,
    use_dataflow,
)
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
    "DataflowError",
    "KernelRelation",
    "QuantizedWeight",
    "RelationCSR",
    "RelationContract",
    "RelationEdges",
    "SortedImplicitGemmView",
    "build_kernel_relation",
    "check_coordinates",
    "get_dataflow",
    "kernel_offsets",
    "record_dataflows",
    "set_dataflow",
    "use_dataflow",
]
