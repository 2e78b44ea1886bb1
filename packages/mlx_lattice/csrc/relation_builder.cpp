#include "relation_builder.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common.h"
#include "relation_buffer.h"
#include "relation_grid.h"
#include "relation_groups.h"
#include "relation_hash.h"
#include "relation_mirror.h"
#include "relation_parents.h"
#include "relation_sorted.h"
#include "relation_strided.h"
#include "cpu/parallel.h"
#include "validate.h"

namespace mlx_lattice {

namespace {

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

mx::array to_array(const std::vector<int32_t>& v, mx::Shape shape) {
  return mx::array(v.data(), std::move(shape), mx::int32);
}

// For items [0, n) in parts of `part` items: each part's first position
// among the items for which keep(i) holds, counted in parallel; the last
// entry is their number.
template <class Keep>
std::vector<int32_t> part_starts(int64_t n, int64_t part, Keep&& keep) {
  const int64_t parts = ceil_div(n, part);
  std::vector<int32_t> first(parts + 1, 0);
  parallel_for(parts, [&](int64_t t) {
    int32_t count = 0;
    for (int64_t i = t * part; i < std::min(n, (t + 1) * part); ++i) count += keep(i);
    first[t + 1] = count;
  });
  for (int64_t t = 0; t < parts; ++t) first[t + 1] += first[t];
  return first;
}

// At most 7^3 kernel offsets.
constexpr int64_t kMaxKernels = 343;

// Set bits of v (portable: no popcnt instruction assumed).
inline int32_t popcount32(uint32_t v) {
  v = v - ((v >> 1) & 0x55555555u);
  v = (v & 0x33333333u) + ((v >> 2) & 0x33333333u);
  return static_cast<int32_t>((((v + (v >> 4)) & 0x0f0f0f0fu) * 0x01010101u) >> 24);
}

// Raises when the counts in offsets[1..n_out] sum past int32.
void check_edge_total(int64_t total) {
  if (total > std::numeric_limits<int32_t>::max()) {
    fail("build_kernel_relation", "the relation has more than 2^31 - 1 edges.");
  }
}

void check_edge_count(int64_t n_out, const int32_t* counts) {
  int64_t total = 0;
  for (int64_t o = 0; o < n_out; ++o) total += counts[o + 1];
  check_edge_total(total);
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

  auto in = concrete_coords(in_coords, "in_coords");
  const int64_t n_in = in.shape(0);
  const int32_t* in_c = idx_or_null(in);
  // A relation of the inputs with themselves walks sorted coordinates (as
  // voxelize and unique produce them; relation_sorted.h), searches a block
  // grid when the offsets allow it and the blocks are dense enough (see
  // relation_grid.h), else a hash of the coordinates, as does a sorted set
  // whose span is too wide for the walk's keys.
  const bool self = !out_coords && !(kind == "forward" && stride != Triple{1, 1, 1});
  // A self relation with odd kernel sizes is symmetric: the edges into
  // input p are the mirrors of p's own edges, so p's input group (edge ids
  // ascending) is written with its output row, from its neighbours' offsets
  // and offset masks, instead of a counting sort of all edges.
  const bool odd = kernel_size[0] % 2 == 1 && kernel_size[1] % 2 == 1 && kernel_size[2] % 2 == 1;
  const bool masked = n_kernels <= 32 && odd;
  UnsetVector<uint32_t> masks;  // every entry written by the walk or the grid
  std::unique_ptr<int32_t[]> sorted_map;
  if (self) {
    if (masked) masks.resize(n_in);  // also the grid's, when the walk declines
    sorted_map = sorted_neighbour_map(in_c, n_in, offsets, odd, masked ? masks.data() : nullptr);
  }
  const bool walked = sorted_map != nullptr;
  BlockGrid grid;
  const bool gridded =
      self && !walked && BlockGrid::covers(offsets) && grid.build(in_c, n_in, "in_coords");
  // Sets related to another are searched by key when sorted
  // (SortedRows), else through a hash of the inputs, which also finds
  // duplicated rows (a strictly ascending set has none; computed strided
  // outputs check their inputs as they sort them).
  std::optional<SortedRows> in_sorted;
  std::optional<CoordTable> table;
  auto in_table = [&] {
    if (!table) table.emplace(index_coords(in_c, n_in, "in_coords"));
  };
  const bool strided = kind == "forward" && !out_coords && !self;
  // A target relation's inputs are the coarser set, searched; a forward
  // relation's given outputs are.
  bool in_checked = self ? walked || gridded : strided;
  if (kind == "target") {
    in_sorted = SortedRows::of(in_c, n_in);
    in_checked = in_sorted.has_value();
  } else if (!self && !strided) {
    in_checked = rows_ascending(in_c, n_in);
  }
  if (!in_checked) in_table();

  // Output coordinates (and, for computed ones, each input's floored row).
  mx::array out = in;
  std::optional<SortedRows> out_sorted;
  std::optional<CoordTable> out_table;
  std::optional<StridedOutputs> floored;
  if (out_coords) {
    out = concrete_coords(*out_coords, "out_coords");
    // The outputs of a target relation are the finer set: only checked.
    const int32_t* given = idx_or_null(out);
    if (kind == "target" ? !rows_ascending(given, out.shape(0))
                         : !(out_sorted = SortedRows::of(given, out.shape(0)))) {
      out_table.emplace(index_coords(given, out.shape(0), "out_coords"));
    }
  } else if (strided) {
    std::array<int64_t, 3> step;
    for (int a = 0; a < 3; ++a) step[a] = static_cast<int64_t>(stride[a]) * tensor_stride[a];
    floored = strided_outputs(in_c, n_in, step);
    out = to_array(floored->coords, {static_cast<int>(floored->coords.size() / 4), 4});
  }
  const int64_t n_out = out.shape(0);
  const int32_t* out_c = idx_or_null(out);

  // Kernels of at most two taps per axis between a set and a coarser one
  // (a strided forward relation, its target transpose): each fine row has
  // at most one coarse partner, found without searching every offset.
  std::optional<Parents> parents;
  if (!self) {
    const bool target = kind == "target";
    const std::optional<SortedRows>& coarse_sorted = target ? in_sorted : out_sorted;
    const std::optional<CoordTable>& coarse_table = target ? table : out_table;
    parents = single_parents(target ? out_c : in_c, target ? n_out : n_in,
                             target ? in_c : out_c, target ? n_in : n_out,
                             coarse_sorted ? &*coarse_sorted : nullptr,
                             coarse_table ? &*coarse_table : nullptr,
                             floored ? floored->row : std::vector<int32_t>{}, stride, kernel_size,
                             dilation, tensor_stride);
  }
  // Every other relation between two sets looks its inputs up by key where
  // they ascend (on a 100k-row scan, kernel 3 and stride 2 built in 9.2-9.9
  // ms against 16.8-17.8 through the hash, kernel 5 in 25-27 against
  // 63-69), else in the hash.
  const bool symmetric = kind == "submanifold" && odd;
  if (!self && !parents) {
    if (!symmetric && !table && !in_sorted) in_sorted = SortedRows::of(in_c, n_in);
    if (symmetric || !in_sorted) in_table();
  }
  // A forward relation of a two-tap kernel: each input has at most one edge
  // (to its parent), so its input grouping is a rank (below); onto computed
  // outputs the edges are written in the order the outputs were computed in.
  const bool single_inputs = parents && kind == "forward";
  constexpr int64_t kPartRows = 16384;  // rows per part of its parallel passes

  Int32Buffer out_offsets(n_out + 1);
  out_offsets.data[0] = 0;
  Int32Buffer in_rows, out_rows, kernel_ids, k_offsets(n_kernels + 1), k_edge_ids;
  auto allocate = [&](int64_t n_edges) {
    in_rows = Int32Buffer(n_edges);
    out_rows = Int32Buffer(n_edges);
    kernel_ids = Int32Buffer(n_edges);
    k_edge_ids = Int32Buffer(n_edges);
  };
  auto allocate_edges = [&] {
    for (int64_t o = 0; o < n_out; ++o) out_offsets.data[o + 1] += out_offsets.data[o];
    allocate(out_offsets.data[n_out]);
  };
  const bool mirrored = (gridded || walked) && masked;
  // Writes row o's edges at its offset; present[0..m) and kernel[0..m) get
  // its neighbours and their offsets. With offset masks, from the mask's set
  // bits (a LiDAR voxel has about 6 of 27); else compacted without branches
  // (whether a neighbour exists is data, not a pattern the branch predictor
  // learns).
  auto write_row = [&](int64_t o, const int32_t* nbr, int32_t* present, int32_t* kernel) {
    int64_t m = 0;
    if (mirrored) {
      for (uint32_t bits = masks[o]; bits != 0; bits &= bits - 1) {
        const int k = std::countr_zero(bits);
        present[m] = nbr[k];
        kernel[m++] = k;
      }
    } else {
      for (int64_t k = 0; k < n_kernels; ++k) {
        present[m] = nbr[k];
        kernel[m] = static_cast<int32_t>(k);
        m += nbr[k] >= 0;
      }
    }
    const int64_t e = out_offsets.data[o];
    std::copy(present, present + m, in_rows.data + e);
    std::fill(out_rows.data + e, out_rows.data + e + m, static_cast<int32_t>(o));
    std::copy(kernel, kernel + m, kernel_ids.data + e);
    return m;
  };
  Int32Buffer in_edge_ids;
  // Row o's input edge ids (edge (in o, out q, K - 1 - k) for each
  // neighbour q = present[i] at kernel[i]); ids ascend with q, so sort the
  // (at most 32) ids.
  auto write_mirrored_ids = [&](int64_t o, const int32_t* present, const int32_t* kernel,
                                int64_t m) {
    int32_t ids[32];
    for (int64_t i = 0; i < m; ++i) {
      const int32_t q = present[i];
      const uint32_t below = (uint32_t{1} << (n_kernels - 1 - kernel[i])) - 1;
      const int32_t id = out_offsets.data[q] + popcount32(masks[q] & below);
      int64_t j = i;
      for (; j > 0 && ids[j - 1] > id; --j) ids[j] = ids[j - 1];
      ids[j] = id;
    }
    std::copy(ids, ids + m, in_edge_ids.data + out_offsets.data[o]);
  };
  if (gridded) {
    // Two visits: count each row's edges, then write them at its offset
    // (searching again is cheaper than storing an (n_out, K) map).
    grid.for_each_row(offsets, [&](int64_t o, const int32_t* nbr) {
      int32_t count = 0;
      uint32_t mask = 0;
      for (int64_t k = 0; k < n_kernels; ++k) {
        count += nbr[k] >= 0;
        if (mirrored) mask |= static_cast<uint32_t>(nbr[k] >= 0) << k;
      }
      out_offsets.data[o + 1] = count;
      if (mirrored) masks[o] = mask;
    });
    check_edge_count(n_out, out_offsets.data);
    allocate_edges();
    if (mirrored) in_edge_ids = Int32Buffer(out_offsets.data[n_out]);
    grid.for_each_row(offsets, [&](int64_t o, const int32_t* nbr) {
      int32_t present[kMaxKernels], kernel[kMaxKernels];
      const int64_t m = write_row(o, nbr, present, kernel);
      if (mirrored) write_mirrored_ids(o, present, kernel, m);
    });
  } else if (single_inputs && floored) {
    // Computed outputs: each input's edge (if it has a parent) in the order
    // of floored->order, which lists each output's inputs together, outputs
    // ascending, by (x, y, z) inside an output: the order of its offsets
    // (relation_strided.h). Parts of that order in parallel, each starting
    // at the edges of the parts before it.
    const int32_t* order = floored->order.data();
    const int32_t* parent = parents->row.data();
    const int32_t* parent_k = parents->kernel.data();
    const int64_t parts = ceil_div(n_in, kPartRows);
    const std::vector<int32_t> first =
        part_starts(n_in, kPartRows, [&](int64_t i) { return parent[order[i]] >= 0; });
    const int64_t n_edges = first[parts];
    allocate(n_edges);
    parallel_for(parts, [&](int64_t t) {
      int32_t* ins = in_rows.data;
      int32_t* outs = out_rows.data;
      int32_t* kids = kernel_ids.data;
      int32_t e = first[t];
      for (int64_t i = t * kPartRows; i < std::min(n_in, (t + 1) * kPartRows); ++i) {
        const int32_t p = order[i], q = parent[p];
        if (q < 0) continue;
        ins[e] = p;
        outs[e] = q;
        kids[e++] = parent_k[p];
      }
    });
    // Outputs ascend along the edges: output o's first edge is the first
    // edge of an output >= o (outputs without an input keep none).
    parallel_for(ceil_div(n_edges, kPartRows), [&](int64_t t) {
      const int32_t* outs = out_rows.data;
      int32_t* first_edge = out_offsets.data;
      for (int64_t e = t * kPartRows; e < std::min(n_edges, (t + 1) * kPartRows); ++e) {
        for (int64_t o = e == 0 ? 0 : outs[e - 1] + 1; o <= outs[e]; ++o) {
          first_edge[o] = static_cast<int32_t>(e);
        }
      }
    });
    for (int64_t o = n_edges == 0 ? 0 : out_rows.data[n_edges - 1] + 1; o <= n_out; ++o) {
      out_offsets.data[o] = static_cast<int32_t>(n_edges);
    }
  } else if (parents) {
    // Target: one edge at most per output (a fine row), already in output
    // order. Forward onto given outputs: one at most per input; a stable
    // counting sort by output, then each output's few edges by ascending
    // offset.
    const bool by_input = kind == "forward";
    const int64_t n_fine = by_input ? n_in : n_out;
    std::vector<int32_t> cnt(by_input ? n_out + 1 : 0, 0);
    if (by_input) {
      for (int64_t p = 0; p < n_fine; ++p) {
        if (parents->row[p] >= 0) ++cnt[parents->row[p] + 1];
      }
      for (int64_t o = 0; o < n_out; ++o) out_offsets.data[o + 1] = cnt[o + 1];
    } else {
      for (int64_t o = 0; o < n_out; ++o) out_offsets.data[o + 1] = parents->row[o] >= 0;
    }
    allocate_edges();
    if (by_input) {
      std::copy(out_offsets.data, out_offsets.data + n_out, cnt.begin());
      for (int64_t p = 0; p < n_fine; ++p) {
        const int32_t q = parents->row[p];
        if (q < 0) continue;
        const int32_t e = cnt[q]++;
        in_rows.data[e] = static_cast<int32_t>(p);
        out_rows.data[e] = q;
        kernel_ids.data[e] = parents->kernel[p];
      }
      parallel_for((n_out + 4095) / 4096, [&](int64_t t) {
        for (int64_t o = t * 4096; o < std::min(n_out, (t + 1) * 4096); ++o) {
          sort_row_by_offset(kernel_ids.data, in_rows.data, out_offsets.data[o],
                             out_offsets.data[o + 1]);
        }
      });
    } else {
      int32_t e = 0;
      for (int64_t o = 0; o < n_out; ++o) {
        if (parents->row[o] < 0) continue;
        in_rows.data[e] = parents->row[o];
        out_rows.data[e] = static_cast<int32_t>(o);
        kernel_ids.data[e] = parents->kernel[o];
        ++e;
      }
    }
  } else if (mirrored) {
    // Sorted and symmetric (mirrored implies walked here). The walk gives
    // each row's neighbours before the centre and every row's offset mask.
    // One pass over tiles of rows then writes each such edge e = (out o,
    // in q, k < centre) with its mirror e' = (out q, in o, K - 1 - k), whose
    // place in q's edges the mask gives:
    //  - input_edge_ids: row o's input edges are the mirrors of its own, and
    //    sorted rows put q in the order of k, so their ids ascend:
    //    in_edge_ids[e] = e' and in_edge_ids[e'] = e;
    //  - kernel grouping: the edges of k ascend with o, and so do their
    //    mirrors' rows q (the row of coords[o] + offset k), so group K - 1 - k
    //    is group k's mirrors in the same order. Each tile's first slot per
    //    offset is counted beforehand; the order is group_by_offset's.
    const int64_t centre = n_kernels / 2;
    const int32_t* half = sorted_map.get();
    constexpr int64_t kTile = 2048;
    const int64_t n_tiles = ceil_div(n_out, kTile);
    std::vector<int32_t> k_slot(n_tiles * (centre + 1));
    const MirrorKernels kernels = mirror_kernels();
    // Row offsets in two parallel passes: each row's first edge counted from
    // its tile's, then the tiles' first edges added (no serial pass over the
    // rows).
    std::vector<int64_t> tile_edges(n_tiles);
    parallel_for(n_tiles, [&](int64_t t) {
      const int64_t o0 = t * kTile, o1 = std::min(n_out, o0 + kTile);
      const uint32_t* m = masks.data();
      int32_t* first = out_offsets.data;
      kernels.count(m, o0, o1, first + 1, static_cast<int>(centre),
                    k_slot.data() + t * (centre + 1));
      int32_t edges = 0;  // at most kTile * 32
      for (int64_t o = o0; o < o1; ++o) first[o + 1] = edges += first[o + 1];
      tile_edges[t] = edges;
    });
    int64_t edge_count = 0;
    for (int64_t& edges : tile_edges) {
      const int64_t base = edge_count;
      edge_count += edges;
      edges = base;
    }
    check_edge_total(edge_count);
    parallel_for(n_tiles, [&](int64_t t) {
      const auto base = static_cast<int32_t>(tile_edges[t]);
      int32_t* first = out_offsets.data;
      for (int64_t o = t * kTile; o < std::min(n_out, (t + 1) * kTile); ++o) first[o + 1] += base;
    });
    allocate(edge_count);
    in_edge_ids = Int32Buffer(edge_count);
    int32_t total = 0;
    for (int64_t k = 0; k < n_kernels; ++k) {
      k_offsets.data[k] = total;
      if (k > centre) {  // group k holds group K - 1 - k's mirrors
        total += k_offsets.data[n_kernels - k] - k_offsets.data[n_kernels - 1 - k];
        continue;
      }
      for (int64_t t = 0; t < n_tiles; ++t) {
        const int32_t count = k_slot[t * (centre + 1) + k];
        k_slot[t * (centre + 1) + k] = total;
        total += count;
      }
    }
    k_offsets.data[n_kernels] = total;
    const MirrorTile tiles{masks.data(),      half,           out_offsets.data, k_offsets.data,
                           k_slot.data(),     in_rows.data,   out_rows.data,    kernel_ids.data,
                           in_edge_ids.data,  k_edge_ids.data, n_out,           n_kernels,
                           kTile};
    parallel_for(n_tiles, [&](int64_t t) { kernels.write(tiles, t); });
  } else {
    std::vector<int32_t> hashed_cells;
    if (!walked) {
      hashed_cells = table ? neighbour_map(*table, out_c, n_out, offsets, symmetric)
                           : in_sorted->neighbour_map(out_c, n_out, offsets);
    }
    const int32_t* map = walked ? sorted_map.get() : hashed_cells.data();
    const int64_t tile = 1024;
    parallel_for(ceil_div(n_out, tile), [&](int64_t t) {
      const int64_t o1 = std::min(n_out, (t + 1) * tile);
      for (int64_t o = t * tile; o < o1; ++o) {
        int32_t count = 0;
        for (int64_t k = 0; k < n_kernels; ++k) count += map[o * n_kernels + k] >= 0;
        out_offsets.data[o + 1] = count;
      }
    });
    check_edge_count(n_out, out_offsets.data);
    allocate_edges();
    parallel_for(ceil_div(n_out, tile), [&](int64_t t) {
      const int64_t o1 = std::min(n_out, (t + 1) * tile);
      int32_t present[kMaxKernels], kernel[kMaxKernels];
      for (int64_t o = t * tile; o < o1; ++o) {
        write_row(o, map + o * n_kernels, present, kernel);
      }
    });
  }
  const int64_t n_edges = out_offsets.data[n_out];

  // A symmetric relation's input grouping has its output grouping's
  // offsets: the same array.
  Int32Buffer in_offsets = mirrored ? out_offsets : Int32Buffer(n_in + 1);
  if (mirrored) {
    if (gridded) {
      group_by_offset(masks.data(), out_offsets.data, n_out, n_kernels, k_offsets.data,
                      k_edge_ids.data);
    }
  } else if (single_inputs) {
    // At most one edge per input: the input grouping is each input's edge
    // at its rank among the inputs with one (no counting sort over n_in
    // groups).
    in_edge_ids = Int32Buffer(n_edges);
    const int32_t* parent = parents->row.data();
    const int64_t parts = ceil_div(n_in, kPartRows);
    const std::vector<int32_t> first =
        part_starts(n_in, kPartRows, [&](int64_t p) { return parent[p] >= 0; });
    in_offsets.data[n_in] = first[parts];
    parallel_for(parts, [&](int64_t t) {
      int32_t* rank = in_offsets.data;
      int32_t at = first[t];
      for (int64_t p = t * kPartRows; p < std::min(n_in, (t + 1) * kPartRows); ++p) {
        rank[p] = at;
        at += parent[p] >= 0;
      }
    });
    parallel_for(ceil_div(n_edges, kPartRows), [&](int64_t t) {
      const int32_t* rank = in_offsets.data;
      const int32_t* ins = in_rows.data;
      int32_t* ids = in_edge_ids.data;
      for (int64_t e = t * kPartRows; e < std::min(n_edges, (t + 1) * kPartRows); ++e) {
        ids[rank[ins[e]]] = static_cast<int32_t>(e);
      }
    });
    group_by(n_edges, {kernel_ids.data, n_kernels, k_offsets.data, k_edge_ids.data});
  } else {
    in_edge_ids = Int32Buffer(n_edges);
    group_by(n_edges, {in_rows.data, n_in, in_offsets.data, in_edge_ids.data},
             {kernel_ids.data, n_kernels, k_offsets.data, k_edge_ids.data});
  }

  auto result = RelationBuffers{in_rows,    out_rows,    kernel_ids, out_offsets,
                                in_offsets, in_edge_ids, k_offsets,  k_edge_ids}
                    .arrays();
  result.emplace("out_coords", out);
  return result;
}

}  // namespace mlx_lattice
