#include "relations.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <sstream>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "parallel.h"
#include "validate.h"

namespace mlx_lattice {

namespace {

using Coord = std::array<int32_t, 4>;

uint64_t mix(uint64_t h) {
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  h ^= h >> 33;
  return h;
}

uint64_t hash_coord(const int32_t* c) {
  uint64_t lo = (static_cast<uint64_t>(static_cast<uint32_t>(c[0])) << 32) |
                static_cast<uint32_t>(c[1]);
  uint64_t hi = (static_cast<uint64_t>(static_cast<uint32_t>(c[2])) << 32) |
                static_cast<uint32_t>(c[3]);
  return mix(lo * 0x9e3779b97f4a7c15ULL ^ mix(hi));
}

// Open-addressing table of row indices keyed by the full coordinate (keys are
// compared exactly, so a hash collision can never alias two coordinates).
class CoordTable {
 public:
  CoordTable(const int32_t* coords, int64_t n) : coords_(coords) {
    size_t cap = 16;
    while (cap < static_cast<size_t>(2 * n)) cap <<= 1;
    mask_ = cap - 1;
    slots_.assign(cap, -1);
  }

  // Inserts row; returns the row already holding the coordinate, or -1.
  int32_t insert(int32_t row) {
    const int32_t* c = coords_ + 4 * static_cast<int64_t>(row);
    for (size_t i = hash_coord(c) & mask_;; i = (i + 1) & mask_) {
      int32_t s = slots_[i];
      if (s < 0) {
        slots_[i] = row;
        return -1;
      }
      if (std::memcmp(coords_ + 4 * static_cast<int64_t>(s), c, 16) == 0) return s;
    }
  }

  int32_t find(const int32_t* c) const {
    for (size_t i = hash_coord(c) & mask_;; i = (i + 1) & mask_) {
      int32_t s = slots_[i];
      if (s < 0) return -1;
      if (std::memcmp(coords_ + 4 * static_cast<int64_t>(s), c, 16) == 0) return s;
    }
  }

 private:
  const int32_t* coords_;
  size_t mask_ = 0;
  std::vector<int32_t> slots_;
};

mx::array concrete_coords(const mx::array& coords, const std::string& name) {
  if (coords.dtype() != mx::int32) {
    fail("build_kernel_relation",
         name + " must be an int32 array, got " + dtype_str(coords.dtype()) + ".");
  }
  if (coords.ndim() != 2 || coords.shape(1) != 4) {
    fail("build_kernel_relation", name + " must be (N, 4) = (batch, x, y, z), got shape " +
                                      shape_str(coords.shape()) + ".");
  }
  return concrete_indices("build_kernel_relation", {{name, coords}}, {2})[0];
}

CoordTable index_coords(const int32_t* c, int64_t n, const std::string& name) {
  CoordTable table(c, n);
  for (int64_t r = 0; r < n; ++r) {
    int32_t prev = table.insert(static_cast<int32_t>(r));
    if (prev >= 0) {
      std::ostringstream msg;
      msg << name << " has duplicate coordinate (" << c[4 * r] << ", " << c[4 * r + 1] << ", "
          << c[4 * r + 2] << ", " << c[4 * r + 3] << ") at rows " << prev << " and " << r << ".";
      fail("build_kernel_relation", msg.str());
    }
  }
  return table;
}

int64_t floor_to(int64_t v, int64_t step) {
  int64_t q = v / step;
  if (v % step != 0 && v < 0) --q;
  return q * step;
}

mx::array to_array(const std::vector<int32_t>& v, mx::Shape shape) {
  return mx::array(v.data(), std::move(shape), mx::int32);
}

}  // namespace

void check_coordinates(const mx::array& coords, const std::string& name) {
  auto c = concrete_coords(coords, name);
  index_coords(idx_or_null(c), c.shape(0), name);
}

std::map<std::string, mx::array> build_kernel_relation(const mx::array& in_coords,
                                                       const std::optional<mx::array>& out_coords,
                                                       Triple kernel_size, Triple stride,
                                                       Triple dilation, Triple tensor_stride,
                                                       const std::string& kind) {
  const std::string op = "build_kernel_relation";
  for (int a = 0; a < 3; ++a) {
    if (kernel_size[a] < 1 || kernel_size[a] > 7) {
      fail(op, "kernel_size must be in [1, 7] per axis, got " + std::to_string(kernel_size[a]) +
                   ".");
    }
    if (stride[a] < 1 || dilation[a] < 1 || tensor_stride[a] < 1) {
      fail(op, "stride, dilation and tensor_stride must be >= 1.");
    }
  }
  if (kind != "submanifold" && kind != "forward" && kind != "target") {
    fail(op, "kind must be 'submanifold', 'forward' or 'target', got '" + kind + "'.");
  }
  if (kind == "submanifold" && out_coords) {
    fail(op, "a submanifold relation has out_coords = in_coords; do not pass out_coords.");
  }
  if (kind == "target" && !out_coords) {
    fail(op, "a target relation needs out_coords (the finer coordinates to produce).");
  }
  if (kind != "forward" && stride != Triple{1, 1, 1}) {
    fail(op, "stride applies to 'forward' relations only; a '" + kind +
                 "' relation takes stride 1 (use tensor_stride for the grid spacing).");
  }

  auto in = concrete_coords(in_coords, "in_coords");
  const int64_t n_in = in.shape(0);
  const int32_t* in_c = idx_or_null(in);
  CoordTable table = index_coords(in_c, n_in, "in_coords");

  // Output coordinates.
  std::vector<int32_t> out_buf;
  mx::array out = in;
  if (out_coords) {
    out = concrete_coords(*out_coords, "out_coords");
    index_coords(idx_or_null(out), out.shape(0), "out_coords");
  } else if (kind == "forward" && stride != Triple{1, 1, 1}) {
    int64_t step[3];
    for (int a = 0; a < 3; ++a) step[a] = static_cast<int64_t>(stride[a]) * tensor_stride[a];
    out_buf.reserve(4 * n_in);
    std::vector<int32_t> scratch(4 * n_in);
    int64_t n = 0;
    for (int64_t r = 0; r < n_in; ++r) {
      int32_t* c = scratch.data() + 4 * n;
      c[0] = in_c[4 * r];
      for (int a = 0; a < 3; ++a) {
        c[a + 1] = static_cast<int32_t>(floor_to(in_c[4 * r + a + 1], step[a]));
      }
      ++n;
    }
    // Unique in order of first appearance.
    CoordTable seen(scratch.data(), n);
    for (int64_t r = 0; r < n; ++r) {
      if (seen.insert(static_cast<int32_t>(r)) < 0) {
        out_buf.insert(out_buf.end(), scratch.begin() + 4 * r, scratch.begin() + 4 * r + 4);
      }
    }
    out = to_array(out_buf, {static_cast<int>(out_buf.size() / 4), 4});
  }
  const int64_t n_out = out.shape(0);
  const int32_t* out_c = out_buf.empty() ? idx_or_null(out) : out_buf.data();

  // Kernel offsets, x-major.
  const int64_t n_kernels = static_cast<int64_t>(kernel_size[0]) * kernel_size[1] * kernel_size[2];
  const int64_t sign = kind == "target" ? -1 : 1;
  std::vector<std::array<int64_t, 3>> offsets;
  for (int ix = 0; ix < kernel_size[0]; ++ix) {
    for (int iy = 0; iy < kernel_size[1]; ++iy) {
      for (int iz = 0; iz < kernel_size[2]; ++iz) {
        int i[3] = {ix, iy, iz};
        std::array<int64_t, 3> off;
        for (int a = 0; a < 3; ++a) {
          off[a] = sign * static_cast<int64_t>(i[a] - (kernel_size[a] - 1) / 2) * dilation[a] *
                   tensor_stride[a];
        }
        offsets.push_back(off);
      }
    }
  }

  // Pass 1: (n_out, K) neighbour map, in parallel tiles of outputs.
  std::vector<int32_t> map(n_out * n_kernels);
  const int64_t tile = 1024;
  parallel_for((n_out + tile - 1) / tile, [&](int64_t t) {
    const int64_t o1 = std::min(n_out, (t + 1) * tile);
    for (int64_t o = t * tile; o < o1; ++o) {
      const int32_t* c = out_c + 4 * o;
      for (int64_t k = 0; k < n_kernels; ++k) {
        int32_t q[4] = {c[0], 0, 0, 0};
        bool inside = true;
        for (int a = 0; a < 3; ++a) {
          int64_t v = static_cast<int64_t>(c[a + 1]) + offsets[k][a];
          inside = inside && v >= std::numeric_limits<int32_t>::min() &&
                   v <= std::numeric_limits<int32_t>::max();
          q[a + 1] = static_cast<int32_t>(v);
        }
        map[o * n_kernels + k] = inside ? table.find(q) : -1;
      }
    }
  });

  // Pass 2: output CSR, then edges grouped by output with offsets ascending.
  std::vector<int32_t> out_offsets(n_out + 1, 0);
  for (int64_t o = 0; o < n_out; ++o) {
    int32_t count = 0;
    for (int64_t k = 0; k < n_kernels; ++k) count += map[o * n_kernels + k] >= 0;
    out_offsets[o + 1] = out_offsets[o] + count;
  }
  const int64_t n_edges = out_offsets[n_out];
  if (n_edges > std::numeric_limits<int32_t>::max()) {
    fail(op, "the relation has more than 2^31 - 1 edges.");
  }
  std::vector<int32_t> in_rows(n_edges), out_rows(n_edges), kernel_ids(n_edges);
  parallel_for((n_out + tile - 1) / tile, [&](int64_t t) {
    const int64_t o1 = std::min(n_out, (t + 1) * tile);
    for (int64_t o = t * tile; o < o1; ++o) {
      int64_t e = out_offsets[o];
      for (int64_t k = 0; k < n_kernels; ++k) {
        int32_t r = map[o * n_kernels + k];
        if (r < 0) continue;
        in_rows[e] = r;
        out_rows[e] = static_cast<int32_t>(o);
        kernel_ids[e] = static_cast<int32_t>(k);
        ++e;
      }
    }
  });

  std::vector<int32_t> in_offsets, in_edge_ids, k_offsets, k_edge_ids;
  kernels::group_by(in_rows.data(), n_edges, n_in, in_offsets, in_edge_ids);
  kernels::group_by(kernel_ids.data(), n_edges, n_kernels, k_offsets, k_edge_ids);
  std::vector<int32_t> counts(n_kernels), out_edge_ids(n_edges);
  for (int64_t k = 0; k < n_kernels; ++k) counts[k] = k_offsets[k + 1] - k_offsets[k];
  for (int64_t e = 0; e < n_edges; ++e) out_edge_ids[e] = static_cast<int32_t>(e);

  const int e = static_cast<int>(n_edges);
  std::map<std::string, mx::array> result;
  result.emplace("out_coords", out_buf.empty() ? out : to_array(out_buf, {static_cast<int>(n_out), 4}));
  result.emplace("in_rows", to_array(in_rows, {e}));
  result.emplace("out_rows", to_array(out_rows, {e}));
  result.emplace("kernel_ids", to_array(kernel_ids, {e}));
  result.emplace("counts", to_array(counts, {static_cast<int>(n_kernels)}));
  result.emplace("output_row_offsets", to_array(out_offsets, {static_cast<int>(n_out + 1)}));
  result.emplace("output_edge_ids", to_array(out_edge_ids, {e}));
  result.emplace("input_row_offsets", to_array(in_offsets, {static_cast<int>(n_in + 1)}));
  result.emplace("input_edge_ids", to_array(in_edge_ids, {e}));
  result.emplace("kernel_row_offsets", to_array(k_offsets, {static_cast<int>(n_kernels + 1)}));
  result.emplace("kernel_edge_ids", to_array(k_edge_ids, {e}));
  return result;
}

}  // namespace mlx_lattice
