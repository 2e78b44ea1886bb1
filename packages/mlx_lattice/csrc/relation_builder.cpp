#include "relation_builder.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <sstream>
#include <vector>

#include "common.h"
#include "cpu/kernels.h"
#include "cpu/parallel.h"
#include "validate.h"

namespace mlx_lattice {

namespace {

using Coord = std::array<int32_t, 4>;

// Multiply-xor hash of the four coordinates with one final avalanche round.
inline uint64_t hash_coord(const int32_t* c) {
  uint64_t h = static_cast<uint64_t>(static_cast<uint32_t>(c[0])) * 0x27d4eb2f165667c5ULL ^
               static_cast<uint64_t>(static_cast<uint32_t>(c[1])) * 0x9e3779b97f4a7c15ULL ^
               static_cast<uint64_t>(static_cast<uint32_t>(c[2])) * 0xc2b2ae3d27d4eb4fULL ^
               static_cast<uint64_t>(static_cast<uint32_t>(c[3])) * 0x165667b19e3779f9ULL;
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 32;
  return h;
}

// Open-addressing table keyed by the full coordinate. A slot packs a 32-bit
// fingerprint of the hash with the row index, so most misses are decided
// without touching the coordinates; a fingerprint match is confirmed by
// comparing the full key, so a collision can never alias two coordinates.
class CoordTable {
 public:
  CoordTable(const int32_t* coords, int64_t n) : coords_(coords) {
    size_t cap = 16;
    while (cap < static_cast<size_t>(2 * n)) cap <<= 1;
    mask_ = cap - 1;
    slots_.assign(cap, kEmpty);
  }

  // Inserts row; returns the row already holding the coordinate, or -1.
  int32_t insert(int32_t row) {
    const int32_t* c = coords_ + 4 * static_cast<int64_t>(row);
    const uint64_t h = hash_coord(c);
    const uint64_t tag = h >> 32;
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const uint64_t s = slots_[i];
      if (s == kEmpty) {
        slots_[i] = (tag << 32) | static_cast<uint32_t>(row);
        return -1;
      }
      if ((s >> 32) == tag && same(static_cast<int32_t>(s & 0xffffffffu), c)) {
        return static_cast<int32_t>(s & 0xffffffffu);
      }
    }
  }

  // Starts loading the slot a lookup of hash h will read first.
  void prefetch(uint64_t h) const { __builtin_prefetch(slots_.data() + (h & mask_)); }

  int32_t find_hashed(const int32_t* c, uint64_t h) const {
    const uint64_t tag = h >> 32;
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const uint64_t s = slots_[i];
      if (s == kEmpty) return -1;
      if ((s >> 32) == tag && same(static_cast<int32_t>(s & 0xffffffffu), c)) {
        return static_cast<int32_t>(s & 0xffffffffu);
      }
    }
  }

 private:
  // Rows are < 2^31, so a slot with all low bits set is never a real entry.
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  bool same(int32_t row, const int32_t* c) const {
    return std::memcmp(coords_ + 4 * static_cast<int64_t>(row), c, 16) == 0;
  }

  const int32_t* coords_;
  size_t mask_ = 0;
  std::vector<uint64_t> slots_;
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

  // Pass 1: (n_out, K) neighbour map, in parallel tiles of outputs. Lookups
  // go in batches: hash and prefetch a batch, then probe it, so the cache
  // misses of one batch overlap. A submanifold relation with odd kernel sizes
  // is symmetric (p = q + offset(k) <=> q = p + offset(K - 1 - k)), so only
  // the offsets before the centre are looked up and each hit fills its mirror
  // cell; every cell has exactly one writer, so the map does not depend on
  // scheduling.
  const bool symmetric = kind == "submanifold" && kernel_size[0] % 2 == 1 &&
                         kernel_size[1] % 2 == 1 && kernel_size[2] % 2 == 1;
  const int64_t searched = symmetric ? n_kernels / 2 : n_kernels;
  std::vector<int32_t> map(n_out * n_kernels, -1);
  const int64_t tile = 1024;
  constexpr int64_t kBatch = 32;
  parallel_for((n_out + tile - 1) / tile, [&](int64_t t) {
    const int64_t o1 = std::min(n_out, (t + 1) * tile);
    int32_t keys[kBatch][4];
    uint64_t hashes[kBatch];
    bool valid[kBatch];
    for (int64_t o = t * tile; o < o1; ++o) {
      const int32_t* c = out_c + 4 * o;
      if (symmetric) map[o * n_kernels + n_kernels / 2] = static_cast<int32_t>(o);
      for (int64_t k0 = 0; k0 < searched; k0 += kBatch) {
        const int64_t nb = std::min(kBatch, searched - k0);
        for (int64_t b = 0; b < nb; ++b) {
          int32_t* q = keys[b];
          q[0] = c[0];
          bool inside = true;
          for (int a = 0; a < 3; ++a) {
            int64_t v = static_cast<int64_t>(c[a + 1]) + offsets[k0 + b][a];
            inside = inside && v >= std::numeric_limits<int32_t>::min() &&
                     v <= std::numeric_limits<int32_t>::max();
            q[a + 1] = static_cast<int32_t>(v);
          }
          valid[b] = inside;
          hashes[b] = hash_coord(q);
          table.prefetch(hashes[b]);
        }
        for (int64_t b = 0; b < nb; ++b) {
          const int32_t row = valid[b] ? table.find_hashed(keys[b], hashes[b]) : -1;
          map[o * n_kernels + k0 + b] = row;
          if (symmetric && row >= 0) {
            map[static_cast<int64_t>(row) * n_kernels + (n_kernels - 1 - (k0 + b))] =
                static_cast<int32_t>(o);
          }
        }
      }
    }
  });
  std::vector<int32_t> out_offsets(n_out + 1, 0);
  parallel_for((n_out + tile - 1) / tile, [&](int64_t t) {
    const int64_t o1 = std::min(n_out, (t + 1) * tile);
    for (int64_t o = t * tile; o < o1; ++o) {
      int32_t count = 0;
      for (int64_t k = 0; k < n_kernels; ++k) count += map[o * n_kernels + k] >= 0;
      out_offsets[o + 1] = count;
    }
  });

  // Pass 2: output CSR, then edges grouped by output with offsets ascending.
  for (int64_t o = 0; o < n_out; ++o) out_offsets[o + 1] += out_offsets[o];
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
  parallel_for(2, [&](int64_t which) {  // the two groupings are independent
    if (which == 0) {
      kernels::group_by(in_rows.data(), n_edges, n_in, in_offsets, in_edge_ids);
    } else {
      kernels::group_by(kernel_ids.data(), n_edges, n_kernels, k_offsets, k_edge_ids);
    }
  });

  const int e = static_cast<int>(n_edges);
  std::map<std::string, mx::array> result;
  result.emplace("out_coords", out_buf.empty() ? out : to_array(out_buf, {static_cast<int>(n_out), 4}));
  result.emplace("in_rows", to_array(in_rows, {e}));
  result.emplace("out_rows", to_array(out_rows, {e}));
  result.emplace("kernel_ids", to_array(kernel_ids, {e}));
  result.emplace("output_row_offsets", to_array(out_offsets, {static_cast<int>(n_out + 1)}));
  result.emplace("input_row_offsets", to_array(in_offsets, {static_cast<int>(n_in + 1)}));
  result.emplace("input_edge_ids", to_array(in_edge_ids, {e}));
  result.emplace("kernel_row_offsets", to_array(k_offsets, {static_cast<int>(n_kernels + 1)}));
  result.emplace("kernel_edge_ids", to_array(k_edge_ids, {e}));
  return result;
}

}  // namespace mlx_lattice
