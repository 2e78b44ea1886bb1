// The int32 result arrays of the relation builders, allocated by MLX and
// written in place (no copy). MLX's CPU allocator keeps no freed buffers, so
// a large result is freshly mapped memory each time (relation_pages.h).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "mlx/mlx.h"
#include "relation_pages.h"

namespace mlx_lattice {

// An int32 vector of n entries (n >= 0) as an MLX array, written through `data`.
struct Int32Buffer {
  Int32Buffer() = default;
  explicit Int32Buffer(int64_t n)
      : array(mlx::core::allocator::malloc(sizeof(int32_t) * std::max<int64_t>(n, 1)),
              {static_cast<int>(n)}, mlx::core::int32),
        data(array.data<int32_t>()) {
    advise_huge_pages(data, sizeof(int32_t) * static_cast<size_t>(n));
  }
  mlx::core::array array{0};
  int32_t* data = nullptr;
};

// A relation's index arrays by the names build_kernel_relation returns.
struct RelationBuffers {
  Int32Buffer in_rows, out_rows, kernel_ids;
  Int32Buffer out_offsets, in_offsets, in_edge_ids, k_offsets, k_edge_ids;

  std::map<std::string, mlx::core::array> arrays() const {
    return {{"in_rows", in_rows.array},
            {"out_rows", out_rows.array},
            {"kernel_ids", kernel_ids.array},
            {"output_row_offsets", out_offsets.array},
            {"input_row_offsets", in_offsets.array},
            {"input_edge_ids", in_edge_ids.array},
            {"kernel_row_offsets", k_offsets.array},
            {"kernel_edge_ids", k_edge_ids.array}};
  }
};

}  // namespace mlx_lattice
