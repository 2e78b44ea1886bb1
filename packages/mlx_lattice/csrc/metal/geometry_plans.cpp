#include "geometry_plans.h"

namespace mlx_lattice::gpu {

namespace {

struct GeoDims {
  uint32_t rows, channels, mode;
};

// 32 channels x 8 rows per threadgroup (one simdgroup per row of channels).
void dispatch_rows(KernelEncoder& enc, uint32_t rows, uint32_t channels) {
  const uint32_t cx = channels < 32 ? channels : 32;
  enc.dispatch({(channels + cx - 1) / cx, (rows + 7) / 8, 1}, {cx ? cx : 1, 8, 1});
}

}  // namespace

void encode_devoxelize(KernelEncoder& enc, Buffer vf, Buffer rows, Buffer weights, Buffer nearest,
                       Buffer out, uint32_t n_points, uint32_t channels, bool nearest_mode) {
  enc.kernel("mlxl_geo_devoxelize");
  enc.input(0, vf);
  enc.input(1, rows);
  enc.input(2, weights);
  enc.input(3, nearest);
  enc.output(4, out);
  enc.value(5, GeoDims{n_points, channels, nearest_mode ? 1u : 0u});
  if (n_points && channels) dispatch_rows(enc, n_points, channels);
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
  if (n_voxels && channels) dispatch_rows(enc, n_voxels, channels);
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
  if (n_voxels && channels) dispatch_rows(enc, n_voxels, channels);
}

}  // namespace mlx_lattice::gpu
