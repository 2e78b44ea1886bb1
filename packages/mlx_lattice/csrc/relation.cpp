#include "relation.h"

#include <string>
#include <vector>

#include "common.h"
#include "cpu/sorted_conv.h"
#include "validate.h"

namespace mlx_lattice {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

std::vector<mx::array> arrays_of(const Relation& r) {
  return {r.in_rows,   r.out_rows,    r.kernel_ids, r.out_offsets,
          r.in_offsets, r.in_edge_ids, r.k_offsets,  r.k_edge_ids};
}

std::string dims_tag(const char* what, int64_t n_in, int64_t n_out, int64_t n_kernels) {
  return std::string(what) + "/" + str(n_in) + "/" + str(n_out) + "/" + str(n_kernels);
}

Relation check_relation(const std::string& op, const RelationArrays& r) {
  if (r.n_in < 0 || r.n_out < 0) fail(op, "relation row counts must be >= 0.");
  if (r.n_kernels < 1) fail(op, "relation.n_kernels must be >= 1, got " + str(r.n_kernels) + ".");
  auto a = concrete_indices(op,
                            {{"in_rows", r.in_rows},
                             {"out_rows", r.out_rows},
                             {"kernel_ids", r.kernel_ids},
                             {"output_row_offsets", r.out_offsets},
                             {"input_row_offsets", r.in_offsets},
                             {"input_edge_ids", r.in_edge_ids},
                             {"kernel_row_offsets", r.k_offsets},
                             {"kernel_edge_ids", r.k_edge_ids}},
                            {1, 1, 1, 1, 1, 1, 1, 1});
  Relation rel{a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], r.n_in, r.n_out, r.n_kernels};
  const int64_t n_edges = rel.n_edges();
  if (static_cast<int64_t>(rel.out_rows.size()) != n_edges ||
      static_cast<int64_t>(rel.kernel_ids.size()) != n_edges) {
    fail(op, "in_rows, out_rows and kernel_ids must have one length, got " + str(n_edges) + ", " +
                 str(rel.out_rows.size()) + " and " + str(rel.kernel_ids.size()) + ".");
  }
  check_range(op, "in_rows", rel.in_rows, 0, rel.n_in);
  check_range(op, "out_rows", rel.out_rows, 0, rel.n_out);
  check_range(op, "kernel_ids", rel.kernel_ids, 0, rel.n_kernels);
  check_offsets(op, "output_row_offsets", rel.out_offsets, rel.n_out, n_edges);
  check_grouping(op, "output_row_offsets", "", rel.out_offsets, nullptr, "out_rows", rel.out_rows);
  check_distinct_kernels(op, "output", rel.out_offsets, nullptr, rel.kernel_ids, rel.n_kernels);
  check_offsets(op, "input_row_offsets", rel.in_offsets, rel.n_in, n_edges);
  if (static_cast<int64_t>(rel.in_edge_ids.size()) != n_edges) {
    fail(op, "input_edge_ids must have " + str(n_edges) + " entries.");
  }
  check_grouping(op, "input_row_offsets", "input_edge_ids", rel.in_offsets, &rel.in_edge_ids,
                 "in_rows", rel.in_rows);
  check_offsets(op, "kernel_row_offsets", rel.k_offsets, rel.n_kernels, n_edges);
  if (static_cast<int64_t>(rel.k_edge_ids.size()) != n_edges) {
    fail(op, "kernel_edge_ids must have " + str(n_edges) + " entries.");
  }
  check_grouping(op, "kernel_row_offsets", "kernel_edge_ids", rel.k_offsets, &rel.k_edge_ids,
                 "kernel_ids", rel.kernel_ids);
  return rel;
}

// A permutation, a map of (n_out, K) input rows or -1, tile masks covering
// every present offset of their rows, and the same edges as the relation.
SortedArrays check_sorted(const std::string& op, const SortedArrays& v, const Relation& rel) {
  auto a = concrete_indices(op,
                            {{"sorted_out_in_map", v.sorted_map},
                             {"reorder_rows", v.reorder},
                             {"tile_masks", v.tile_masks}},
                            {2, 1, 1});
  const int64_t n_out = rel.n_out, n_kernels = rel.n_kernels;
  if (n_kernels > 32) fail(op, "the sorted view supports at most 32 kernel offsets.");
  if (a[0].shape(0) != n_out || a[0].shape(1) != n_kernels) {
    fail(op, "sorted_out_in_map must be (n_out, n_kernels) = (" + str(n_out) + ", " +
                 str(n_kernels) + "), got " + shape_str(a[0].shape()) + ".");
  }
  check_range(op, "sorted_out_in_map", a[0], -1, rel.n_in);
  if (static_cast<int64_t>(a[1].size()) != n_out) {
    fail(op, "reorder_rows must have n_out = " + str(n_out) + " entries.");
  }
  check_range(op, "reorder_rows", a[1], 0, n_out);
  std::vector<uint8_t> seen(n_out, 0);
  const int32_t* perm = idx_or_null(a[1]);
  for (int64_t r = 0; r < n_out; ++r) {
    if (seen[perm[r]]++) fail(op, "reorder_rows must be a permutation; " + str(perm[r]) + " repeats.");
  }
  const int64_t rows = kernels::kSortedTileRows;
  const int64_t tiles = (n_out + rows - 1) / rows;
  if (static_cast<int64_t>(a[2].size()) != tiles) {
    fail(op, "tile_masks must have ceil(n_out / " + str(rows) + ") = " + str(tiles) +
                 " entries, got " + str(a[2].size()) + ".");
  }
  const int32_t* map = idx_or_null(a[0]);
  const int32_t* masks = idx_or_null(a[2]);
  for (int64_t r = 0; r < n_out; ++r) {
    const uint32_t mask = static_cast<uint32_t>(masks[r / rows]);
    for (int64_t k = 0; k < n_kernels; ++k) {
      if (map[r * n_kernels + k] >= 0 && !((mask >> k) & 1u)) {
        fail(op, "tile_masks[" + str(r / rows) + "] lacks kernel offset " + str(k) +
                     " present in sorted row " + str(r) + ".");
      }
    }
  }
  const int32_t* off = idx_or_null(rel.out_offsets);
  const int32_t* in = idx_or_null(rel.in_rows);
  const int32_t* kid = idx_or_null(rel.kernel_ids);
  for (int64_t r = 0; r < n_out; ++r) {
    const int64_t o = perm[r];
    int64_t present = 0;
    for (int64_t k = 0; k < n_kernels; ++k) present += map[r * n_kernels + k] >= 0;
    bool same = present == off[o + 1] - off[o];
    for (int64_t e = off[o]; same && e < off[o + 1]; ++e) {
      same = map[r * n_kernels + kid[e]] == in[e];
    }
    if (!same) {
      fail(op, "sorted row " + str(r) + " (output row " + str(o) +
                   ") does not match the relation's edges of that output.");
    }
  }
  return {a[0], a[1], a[2]};
}

}  // namespace

RelationPtr validated_relation(const std::string& op, const RelationArrays& r) {
  if (r.built) {
    const Relation& b = *r.built;
    auto built = arrays_of(b), given = arrays_of(r);
    bool same = b.n_in == r.n_in && b.n_out == r.n_out && b.n_kernels == r.n_kernels;
    for (size_t i = 0; same && i < built.size(); ++i) same = built[i].id() == given[i].id();
    if (same) return r.built;
  }
  return std::static_pointer_cast<const Relation>(
      validated(dims_tag("relation", r.n_in, r.n_out, r.n_kernels), arrays_of(r),
                [&] { return std::make_shared<const Relation>(check_relation(op, r)); }));
}

SortedPtr validated_sorted_view(const std::string& op, const SortedArrays& v,
                                const RelationPtr& rel) {
  auto keys = arrays_of(*rel);
  keys.insert(keys.end(), {v.sorted_map, v.reorder, v.tile_masks});
  return std::static_pointer_cast<const SortedArrays>(
      validated(dims_tag("sorted", rel->n_in, rel->n_out, rel->n_kernels), keys,
                [&] { return std::make_shared<const SortedArrays>(check_sorted(op, v, *rel)); }));
}

void check_input_exclusive(const std::string& op, const RelationPtr& rel) {
  validated(dims_tag("exclusive", rel->n_in, rel->n_out, rel->n_kernels), arrays_of(*rel), [&] {
    std::vector<uint8_t> used(rel->n_in, 0);
    const int32_t* rows = idx_or_null(rel->in_rows);
    for (int64_t e = 0; e < rel->n_edges(); ++e) {
      if (used[rows[e]]++) {
        fail(op, "input_exclusive=True but input row " + str(rows[e]) +
                     " feeds more than one output (windows overlap); pass False.");
      }
    }
    return std::shared_ptr<const void>(rel);
  });
}

void check_input_offsets_distinct(const std::string& op, const RelationPtr& rel) {
  validated(dims_tag("input offsets", rel->n_in, rel->n_out, rel->n_kernels), arrays_of(*rel),
            [&] {
              const auto [g, k] = first_repeated_kernel(rel->in_offsets, &rel->in_edge_ids,
                                                        rel->kernel_ids, rel->n_kernels);
              if (g >= 0) {
                fail(op, "the feature gradient needs at most one edge per (input row, kernel "
                         "offset), but input row " + str(g) + " has two edges of offset " +
                         str(k) + " (a kNN relation, say); use neighbor_conv to "
                         "differentiate a convolution over neighbours.");
              }
              return std::shared_ptr<const void>(rel);
            });
}

}  // namespace mlx_lattice
