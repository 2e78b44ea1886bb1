#include "plans.h"
#include "../cpu/input_error.h"

#include <stdexcept>
#include <string>

namespace mlx_lattice::gpu {

namespace {

// Parameter blocks, laid out as the MSL structs of the same names.
struct ConvDims {
  uint32_t n_rows, cin, cout, n_kernels;
};
struct QuantDims {
  uint32_t n_rows, cin, cout, n_kernels, row_bytes, groups, group_size, bits;
};
struct PoolDims {
  uint32_t n_rows, channels, mode;
};
struct SortedDims {
  uint32_t n_out, n_kernels, cin, cout, store_sorted;
};

constexpr uint32_t kGroupX = 32;  // threads along channels
constexpr uint32_t kGroupY = 4;   // rows per threadgroup

uint32_t ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

// A (channels x rows) grid of single-value threads.
void dispatch_rows(KernelEncoder& enc, uint32_t channels, uint32_t rows, uint32_t depth = 1) {
  enc.dispatch({ceil_div(channels, kGroupX), ceil_div(rows, kGroupY), depth}, {kGroupX, kGroupY, 1});
}

struct GeoDims {
  uint32_t rows, channels, mode;
};

// Geometry: 32 channels x 8 rows per threadgroup (one simdgroup per row of
// channels), fewer threads along x when there are fewer channels.
void dispatch_geometry_rows(KernelEncoder& enc, uint32_t rows, uint32_t channels) {
  const uint32_t cx = channels < 32 ? channels : 32;
  enc.dispatch({(channels + cx - 1) / cx, (rows + 7) / 8, 1}, {cx ? cx : 1, 8, 1});
}

}  // namespace

void encode_conv(KernelEncoder& enc, ConvFace face, Buffer a, Buffer b, const Relation& rel,
                 Buffer out, uint32_t n_in, uint32_t n_out, uint32_t n_kernels, uint32_t cin,
                 uint32_t cout) {
  switch (face) {
    case ConvFace::kForward:
      enc.kernel("mlxl_conv_forward");
      enc.input(0, a);
      enc.input(1, b);
      enc.input(2, rel.in_rows);
      enc.input(3, rel.kernel_ids);
      enc.input(4, rel.out_offsets);
      enc.output(5, out);
      enc.value(6, ConvDims{n_out, cin, cout, n_kernels});
      dispatch_rows(enc, cout, n_out);
      return;
    case ConvFace::kInputGrad:
      enc.kernel("mlxl_conv_input_grad");
      enc.input(0, a);
      enc.input(1, b);
      enc.input(2, rel.out_rows);
      enc.input(3, rel.kernel_ids);
      enc.input(4, rel.in_offsets);
      enc.input(5, rel.in_edge_ids);
      enc.output(6, out);
      enc.value(7, ConvDims{n_in, cin, cout, n_kernels});
      dispatch_rows(enc, cin, n_in);
      return;
    case ConvFace::kWeightGrad:
      enc.kernel("mlxl_conv_weight_grad");
      enc.input(0, a);
      enc.input(1, b);
      enc.input(2, rel.in_rows);
      enc.input(3, rel.out_rows);
      enc.input(4, rel.k_offsets);
      enc.input(5, rel.k_edge_ids);
      enc.output(6, out);
      enc.value(7, ConvDims{0, cin, cout, n_kernels});
      enc.dispatch({ceil_div(cout, kGroupX), ceil_div(cin, kGroupY), n_kernels}, {kGroupX, kGroupY, 1});
      return;
  }
}

void encode_quantized_conv(KernelEncoder& enc, Buffer feats, Buffer packed, Buffer scales,
                           Buffer biases, const Relation& rel, Buffer out, uint32_t n_out,
                           uint32_t n_kernels, uint32_t cin, uint32_t cout, uint32_t row_bytes,
                           uint32_t groups, uint32_t group_size, uint32_t bits) {
  enc.kernel("mlxl_quantized_conv_forward");
  enc.input(0, feats);
  enc.input(1, packed);
  enc.input(2, scales);
  enc.input(3, biases);
  enc.input(4, rel.in_rows);
  enc.input(5, rel.kernel_ids);
  enc.input(6, rel.out_offsets);
  enc.output(7, out);
  enc.value(8, QuantDims{n_out, cin, cout, n_kernels, row_bytes, groups, group_size, bits});
  dispatch_rows(enc, cout, n_out);
}

void encode_int8_conv_fused(KernelEncoder& enc, const FusedConvArgs& a, const Relation& rel,
                            Buffer out) {
  const FusedDims& d = a.dims;
  enc.kernel(d.out_scale > 0.0f ? "mlxl_int8_conv_fused_int8" : "mlxl_int8_conv_fused_float");
  const Buffer unused = a.feats;  // bound where a slot is not read
  enc.input(0, a.feats);
  enc.input(1, a.feats);
  enc.input(2, a.packed);
  enc.input(3, a.scales);
  enc.input(4, a.biases);
  enc.input(5, d.has_bias ? a.bias : unused);
  enc.input(6, d.residual == 1 ? a.res_f : unused);
  enc.input(7, d.residual == 2 ? a.res_q : unused);
  enc.input(8, rel.in_rows);
  enc.input(9, rel.kernel_ids);
  enc.input(10, rel.out_offsets);
  enc.output(11, out);
  enc.value(12, d);
  dispatch_rows(enc, d.cout, d.n_rows);
}

void encode_denominator(KernelEncoder& enc, Buffer weight, Buffer kernel_ids, Buffer out_offsets,
                        Buffer out, uint32_t n_out, uint32_t n_kernels, uint32_t cin,
                        uint32_t cout) {
  enc.kernel("mlxl_denominator");
  enc.input(0, weight);
  enc.input(1, kernel_ids);
  enc.input(2, out_offsets);
  enc.output(3, out);
  enc.value(4, ConvDims{n_out, cin, cout, n_kernels});
  dispatch_rows(enc, cout, n_out);
}

void encode_denominator_grad(KernelEncoder& enc, Buffer grad, Buffer out_rows, Buffer k_offsets,
                             Buffer k_edge_ids, Buffer out, uint32_t n_kernels, uint32_t cout) {
  enc.kernel("mlxl_denominator_grad");
  enc.input(0, grad);
  enc.input(1, out_rows);
  enc.input(2, k_offsets);
  enc.input(3, k_edge_ids);
  enc.output(4, out);
  enc.value(5, ConvDims{n_kernels, 0, cout, n_kernels});
  dispatch_rows(enc, cout, n_kernels);
}

void encode_pool(KernelEncoder& enc, PoolStage stage, uint32_t mode, Buffer x, Buffer y,
                 const Relation& rel, Buffer out, uint32_t n_in, uint32_t n_out,
                 uint32_t channels) {
  if (stage == PoolStage::kForward) {
    enc.kernel("mlxl_pool_forward");
    enc.input(0, x);
    enc.input(1, rel.in_rows);
    enc.input(2, rel.out_offsets);
    enc.output(3, out);
    enc.value(4, PoolDims{n_out, channels, mode});
    dispatch_rows(enc, channels, n_out);
  } else if (stage == PoolStage::kMaxSelect) {
    enc.kernel("mlxl_pool_max_select");
    enc.input(0, x);
    enc.input(1, y);
    enc.input(2, rel.in_rows);
    enc.input(3, rel.out_offsets);
    enc.output(4, out);
    enc.value(5, PoolDims{n_out, channels, mode});
    dispatch_rows(enc, channels, n_out);
  } else {
    enc.kernel("mlxl_pool_backward");
    enc.input(0, x);
    enc.input(1, y);
    enc.input(2, rel.in_rows);
    enc.input(3, rel.out_rows);
    enc.input(4, rel.out_offsets);
    enc.input(5, rel.in_offsets);
    enc.input(6, rel.in_edge_ids);
    enc.output(7, out);
    enc.value(8, PoolDims{n_in, channels, mode});
    dispatch_rows(enc, channels, n_in);
  }
}

void encode_sorted_conv(KernelEncoder& enc, Buffer feats, Buffer weight,
                        Buffer sorted_map, Buffer reorder, Buffer tile_masks, Buffer out,
                        uint32_t n_out, uint32_t n_kernels, uint32_t cin, uint32_t cout,
                        bool store_sorted) {
  if ((cin != 32 && cin != 64) || (cout != 32 && cout != 64)) {
    throw ::mlx_lattice::InputError("the sorted implicit-GEMM kernel supports 32 or 64 channels");
  }
  enc.kernel("mlxl_sorted_conv");
  enc.input(0, feats);
  enc.input(1, weight);
  enc.input(2, sorted_map);
  enc.input(3, reorder);
  enc.input(4, tile_masks);
  enc.output(5, out);
  enc.value(6, SortedDims{n_out, n_kernels, cin, cout, store_sorted ? 1u : 0u});
  enc.dispatch({ceil_div(n_out, 32), 1, 1}, {32, 1, 1});
}

void encode_devoxelize(KernelEncoder& enc, Buffer vf, Buffer rows, Buffer weights, Buffer nearest,
                       Buffer out, uint32_t n_points, uint32_t channels, bool nearest_mode) {
  enc.kernel("mlxl_geo_devoxelize");
  enc.input(0, vf);
  enc.input(1, rows);
  enc.input(2, weights);
  enc.input(3, nearest);
  enc.output(4, out);
  enc.value(5, GeoDims{n_points, channels, nearest_mode ? 1u : 0u});
  if (n_points && channels) dispatch_geometry_rows(enc, n_points, channels);
}

void encode_devoxelize_transpose(KernelEncoder& enc, Buffer g, Buffer weights, Buffer nearest,
                                 Buffer offsets, Buffer entries, Buffer out, uint32_t n_voxels,
                                 uint32_t channels, bool nearest_mode) {
  enc.kernel("mlxl_geo_devoxelize_transpose");
  enc.input(0, g);
  enc.input(1, weights);
  enc.input(2, nearest);
  enc.input(3, offsets);
  enc.input(4, entries);
  enc.output(5, out);
  enc.value(6, GeoDims{n_voxels, channels, nearest_mode ? 1u : 0u});
  if (n_voxels && channels) dispatch_geometry_rows(enc, n_voxels, channels);
}

void encode_voxel_reduce(KernelEncoder& enc, Buffer feats, Buffer offsets, Buffer members,
                         Buffer out, Buffer arg, uint32_t n_voxels, uint32_t channels,
                         uint32_t mode) {
  enc.kernel("mlxl_geo_voxel_reduce");
  enc.input(0, feats);
  enc.input(1, offsets);
  enc.input(2, members);
  enc.output(3, out);
  enc.output(4, arg);
  enc.value(5, GeoDims{n_voxels, channels, mode});
  if (n_voxels && channels) dispatch_geometry_rows(enc, n_voxels, channels);
}

void encode_knn(KernelEncoder& enc, Buffer query, Buffer qbatch, Buffer sorted_support,
                Buffer sorted_rows, Buffer sorted_keys, Buffer rows, Buffer dist2,
                const KnnPlan& plan) {
  if (plan.k < 1 || plan.k > kKnnMaxK) {
    throw ::mlx_lattice::InputError("the Metal kNN kernel supports 1 <= k <= 64");
  }
  // Laid out as the MSL KnnParams.
  struct {
    uint32_t nq, ns, k, n_batches;
    int32_t nx, ny, nz;
    float ox, oy, oz, inv, cell, max_d2;
  } params{plan.nq,      plan.ns,      plan.k,         plan.n_batches, plan.dims[0],
           plan.dims[1], plan.dims[2], plan.origin[0], plan.origin[1], plan.origin[2],
           plan.inv,     plan.cell,    plan.max_d2};
  static_assert(sizeof(params) == 52);
  enc.kernel("mlxl_geo_knn");
  enc.input(0, query);
  enc.input(1, qbatch);
  enc.input(2, sorted_support);
  enc.input(3, sorted_rows);
  enc.input(4, sorted_keys);
  enc.output(5, rows);
  enc.output(6, dist2);
  enc.value(7, params);
  if (plan.nq) enc.dispatch({ceil_div(plan.nq, 64), 1, 1}, {64, 1, 1});
}

void encode_morton(KernelEncoder& enc, Buffer coords, Buffer codes, uint32_t n) {
  enc.kernel("mlxl_geo_morton");
  enc.input(0, coords);
  enc.output(1, codes);
  enc.value(2, n);
  if (n) enc.dispatch({ceil_div(n, 256), 1, 1}, {256, 1, 1});
}

void encode_coord_hash(KernelEncoder& enc, Buffer coords, Buffer queries, Buffer first,
                       Buffer rows, Buffer table, Buffer minrow, Buffer slot_of, uint32_t n,
                       uint32_t q, uint32_t slots) {
  if (slots < 2 || (slots & (slots - 1)) != 0 || slots / 2 < n) {
    throw ::mlx_lattice::InputError("the coordinate hash needs a power-of-two table of >= 2n slots");
  }
  // Laid out as the MSL HashParams.
  struct {
    uint32_t n, q, mask;
  } params{n, q, slots - 1};
  enc.kernel("mlxl_hash_clear");
  enc.output(0, table);
  enc.output(1, minrow);
  enc.value(2, params);
  enc.dispatch({ceil_div(slots, 256), 1, 1}, {256, 1, 1});
  if (n) {
    enc.kernel("mlxl_hash_insert");
    enc.input(0, coords);
    enc.output(1, table);
    enc.output(2, minrow);
    enc.output(3, slot_of);
    enc.value(4, params);
    enc.dispatch({ceil_div(n, 256), 1, 1}, {256, 1, 1});
    enc.kernel("mlxl_hash_resolve");
    enc.input(0, slot_of);
    enc.input(1, minrow);
    enc.output(2, first);
    enc.value(3, params);
    enc.dispatch({ceil_div(n, 256), 1, 1}, {256, 1, 1});
  }
  if (q) {
    enc.kernel("mlxl_hash_query");
    enc.input(0, coords);
    enc.input(1, queries);
    enc.input(2, table);
    enc.input(3, minrow);
    enc.output(4, rows);
    enc.value(5, params);
    enc.dispatch({ceil_div(q, 256), 1, 1}, {256, 1, 1});
  }
}

void encode_radius(KernelEncoder& enc, Buffer query, Buffer qbatch, Buffer sorted_support,
                   Buffer sorted_rows, Buffer sorted_keys, Buffer offsets, Buffer counts,
                   Buffer rows, Buffer dist2, const KnnPlan& plan, int32_t reach, bool fill) {
  // Laid out as the MSL RadiusParams.
  struct {
    uint32_t nq, ns, n_batches;
    int32_t nx, ny, nz;
    float ox, oy, oz, inv, cell, max_d2;
    int32_t reach;
    uint32_t fill;
  } params{plan.nq,        plan.ns,        plan.n_batches, plan.dims[0], plan.dims[1],
           plan.dims[2],   plan.origin[0], plan.origin[1], plan.origin[2], plan.inv,
           plan.cell,      plan.max_d2,    reach,          fill ? 1u : 0u};
  static_assert(sizeof(params) == 56);
  enc.kernel("mlxl_geo_radius");
  enc.input(0, query);
  enc.input(1, qbatch);
  enc.input(2, sorted_support);
  enc.input(3, sorted_rows);
  enc.input(4, sorted_keys);
  // The buffers of the other pass are bound as empty inputs, never touched.
  if (fill) {
    enc.input(5, offsets);
    enc.input(6, Buffer{});
    enc.output(7, rows);
    enc.output(8, dist2);
  } else {
    enc.input(5, Buffer{});
    enc.output(6, counts);
    enc.input(7, Buffer{});
    enc.input(8, Buffer{});
  }
  enc.value(9, params);
  if (plan.nq) enc.dispatch({ceil_div(plan.nq, 64), 1, 1}, {64, 1, 1});
}

namespace {

// Laid out as NormDims in norm.metal.
struct NormDims {
  uint32_t n, c, blocks, relu, stage;
  float eps;
};
static_assert(sizeof(NormDims) == 24);

const char* norm_suffix(NormFormat format) {
  return format == NormFormat::kF32 ? "_f32" : format == NormFormat::kF16 ? "_f16" : "_bf16";
}

// One thread per (channel, block) or per (channel, row): 32 channels x 4.
void dispatch_channels_rows(KernelEncoder& enc, uint32_t c, uint32_t rows) {
  enc.dispatch({ceil_div(c, kGroupX), ceil_div(rows, kGroupY), 1}, {kGroupX, kGroupY, 1});
}

// One thread per channel.
void dispatch_channels(KernelEncoder& enc, uint32_t c) {
  enc.dispatch({ceil_div(c, 64), 1, 1}, {64, 1, 1});
}

}  // namespace

void encode_batch_norm(KernelEncoder& enc, NormFormat format, Buffer x, Buffer weight,
                       Buffer bias, Buffer y, Buffer mean, Buffer var, uint32_t n, uint32_t c,
                       float eps, bool relu) {
  if (n == 0 || c == 0) return;
  const std::string suffix = norm_suffix(format);
  NormDims dims{n, c, ceil_div(n, kNormBlockRows), relu ? 1u : 0u, 0, eps};
  // Per (block, channel) a compensated pair; stats = {mean hi, mean lo, scale}.
  const Buffer partial = enc.scratch(size_t{dims.blocks} * c * 2 * sizeof(float));
  const Buffer stats = enc.scratch(size_t{c} * 3 * sizeof(float));
  for (uint32_t stage = 0; stage < 2; ++stage) {
    dims.stage = stage;
    enc.kernel("mlxl_norm_sums" + suffix);
    enc.input(0, x);
    enc.input(1, stats);
    enc.output(2, partial);
    enc.value(3, dims);
    dispatch_channels_rows(enc, c, dims.blocks);
    enc.kernel("mlxl_norm_stats");
    enc.input(0, partial);
    enc.input(1, weight);
    enc.output(2, stats);
    enc.output(3, mean);
    enc.output(4, var);
    enc.value(5, dims);
    dispatch_channels(enc, c);
  }
  enc.kernel("mlxl_norm_forward" + suffix);
  enc.input(0, x);
  enc.input(1, stats);
  enc.input(2, mean);
  enc.input(3, bias);
  enc.output(4, y);
  enc.value(5, dims);
  dispatch_channels_rows(enc, c, n);
}

void encode_batch_norm_eval(KernelEncoder& enc, NormFormat format, Buffer x, Buffer mean,
                            Buffer scale, Buffer bias, Buffer y, uint32_t n, uint32_t c,
                            bool relu) {
  if (n == 0 || c == 0) return;
  const NormDims dims{n, c, ceil_div(n, kNormBlockRows), relu ? 1u : 0u, 0, 0.0f};
  enc.kernel(std::string("mlxl_norm_eval") + norm_suffix(format));
  enc.input(0, x);
  enc.input(1, mean);
  enc.input(2, scale);
  enc.input(3, bias);
  enc.output(4, y);
  enc.value(5, dims);
  dispatch_channels_rows(enc, c, n);
}

void encode_batch_norm_grad(KernelEncoder& enc, NormFormat format, Buffer g, Buffer x, Buffer y,
                            Buffer weight, Buffer mean, Buffer var, Buffer dx, Buffer dweight,
                            Buffer dbias, uint32_t n, uint32_t c, float eps, bool relu) {
  if (n == 0 || c == 0) return;
  const std::string suffix = norm_suffix(format);
  const NormDims dims{n, c, ceil_div(n, kNormBlockRows), relu ? 1u : 0u, 0, eps};
  // Per (block, channel) two compensated pairs; coef = {a, k, mean(g)}.
  const Buffer partial = enc.scratch(size_t{dims.blocks} * c * 4 * sizeof(float));
  const Buffer coef = enc.scratch(size_t{c} * 3 * sizeof(float));
  enc.kernel("mlxl_norm_grad_sums" + suffix);
  enc.input(0, g);
  enc.input(1, x);
  enc.input(2, y);
  enc.input(3, mean);
  enc.output(4, partial);
  enc.value(5, dims);
  dispatch_channels_rows(enc, c, dims.blocks);
  enc.kernel("mlxl_norm_grad_coefs");
  enc.input(0, partial);
  enc.input(1, weight);
  enc.input(2, var);
  enc.output(3, coef);
  enc.output(4, dweight);
  enc.output(5, dbias);
  enc.value(6, dims);
  dispatch_channels(enc, c);
  enc.kernel("mlxl_norm_grad" + suffix);
  enc.input(0, g);
  enc.input(1, x);
  enc.input(2, y);
  enc.input(3, mean);
  enc.input(4, coef);
  enc.output(5, dx);
  enc.value(6, dims);
  dispatch_channels_rows(enc, c, n);
}

}  // namespace mlx_lattice::gpu
