// CSR groupings of edges, the form every CPU kernel reads a relation's
// edges in, and the tiles they are cut into.
//
// Every kernel owns its output rows per task and reduces in a fixed order
// (kernel offsets ascending, then edges in CSR order), so results are the same
// bits for any thread count.
#pragma once

#include <cstdint>
#include <vector>

namespace mlx_lattice::kernels {

// Rows of output tiles (output-stationary work unit).
constexpr int64_t kTileRows = 128;

// Splits channels into blocks for channel-parallel scatters (each task owns
// whole columns, so edge order is kept and no two tasks write one value).
constexpr int64_t kChannelBlock = 16;

// A CSR grouping of edges: edges of group g are edge_ids[offsets[g]:offsets[g+1]]
// (edge_ids == nullptr means the identity: edges are stored grouped).
struct Csr {
  const int32_t* offsets = nullptr;
  const int32_t* edge_ids = nullptr;
  int64_t groups = 0;
};

// The first position p in [lo, end) of `csr`'s edge list (edge
// csr.edge_ids[p], or p where edge_ids is null) whose edge's row
// rows[edge] is at least `row`, by bisection: the lower bound where those
// rows ascend along [lo, end); where they do not, still a position in
// [lo, end], never a smaller one for a larger `row`. The weight gradients
// cut each offset's edges into runs of output rows with it.
inline int64_t first_at_row(const Csr& csr, const int32_t* rows, int64_t lo, int64_t end,
                            int64_t row) {
  for (int64_t n = end - lo; n > 0;) {
    const int64_t half = n / 2;
    const int64_t p = lo + half;
    if (rows[csr.edge_ids ? csr.edge_ids[p] : p] < row) {
      lo = p + 1;
      n -= half + 1;
    } else {
      n = half;
    }
  }
  return lo;
}

// Builds a CSR grouping of `n_edges` edges by key (stable: edge order kept
// within a group).
void group_by(const int32_t* keys, int64_t n_edges, int64_t groups, std::vector<int32_t>& offsets,
              std::vector<int32_t>& edge_ids);

}  // namespace mlx_lattice::kernels
