// The public operations: argument checks, index validation, dtype handling.
#include <sstream>

#include "common.h"
#include "primitives.h"
#include "sparse_ops.h"
#include "validate.h"

namespace mlx_lattice {

namespace {

using Conv = SparseConv::Mode;

std::string str(int64_t v) { return std::to_string(v); }

void check_features(const std::string& op, const mx::array& feats) {
  check_float_dtype(op.c_str(), "feats", feats);
  if (feats.ndim() != 2 || feats.shape(1) < 1) {
    fail(op, "feats must be (N, C) with C >= 1, got shape " + shape_str(feats.shape()) + ".");
  }
}

void check_static(const std::string& op, int n_out_capacity, int n_kernels) {
  if (n_out_capacity < 0) fail(op, "n_out_capacity must be >= 0, got " + str(n_out_capacity) + ".");
  if (n_kernels < 1) fail(op, "n_kernels must be >= 1, got " + str(n_kernels) + ".");
}

// (K, Cin, Cout) or (Cout, kx, ky, kz, Cin) -> (K, Cin, Cout).
mx::array conv_weight(const std::string& op, const mx::array& weight, int64_t n_kernels,
                      int64_t cin, mx::Stream s) {
  check_float_dtype(op.c_str(), "weight", weight);
  if (weight.ndim() == 3) {
    if (weight.shape(0) != n_kernels || weight.shape(1) != cin || weight.shape(2) < 1) {
      fail(op, "weight must be (K, Cin, Cout) = (" + str(n_kernels) + ", " + str(cin) +
                   ", Cout), got " + shape_str(weight.shape()) + ".");
    }
    return weight;
  }
  if (weight.ndim() == 5) {
    if (static_cast<int64_t>(weight.shape(1)) * weight.shape(2) * weight.shape(3) != n_kernels ||
        weight.shape(4) != cin || weight.shape(0) < 1) {
      fail(op, "weight must be (Cout, kx, ky, kz, Cin) with kx*ky*kz = " + str(n_kernels) +
                   " and Cin = " + str(cin) + ", got " + shape_str(weight.shape()) + ".");
    }
    return mx::reshape(mx::transpose(weight, {1, 2, 3, 4, 0}, s),
                       {static_cast<int>(n_kernels), static_cast<int>(cin), weight.shape(0)}, s);
  }
  fail(op, "weight must be 3-D (K, Cin, Cout) or 5-D (Cout, kx, ky, kz, Cin), got shape " +
               shape_str(weight.shape()) + ".");
}

// counts[k] must be the number of edges of kernel offset k.
void check_counts(const std::string& op, const mx::array& counts, const mx::array& kernel_ids,
                  int64_t n_kernels) {
  if (static_cast<int64_t>(counts.size()) != n_kernels) {
    fail(op, "counts must have n_kernels = " + str(n_kernels) + " entries, got " +
                 str(counts.size()) + ".");
  }
  std::vector<int64_t> hist(n_kernels, 0);
  const int32_t* kid = idx_or_null(kernel_ids);
  for (size_t e = 0; e < kernel_ids.size(); ++e) ++hist[kid[e]];
  const int32_t* cnt = idx_or_null(counts);
  for (int64_t k = 0; k < n_kernels; ++k) {
    if (cnt[k] != hist[k]) {
      fail(op, "counts[" + str(k) + "] = " + str(cnt[k]) + " but the relation has " +
                   str(hist[k]) + " edges of kernel offset " + str(k) + ".");
    }
  }
}

RelationArrays validate_relation(const std::string& op, const mx::array& in_rows,
                                 const mx::array& out_rows, const mx::array& kernel_ids,
                                 const mx::array& counts, const mx::array& out_offsets,
                                 const mx::array& in_offsets, const mx::array& in_edge_ids,
                                 const mx::array& k_offsets, const mx::array& k_edge_ids,
                                 ConvDims d) {
  auto a = concrete_indices(op,
                            {{"in_rows", in_rows},
                             {"out_rows", out_rows},
                             {"kernel_ids", kernel_ids},
                             {"counts", counts},
                             {"output_row_offsets", out_offsets},
                             {"input_row_offsets", in_offsets},
                             {"input_edge_ids", in_edge_ids},
                             {"kernel_row_offsets", k_offsets},
                             {"kernel_edge_ids", k_edge_ids}},
                            {1, 1, 1, 1, 1, 1, 1, 1, 1});
  RelationArrays rel{a[0], a[1], a[2], a[4], a[5], a[6], a[7], a[8]};
  const int64_t n_edges = rel.in_rows.size();
  if (static_cast<int64_t>(rel.out_rows.size()) != n_edges ||
      static_cast<int64_t>(rel.kernel_ids.size()) != n_edges) {
    fail(op, "in_rows, out_rows and kernel_ids must have one length, got " + str(n_edges) + ", " +
                 str(rel.out_rows.size()) + " and " + str(rel.kernel_ids.size()) + ".");
  }
  check_range(op, "in_rows", rel.in_rows, 0, d.n_in);
  check_range(op, "out_rows", rel.out_rows, 0, d.n_out);
  check_range(op, "kernel_ids", rel.kernel_ids, 0, d.n_kernels);
  check_offsets(op, "output_row_offsets", rel.out_offsets, d.n_out, n_edges);
  check_grouping(op, "output_row_offsets", "", rel.out_offsets, nullptr, "out_rows", rel.out_rows);
  check_distinct_kernels(op, "output", rel.out_offsets, nullptr, rel.kernel_ids, d.n_kernels);
  check_counts(op, a[3], rel.kernel_ids, d.n_kernels);
  if (rel.in_offsets.size() || rel.in_edge_ids.size()) {
    check_offsets(op, "input_row_offsets", rel.in_offsets, d.n_in, n_edges);
    if (static_cast<int64_t>(rel.in_edge_ids.size()) != n_edges) {
      fail(op, "input_edge_ids must have " + str(n_edges) + " entries.");
    }
    check_grouping(op, "input_row_offsets", "input_edge_ids", rel.in_offsets, &rel.in_edge_ids,
                   "in_rows", rel.in_rows);
    check_distinct_kernels(op, "input", rel.in_offsets, &rel.in_edge_ids, rel.kernel_ids,
                           d.n_kernels);
  }
  if (rel.k_offsets.size() || rel.k_edge_ids.size()) {
    check_offsets(op, "kernel_row_offsets", rel.k_offsets, d.n_kernels, n_edges);
    if (static_cast<int64_t>(rel.k_edge_ids.size()) != n_edges) {
      fail(op, "kernel_edge_ids must have " + str(n_edges) + " entries.");
    }
    check_grouping(op, "kernel_row_offsets", "kernel_edge_ids", rel.k_offsets, &rel.k_edge_ids,
                   "kernel_ids", rel.kernel_ids);
  }
  return rel;
}

mx::array empty_i32() { return mx::zeros({0}, mx::int32); }

struct SortedView {
  mx::array sorted_map, reorder, tile_masks;
};

// Checks the sorted implicit-GEMM view: a permutation, a map of (n_out, K)
// input rows or -1 (and its offset-major copy when given), and tile masks
// covering every present offset of their rows.
SortedView validate_sorted(const std::string& op, const mx::array& sorted_map,
                           const mx::array* sorted_kv, const mx::array& reorder,
                           const mx::array& tile_masks, ConvDims d) {
  std::vector<std::pair<std::string, mx::array>> named = {{"sorted_out_in_map", sorted_map},
                                                          {"reorder_rows", reorder},
                                                          {"tile_masks", tile_masks}};
  std::vector<int> ndims = {2, 1, 1};
  if (sorted_kv) {
    named.push_back({"sorted_kv_out_in_map", *sorted_kv});
    ndims.push_back(2);
  }
  auto a = concrete_indices(op, named, ndims);
  if (d.n_kernels > 32) fail(op, "the sorted view supports at most 32 kernel offsets.");
  if (a[0].shape(0) != d.n_out || a[0].shape(1) != d.n_kernels) {
    fail(op, "sorted_out_in_map must be (n_out, n_kernels) = (" + str(d.n_out) + ", " +
                 str(d.n_kernels) + "), got " + shape_str(a[0].shape()) + ".");
  }
  check_range(op, "sorted_out_in_map", a[0], -1, d.n_in);
  if (static_cast<int64_t>(a[1].size()) != d.n_out) {
    fail(op, "reorder_rows must have n_out = " + str(d.n_out) + " entries.");
  }
  check_range(op, "reorder_rows", a[1], 0, d.n_out);
  std::vector<uint8_t> seen(d.n_out, 0);
  const int32_t* perm = idx_or_null(a[1]);
  for (int64_t r = 0; r < d.n_out; ++r) {
    if (seen[perm[r]]++) fail(op, "reorder_rows must be a permutation; " + str(perm[r]) + " repeats.");
  }
  const int64_t tiles = (d.n_out + kernels::kSortedTileRows - 1) / kernels::kSortedTileRows;
  if (static_cast<int64_t>(a[2].size()) != tiles) {
    fail(op, "tile_masks must have ceil(n_out / " + str(kernels::kSortedTileRows) +
                 ") = " + str(tiles) + " entries, got " + str(a[2].size()) + ".");
  }
  const int32_t* map = idx_or_null(a[0]);
  const int32_t* masks = idx_or_null(a[2]);
  for (int64_t r = 0; r < d.n_out; ++r) {
    uint32_t mask = static_cast<uint32_t>(masks[r / kernels::kSortedTileRows]);
    for (int64_t k = 0; k < d.n_kernels; ++k) {
      if (map[r * d.n_kernels + k] >= 0 && !((mask >> k) & 1u)) {
        fail(op, "tile_masks[" + str(r / kernels::kSortedTileRows) + "] lacks kernel offset " +
                     str(k) + " present in sorted row " + str(r) + ".");
      }
    }
  }
  if (sorted_kv) {
    if (a[3].shape(0) != d.n_kernels || a[3].shape(1) != d.n_out) {
      fail(op, "sorted_kv_out_in_map must be (n_kernels, n_out), got " + shape_str(a[3].shape()) +
                   ".");
    }
    const int32_t* kv = idx_or_null(a[3]);
    for (int64_t r = 0; r < d.n_out; ++r) {
      for (int64_t k = 0; k < d.n_kernels; ++k) {
        if (kv[k * d.n_out + r] != map[r * d.n_kernels + k]) {
          fail(op, "sorted_kv_out_in_map must be the transpose of sorted_out_in_map.");
        }
      }
    }
  }
  return {a[0], a[1], a[2]};
}

// The sorted map must describe the same edges as the relation.
void check_sorted_matches(const std::string& op, const SortedView& view,
                          const RelationArrays& rel, ConvDims d) {
  const int32_t* map = idx_or_null(view.sorted_map);
  const int32_t* perm = idx_or_null(view.reorder);
  const int32_t* off = idx_or_null(rel.out_offsets);
  const int32_t* in = idx_or_null(rel.in_rows);
  const int32_t* kid = idx_or_null(rel.kernel_ids);
  for (int64_t r = 0; r < d.n_out; ++r) {
    const int64_t o = perm[r];
    int64_t present = 0;
    for (int64_t k = 0; k < d.n_kernels; ++k) present += map[r * d.n_kernels + k] >= 0;
    bool same = present == off[o + 1] - off[o];
    for (int64_t e = off[o]; same && e < off[o + 1]; ++e) {
      same = map[r * d.n_kernels + kid[e]] == in[e];
    }
    if (!same) {
      fail(op, "sorted row " + str(r) + " (output row " + str(o) +
                   ") does not match the relation's edges of that output.");
    }
  }
}

std::string tag(const std::string& op, ConvDims d, const std::string& extra = "") {
  return op + "/" + std::to_string(d.n_in) + "/" + std::to_string(d.n_out) + "/" +
         std::to_string(d.n_kernels) + "/" + extra;
}

std::vector<mx::array> join(std::vector<mx::array> a, const std::vector<mx::array>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<mx::array> check_denominator_indices(const std::string& op,
                                                 const mx::array& kernel_ids,
                                                 const mx::array& counts,
                                                 const mx::array& output_row_offsets,
                                                 int64_t n_kernels) {
  auto a = concrete_indices(
      op, {{"kernel_ids", kernel_ids}, {"counts", counts}, {"output_row_offsets", output_row_offsets}},
      {1, 1, 1});
  const int64_t n_edges = a[0].size();
  if (a[2].size() < 1) fail(op, "output_row_offsets must have n_out + 1 >= 1 entries.");
  const int64_t n_out = static_cast<int64_t>(a[2].size()) - 1;
  check_range(op, "kernel_ids", a[0], 0, n_kernels);
  check_offsets(op, "output_row_offsets", a[2], n_out, n_edges);
  check_counts(op, a[1], a[0], n_kernels);
  return a;
}

}  // namespace

mx::array sparse_conv_features(const mx::array& feats, const mx::array& weight,
                               const mx::array& in_rows, const mx::array& out_rows,
                               const mx::array& kernel_ids, const mx::array& counts,
                               const mx::array& output_row_offsets,
                               const mx::array& input_row_offsets, const mx::array& input_edge_ids,
                               const mx::array& kernel_row_offsets,
                               const mx::array& kernel_edge_ids, int n_out_capacity, int n_kernels,
                               mx::StreamOrDevice s) {
  const std::string op = "sparse_conv_features";
  auto stream = mx::to_stream(s);
  check_features(op, feats);
  check_static(op, n_out_capacity, n_kernels);
  auto w = conv_weight(op, weight, n_kernels, feats.shape(1), stream);
  ConvDims d{feats.shape(0), n_out_capacity, n_kernels};
  auto rel = RelationArrays::from(
      validated(tag(op, d),
                {in_rows, out_rows, kernel_ids, counts, output_row_offsets, input_row_offsets,
                 input_edge_ids, kernel_row_offsets, kernel_edge_ids},
                [&] {
                  return validate_relation(op, in_rows, out_rows, kernel_ids, counts,
                                           output_row_offsets, input_row_offsets, input_edge_ids,
                                           kernel_row_offsets, kernel_edge_ids, d)
                      .list();
                }),
      0);
  return mx::astype(make_conv(Conv::kForward, feats, w, rel, d, stream), feats.dtype(),
                    stream);
}

mx::array sparse_conv_features_sorted_implicit_gemm(
    const mx::array& feats, const mx::array& weight, const mx::array& sorted_out_in_map,
    const mx::array& sorted_kv_out_in_map, const mx::array& reorder_rows,
    const mx::array& tile_masks, const mx::array& in_rows, const mx::array& out_rows,
    const mx::array& kernel_ids, const mx::array& counts, const mx::array& output_row_offsets,
    const mx::array& input_row_offsets, const mx::array& input_edge_ids,
    const mx::array& kernel_row_offsets, const mx::array& kernel_edge_ids, int n_out_capacity,
    int n_kernels, bool store_sorted, mx::StreamOrDevice s) {
  const std::string op = "sparse_conv_features_sorted_implicit_gemm";
  auto stream = mx::to_stream(s);
  check_features(op, feats);
  check_static(op, n_out_capacity, n_kernels);
  if (weight.ndim() != 3) {
    fail(op, "weight must be the mapped (K, Cin, Cout) weight, got shape " +
                 shape_str(weight.shape()) + ".");
  }
  auto w = conv_weight(op, weight, n_kernels, feats.shape(1), stream);
  ConvDims d{feats.shape(0), n_out_capacity, n_kernels};
  auto checked = validated(
      tag(op, d),
      {in_rows, out_rows, kernel_ids, counts, output_row_offsets, input_row_offsets,
       input_edge_ids, kernel_row_offsets, kernel_edge_ids, sorted_out_in_map,
       sorted_kv_out_in_map, reorder_rows, tile_masks},
      [&] {
        auto rel = validate_relation(op, in_rows, out_rows, kernel_ids, counts,
                                     output_row_offsets, input_row_offsets, input_edge_ids,
                                     kernel_row_offsets, kernel_edge_ids, d);
        auto view = validate_sorted(op, sorted_out_in_map, &sorted_kv_out_in_map, reorder_rows,
                                    tile_masks, d);
        check_sorted_matches(op, view, rel, d);
        return join(rel.list(), {view.sorted_map, view.reorder, view.tile_masks});
      });
  auto rel = RelationArrays::from(checked, 0);
  SortedView view{checked[8], checked[9], checked[10]};
  return mx::astype(
      make_sorted(feats, w, view.sorted_map, view.reorder, rel, d, store_sorted, stream),
      feats.dtype(), stream);
}

mx::array sparse_conv_features_sorted_direct_reference(
    const mx::array& feats, const mx::array& weight, const mx::array& sorted_out_in_map,
    const mx::array& reorder_rows, const mx::array& tile_masks, int n_out_capacity, int n_kernels,
    bool store_sorted, mx::StreamOrDevice s) {
  const std::string op = "sparse_conv_features_sorted_direct_reference";
  auto stream = mx::to_stream(s);
  check_features(op, feats);
  check_static(op, n_out_capacity, n_kernels);
  if (weight.ndim() != 3) {
    fail(op, "weight must be the mapped (K, Cin, Cout) weight, got shape " +
                 shape_str(weight.shape()) + ".");
  }
  auto w = conv_weight(op, weight, n_kernels, feats.shape(1), stream);
  ConvDims d{feats.shape(0), n_out_capacity, n_kernels};
  auto checked = validated(tag(op, d), {sorted_out_in_map, reorder_rows, tile_masks}, [&] {
    auto view = validate_sorted(op, sorted_out_in_map, nullptr, reorder_rows, tile_masks, d);
    return std::vector<mx::array>{view.sorted_map, view.reorder, view.tile_masks};
  });
  SortedView view{checked[0], checked[1], checked[2]};
  return mx::astype(make_direct(feats, w, view.sorted_map, view.reorder, view.tile_masks, d,
                                store_sorted, stream),
                    feats.dtype(), stream);
}

mx::array sparse_quantized_conv_features(
    const mx::array& feats, const mx::array& weight, const mx::array& scales,
    const mx::array& biases, const mx::array& in_rows, const mx::array& out_rows,
    const mx::array& kernel_ids, const mx::array& counts, const mx::array& output_row_offsets,
    const mx::array& sorted_kv_out_in_map, const mx::array& reorder_rows,
    const mx::array& tile_masks, int n_out_capacity, int n_kernels, int in_channels,
    int out_channels, int storage_in_channels, int group_size, int bits, mx::StreamOrDevice s) {
  const std::string op = "sparse_quantized_conv_features";
  auto stream = mx::to_stream(s);
  check_features(op, feats);
  check_static(op, n_out_capacity, n_kernels);
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    fail(op, "bits must be one of 2, 3, 4, 5, 6, 8, got " + str(bits) + ".");
  }
  if (group_size < 1 || in_channels < 1 || out_channels < 1 ||
      storage_in_channels < in_channels || storage_in_channels % group_size != 0 ||
      (static_cast<int64_t>(storage_in_channels) * bits) % 32 != 0) {
    fail(op, "need 1 <= in_channels <= storage_in_channels, storage_in_channels a multiple of "
             "group_size and of 32 / gcd(bits, 32); got in_channels=" + str(in_channels) +
             ", storage_in_channels=" + str(storage_in_channels) + ", group_size=" +
             str(group_size) + ", bits=" + str(bits) + ".");
  }
  if (feats.shape(1) != in_channels) {
    fail(op, "feats must have in_channels = " + str(in_channels) + " columns, got " +
                 str(feats.shape(1)) + ".");
  }
  const int packed_cols = static_cast<int>(static_cast<int64_t>(storage_in_channels) * bits / 32);
  mx::Shape packed_shape = {n_kernels, out_channels, packed_cols};
  mx::Shape group_shape = {n_kernels, out_channels, storage_in_channels / group_size};
  if (weight.dtype() != mx::uint32 || weight.shape() != packed_shape) {
    fail(op, "weight must be uint32 of shape " + shape_str(packed_shape) + ", got " +
                 dtype_str(weight.dtype()) + " " + shape_str(weight.shape()) + ".");
  }
  check_float_dtype(op.c_str(), "scales", scales);
  check_float_dtype(op.c_str(), "biases", biases);
  if (scales.shape() != group_shape || biases.shape() != group_shape) {
    fail(op, "scales and biases must have shape " + shape_str(group_shape) + ", got " +
                 shape_str(scales.shape()) + " and " + shape_str(biases.shape()) + ".");
  }
  ConvDims d{feats.shape(0), n_out_capacity, n_kernels};
  auto checked = validated(
      tag(op, d),
      {in_rows, out_rows, kernel_ids, counts, output_row_offsets, sorted_kv_out_in_map,
       reorder_rows, tile_masks},
      [&] {
        auto empty = empty_i32();
        auto rel = validate_relation(op, in_rows, out_rows, kernel_ids, counts,
                                     output_row_offsets, empty, empty, empty, empty, d);
        if (sorted_kv_out_in_map.size() || reorder_rows.size() || tile_masks.size()) {
          // The sorted view serves the GPU kernels; check it like the float path.
          if (sorted_kv_out_in_map.ndim() != 2) {
            fail(op, "sorted_kv_out_in_map must be (n_kernels, n_out), got shape " +
                         shape_str(sorted_kv_out_in_map.shape()) + ".");
          }
          auto map = mx::transpose(sorted_kv_out_in_map, {1, 0}, stream);
          auto view = validate_sorted(op, map, &sorted_kv_out_in_map, reorder_rows, tile_masks, d);
          check_sorted_matches(op, view, rel, d);
        }
        return rel.list();
      });
  auto rel = RelationArrays::from(checked, 0);
  auto packed = mx::contiguous(weight, false, stream);
  QuantSpec spec{in_channels, out_channels, storage_in_channels, group_size, bits};
  return mx::astype(
      make_quantized(feats, {packed, scales, biases}, rel, d, spec, stream),
      feats.dtype(), stream);
}

mx::array sparse_conv_normalization_denominator(const mx::array& weight,
                                                const mx::array& kernel_ids,
                                                const mx::array& counts,
                                                const mx::array& output_row_offsets,
                                                mx::StreamOrDevice s) {
  const std::string op = "sparse_conv_normalization_denominator";
  auto stream = mx::to_stream(s);
  check_float_dtype(op.c_str(), "weight", weight);
  if (weight.ndim() != 3 || weight.shape(0) < 1 || weight.shape(2) < 1) {
    fail(op, "weight must be the mapped (K, Cin, Cout) weight, got shape " +
                 shape_str(weight.shape()) + ".");
  }
  const int64_t n_kernels = weight.shape(0);
  auto a = validated(tag(op, {0, 0, n_kernels}), {kernel_ids, counts, output_row_offsets}, [&] {
    return check_denominator_indices(op, kernel_ids, counts, output_row_offsets, n_kernels);
  });
  const int64_t n_out = static_cast<int64_t>(a[2].size()) - 1;
  ConvDims d{0, n_out, n_kernels};
  return mx::astype(
      make_denominator(SparseDenominator::Mode::kDenominator, weight, a[0], a[2], d, stream),
      weight.dtype(), stream);
}

mx::array sparse_pool_features(const mx::array& feats, const mx::array& in_rows,
                               const mx::array& out_rows, const mx::array& kernel_ids,
                               const mx::array& output_row_offsets, const mx::array& counts,
                               bool input_exclusive, const std::string& mode, int n_out_capacity,
                               int n_kernels, mx::StreamOrDevice s) {
  const std::string op = "sparse_pool_features";
  auto stream = mx::to_stream(s);
  check_features(op, feats);
  check_static(op, n_out_capacity, n_kernels);
  kernels::PoolMode pool_mode;
  if (mode == "max") {
    pool_mode = kernels::PoolMode::kMax;
  } else if (mode == "avg") {
    pool_mode = kernels::PoolMode::kAvg;
  } else if (mode == "sum") {
    pool_mode = kernels::PoolMode::kSum;
  } else {
    fail(op, "mode must be 'max', 'avg' or 'sum', got '" + mode + "'.");
  }
  ConvDims d{feats.shape(0), n_out_capacity, n_kernels};
  auto checked = validated(
      tag(op, d, input_exclusive ? "exclusive" : ""),
      {in_rows, out_rows, kernel_ids, counts, output_row_offsets}, [&] {
        auto empty = empty_i32();
        auto rel = validate_relation(op, in_rows, out_rows, kernel_ids, counts,
                                     output_row_offsets, empty, empty, empty, empty, d);
        if (input_exclusive) {
          std::vector<uint8_t> used(d.n_in, 0);
          const int32_t* rows = idx_or_null(rel.in_rows);
          for (size_t e = 0; e < rel.in_rows.size(); ++e) {
            if (used[rows[e]]++) {
              fail(op, "input_exclusive=True but input row " + str(rows[e]) +
                           " feeds more than one output (windows overlap); pass False.");
            }
          }
        }
        return rel.list();
      });
  auto rel = RelationArrays::from(checked, 0);
  return mx::astype(make_pool(SparsePool::Stage::kForward, pool_mode, {feats}, rel.in_rows,
                              rel.out_offsets, d, stream),
                    feats.dtype(), stream);
}

}  // namespace mlx_lattice
