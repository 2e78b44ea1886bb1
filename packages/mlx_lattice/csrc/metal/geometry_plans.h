// Encode plans of the geometry kernels (metal/geometry.metal), written
// against the KernelEncoder interface: the Metal encoder on Apple GPUs, the
// MSL CPU harness in tests. Operands are float32 / int32 buffers.
#pragma once

#include <cstdint>

#include "encoder.h"

namespace mlx_lattice::gpu {

// out (n_points x channels) from vf (voxels x channels), rows/weights
// (n_points x 8) and nearest (n_points).
void encode_devoxelize(KernelEncoder& enc, Buffer vf, Buffer rows, Buffer weights, Buffer nearest,
                       Buffer out, uint32_t n_points, uint32_t channels, bool nearest_mode);

// out (n_voxels x channels) from g (points x channels) through the voxel
// grouping of (point, corner) entries.
void encode_devoxelize_transpose(KernelEncoder& enc, Buffer g, Buffer weights, Buffer nearest,
                                 Buffer offsets, Buffer entries, Buffer out, uint32_t n_voxels,
                                 uint32_t channels, bool nearest_mode);

// out / arg (n_voxels x channels) from point features and the voxel grouping;
// mode 0 sum, 1 mean, 2 max, 3 first.
void encode_voxel_reduce(KernelEncoder& enc, Buffer feats, Buffer offsets, Buffer members,
                         Buffer out, Buffer arg, uint32_t n_voxels, uint32_t channels,
                         uint32_t mode);

}  // namespace mlx_lattice::gpu
