#include "relation_groups.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <utility>
#include <vector>

#include "cpu/parallel.h"

namespace mlx_lattice {

namespace {

// Where one grouping's ids go: groups, offsets (groups + 1), ids.
struct Target {
  int64_t groups;
  int32_t* offsets;
  int32_t* ids;
};

// Stable counting sorts of the same items into N groupings at once, in
// `chunks` parallel parts. walk(c, visit) calls visit(id, keys) for part c's
// items in order, keys[s] being the item's group in grouping s; it runs
// twice per part (count, then scatter), so each grouping costs no pass of
// its own. Groups are laid out group by group, parts in order within a
// group, so the result is the one stable order whatever the number of parts
// (and so of threads).
template <size_t N, class Walk>
void counting_sort(int64_t chunks, const std::array<Target, N>& targets, Walk&& walk) {
  // cursor[s][c * stride[s] + g]: part c's count of g, then its first slot
  // for g. Each part's row is padded to whole cache lines: parts run on
  // different threads, and a few groups (a kernel's offsets) would otherwise
  // put two parts' counters, incremented per item, in one line.
  std::array<std::vector<int32_t>, N> cursor;
  std::array<int64_t, N> stride;
  for (size_t s = 0; s < N; ++s) {
    stride[s] = (targets[s].groups + 15) / 16 * 16;
    cursor[s].assign(chunks * stride[s], 0);
  }
  parallel_for(chunks, [&](int64_t c) {
    std::array<int32_t*, N> count;
    for (size_t s = 0; s < N; ++s) count[s] = cursor[s].data() + c * stride[s];
    walk(c, [&](int32_t, const std::array<int32_t, N>& keys) {
      for (size_t s = 0; s < N; ++s) ++count[s][keys[s]];
    });
  });
  for (size_t s = 0; s < N; ++s) {
    const int64_t groups = targets[s].groups;
    int32_t total = 0;
    for (int64_t g = 0; g < groups; ++g) {
      targets[s].offsets[g] = total;
      for (int64_t c = 0; c < chunks; ++c) {
        const int32_t n = cursor[s][c * stride[s] + g];
        cursor[s][c * stride[s] + g] = total;
        total += n;
      }
    }
    targets[s].offsets[groups] = total;
  }
  parallel_for(chunks, [&](int64_t c) {
    std::array<int32_t*, N> next;
    std::array<int32_t*, N> ids;
    for (size_t s = 0; s < N; ++s) {
      next[s] = cursor[s].data() + c * stride[s];
      ids[s] = targets[s].ids;
    }
    walk(c, [&](int32_t id, const std::array<int32_t, N>& keys) {
      for (size_t s = 0; s < N; ++s) ids[s][next[s][keys[s]]++] = id;
    });
  });
}

// Parts of n_edges edges for a counting sort: one per thread, each of at
// least kMinChunk edges.
int64_t edge_chunks(int64_t n_edges) {
  constexpr int64_t kMinChunk = int64_t{1} << 14;
  return std::max<int64_t>(1, std::min<int64_t>(get_num_threads(), n_edges / kMinChunk));
}

}  // namespace

// Counting sort of edge ids by both keys, in chunks of edges.
void group_by(int64_t n_edges, const EdgeGrouping& first, const EdgeGrouping& second) {
  const int64_t chunks = edge_chunks(n_edges);
  const int64_t per = (n_edges + chunks - 1) / chunks;
  const int32_t* a = first.keys;
  const int32_t* b = second.keys;
  counting_sort<2>(chunks,
                   {Target{first.groups, first.offsets, first.edge_ids},
                    Target{second.groups, second.offsets, second.edge_ids}},
                   [&](int64_t c, auto&& visit) {
                     const int64_t e1 = std::min(n_edges, (c + 1) * per);
                     for (int64_t e = c * per; e < e1; ++e) {
                       visit(static_cast<int32_t>(e), std::array<int32_t, 2>{a[e], b[e]});
                     }
                   });
}

void group_by(int64_t n_edges, const EdgeGrouping& grouping) {
  const int64_t chunks = edge_chunks(n_edges);
  const int64_t per = (n_edges + chunks - 1) / chunks;
  const int32_t* keys = grouping.keys;
  counting_sort<1>(chunks, {Target{grouping.groups, grouping.offsets, grouping.edge_ids}},
                   [&](int64_t c, auto&& visit) {
                     const int64_t e1 = std::min(n_edges, (c + 1) * per);
                     for (int64_t e = c * per; e < e1; ++e) {
                       visit(static_cast<int32_t>(e), std::array<int32_t, 1>{keys[e]});
                     }
                   });
}

// The kernel grouping from each output row's offset mask (bit k: the row has
// an edge at offset k, edges of a row stored by ascending k from its
// offset), in tiles of rows: the same stable order as group_by.
void group_by_offset(const uint32_t* masks, const int32_t* out_offsets, int64_t n_out,
                     int64_t n_kernels, int32_t* k_offsets, int32_t* k_edge_ids) {
  constexpr int64_t kTile = 8192;
  counting_sort<1>((n_out + kTile - 1) / kTile, {Target{n_kernels, k_offsets, k_edge_ids}},
                   [&](int64_t t, auto&& visit) {
                     const int64_t o1 = std::min(n_out, (t + 1) * kTile);
                     for (int64_t o = t * kTile; o < o1; ++o) {
                       int32_t e = out_offsets[o];
                       for (uint32_t m = masks[o]; m != 0; m &= m - 1) {
                         visit(e++, std::array<int32_t, 1>{
                                        static_cast<int32_t>(__builtin_ctz(m))});
                       }
                     }
                   });
}

// Rows hold a few edges (one or two for a two-tap kernel's transpose, at
// most 8 for its forward onto given outputs): insertion sort; past kShort
// edges (a large submanifold kernel's transpose), a sort of pairs.
void sort_row_by_offset(int32_t* kernel_ids, int32_t* in_rows, int64_t begin, int64_t end) {
  constexpr int64_t kShort = 32;
  if (end - begin <= kShort) {
    for (int64_t i = begin + 1; i < end; ++i) {
      const int32_t k = kernel_ids[i], r = in_rows[i];
      int64_t j = i;
      for (; j > begin && kernel_ids[j - 1] > k; --j) {
        kernel_ids[j] = kernel_ids[j - 1];
        in_rows[j] = in_rows[j - 1];
      }
      kernel_ids[j] = k;
      in_rows[j] = r;
    }
    return;
  }
  std::vector<std::pair<int32_t, int32_t>> row;
  row.reserve(static_cast<size_t>(end - begin));
  for (int64_t i = begin; i < end; ++i) row.emplace_back(kernel_ids[i], in_rows[i]);
  std::sort(row.begin(), row.end());
  for (int64_t i = begin; i < end; ++i) {
    kernel_ids[i] = row[static_cast<size_t>(i - begin)].first;
    in_rows[i] = row[static_cast<size_t>(i - begin)].second;
  }
}

}  // namespace mlx_lattice
