#include "relation_groups.h"

#include <algorithm>
#include <vector>

#include "cpu/parallel.h"

namespace mlx_lattice {

namespace {

// A stable counting sort in `chunks` parallel parts: count(c, counts) adds
// part c's members of each group to counts[g]; scatter(c, next) writes part
// c's ids, each at next[g]++ for its group g. Groups are laid out group by
// group, parts in order within a group, so the result is the one stable
// order whatever the number of parts (and so of threads).
template <class Count, class Scatter>
void counting_sort(int64_t chunks, int64_t groups, int32_t* offsets, Count&& count,
                   Scatter&& scatter) {
  // cursor[c * groups + g]: part c's count of g, then its first slot for g.
  std::vector<int32_t> cursor(chunks * groups, 0);
  parallel_for(chunks, [&](int64_t c) { count(c, cursor.data() + c * groups); });
  int32_t total = 0;
  for (int64_t g = 0; g < groups; ++g) {
    offsets[g] = total;
    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t n = cursor[c * groups + g];
      cursor[c * groups + g] = total;
      total += n;
    }
  }
  offsets[groups] = total;
  parallel_for(chunks, [&](int64_t c) { scatter(c, cursor.data() + c * groups); });
}

}  // namespace

// Counting sort of edge ids by key, in chunks of edges.
void group_by(const int32_t* keys, int64_t n_edges, int64_t groups, int32_t* offsets,
              int32_t* edge_ids) {
  constexpr int64_t kMinChunk = int64_t{1} << 16;
  const int64_t chunks = std::max<int64_t>(
      1, std::min<int64_t>(get_num_threads(), n_edges / kMinChunk));
  const int64_t per = (n_edges + chunks - 1) / chunks;
  counting_sort(
      chunks, groups, offsets,
      [&](int64_t c, int32_t* count) {
        for (int64_t e = c * per; e < std::min(n_edges, (c + 1) * per); ++e) ++count[keys[e]];
      },
      [&](int64_t c, int32_t* next) {
        for (int64_t e = c * per; e < std::min(n_edges, (c + 1) * per); ++e) {
          edge_ids[next[keys[e]]++] = static_cast<int32_t>(e);
        }
      });
}

// The kernel grouping from each output row's offset mask (bit k: the row has
// an edge at offset k, edges of a row stored by ascending k from its
// offset), in tiles of rows: the same stable order as group_by.
void group_by_offset(const uint32_t* masks, const int32_t* out_offsets, int64_t n_out,
                     int64_t n_kernels, int32_t* k_offsets, int32_t* k_edge_ids) {
  constexpr int64_t kTile = 8192;
  counting_sort(
      (n_out + kTile - 1) / kTile, n_kernels, k_offsets,
      [&](int64_t t, int32_t* count) {
        for (int64_t o = t * kTile; o < std::min(n_out, (t + 1) * kTile); ++o) {
          for (uint32_t m = masks[o]; m != 0; m &= m - 1) ++count[__builtin_ctz(m)];
        }
      },
      [&](int64_t t, int32_t* next) {
        for (int64_t o = t * kTile; o < std::min(n_out, (t + 1) * kTile); ++o) {
          int32_t e = out_offsets[o];
          for (uint32_t m = masks[o]; m != 0; m &= m - 1) {
            k_edge_ids[next[__builtin_ctz(m)]++] = e++;
          }
        }
      });
}

}  // namespace mlx_lattice
