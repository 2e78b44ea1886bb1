// The one relation object the primitives share, and its validation.
//
// A kernel relation crosses from Python as one object (core/relations.py's
// KernelRelation, read by bindings.cpp into RelationArrays). A relation made
// by the native builder is valid by construction and carries its Relation
// (a capsule in the Python object); any other is validated once, memoized by
// the identities of its arrays, so an index array replaced or updated in
// place is checked again. Every primitive built on it holds the immutable
// Relation by shared pointer: the relation is graph-constant data, not a
// primitive input. Only fields some kernel reads cross the boundary.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "mlx/mlx.h"

namespace mlx_lattice {

namespace mx = mlx::core;

// A relation's arrays and sizes. Groupings: edges by output (offsets only:
// edges are stored grouped by output), by input and by kernel offset (offsets
// + edge ids). As handed over by the bindings it is unchecked; a validated
// one (evaluated, row-contiguous int32, indices in range, groupings
// consistent) is only ever held as a RelationPtr.
struct Relation {
  mx::array in_rows, out_rows, kernel_ids;
  mx::array out_offsets;
  mx::array in_offsets, in_edge_ids;
  mx::array k_offsets, k_edge_ids;
  int64_t n_in = 0, n_out = 0, n_kernels = 0;
  int64_t n_edges() const { return static_cast<int64_t>(in_rows.size()); }
};
using RelationPtr = std::shared_ptr<const Relation>;

// The relation as handed over by the bindings: unchecked arrays, and the
// relation as the native builder made it when the Python object carries it
// (valid by construction while the arrays are still the built ones).
struct RelationArrays : Relation {
  RelationPtr built;
};

// The sorted implicit-GEMM view of a relation (core/relations.py's
// SortedImplicitGemmView): sorted_out_in_map (n_out, K), reorder_rows (n_out,)
// and tile_masks (ceil(n_out / kSortedTileRows),).
struct SortedArrays {
  mx::array sorted_map, reorder, tile_masks;
};
using SortedPtr = std::shared_ptr<const SortedArrays>;

// The validated relation of `r`: `r.built` while `r` still holds exactly its
// arrays (an array replaced or updated in place has another identity), else
// the memoized result of checking `r`. Raises ValueError naming `op` and the
// offending field.
RelationPtr validated_relation(const std::string& op, const RelationArrays& r);

// Validates a sorted view against its (validated) relation.
SortedPtr validated_sorted_view(const std::string& op, const SortedArrays& v,
                                const RelationPtr& rel);

// Checks that no input row feeds more than one output (remembered too).
void check_input_exclusive(const std::string& op, const RelationPtr& rel);

// Checks that no input row has two edges of one kernel offset (remembered
// too): the convolution's feature gradient runs over the input rows with
// the output-side layout and needs it. kNN relations break it (a point can
// be the k-th neighbour of many queries).
void check_input_offsets_distinct(const std::string& op, const RelationPtr& rel);

}  // namespace mlx_lattice
