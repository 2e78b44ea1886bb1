#include "relation_strided.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>

#include "cpu/parallel.h"
#include "relation_sorted.h"
#include "validate.h"

namespace mlx_lattice {

namespace {

constexpr int kDigitBits = 10;

// Stable LSD radix sort of (key, row) pairs by the keys' low `bits` bits.
void radix_sort(std::vector<uint64_t>& keys, std::vector<int32_t>& rows, int bits) {
  const size_t n = keys.size();
  std::vector<uint64_t> keys_out(n);
  std::vector<int32_t> rows_out(n);
  std::vector<size_t> count(size_t{1} << kDigitBits);
  const uint64_t mask = (uint64_t{1} << kDigitBits) - 1;
  size_t* counts = count.data();
  for (int shift = 0; shift < bits; shift += kDigitBits) {
    // Raw pointers: without strict aliasing a store through the vectors
    // would reload their data pointers.
    const uint64_t* k_in = keys.data();
    const int32_t* r_in = rows.data();
    uint64_t* k_out = keys_out.data();
    int32_t* r_out = rows_out.data();
    std::fill(counts, counts + count.size(), 0);
    for (size_t i = 0; i < n; ++i) ++counts[(k_in[i] >> shift) & mask];
    if (counts[(k_in[0] >> shift) & mask] == n) continue;  // one digit value: no change
    size_t total = 0;
    for (size_t d = 0; d < count.size(); ++d) total += std::exchange(counts[d], total);
    for (size_t i = 0; i < n; ++i) {
      const size_t slot = counts[(k_in[i] >> shift) & mask]++;
      k_out[slot] = k_in[i];
      r_out[slot] = r_in[i];
    }
    keys.swap(keys_out);
    rows.swap(rows_out);
  }
}

[[noreturn]] void fail_outside(const int32_t* in, int64_t r, const FloorDiv* div,
                               const std::array<int64_t, 3>& step) {
  int a = 0;
  while (div[a].floor(in[4 * r + a + 1]) >= std::numeric_limits<int32_t>::min()) ++a;
  fail("build_kernel_relation",
       "in_coords row " + std::to_string(r) + " floored to the stride " + std::to_string(step[a]) +
           " is " + std::to_string(div[a].floor(in[4 * r + a + 1])) + ", outside int32.");
}

// Whether rows a and b of ascending rows are in one slab: one (batch,
// floored x).
bool same_slab(const int32_t* in, const FloorDiv* div, int64_t a, int64_t b) {
  return in[4 * a] == in[4 * b] &&
         div[0].quotient(in[4 * a + 1]) == div[0].quotient(in[4 * b + 1]);
}

// The cells of the slabs of rows [begin, end) of ascending rows: order and
// row for those rows (row: the cell's index among this part's cells), the
// cells' coordinates appended to `cells`.
//
// A slab is the rows of one (batch, floored x), contiguous in ascending
// rows; in it the rows of one x form a run ordered by (y, z), and the rows
// of one (x, y) a line ordered by z. The slab's cells come in (floored y,
// floored z) order: for the lowest floored y left in any run, every run's
// lines of that floored y are taken (in (x, y) order); then the lowest
// floored z at the lines' heads is the next cell, whose rows are each
// line's rows of that floored z, lines in (x, y) order, which is the order
// of (x, y, z) and so of the kernel's offsets. No row is compared twice.
void merge_slabs(const int32_t* in, int64_t begin, int64_t end, const FloorDiv* div,
                 int32_t* order, int32_t* row, std::vector<int32_t>& cells) {
  struct Span {
    int64_t at, end;
  };
  std::vector<Span> runs, lines;
  auto x_of = [&](int64_t r) { return in[4 * r + 1]; };
  auto qy = [&](int64_t r) { return div[1].quotient(in[4 * r + 2]); };
  auto qz = [&](int64_t r) { return div[2].quotient(in[4 * r + 3]); };
  int64_t next = begin;  // the next position of `order`
  int32_t cell = 0;
  for (int64_t s = begin; s < end;) {
    const int32_t batch = in[4 * s];
    const int64_t fx = div[0].quotient(x_of(s));
    int64_t e = s + 1;
    while (e < end && same_slab(in, div, s, e)) ++e;
    runs.clear();
    for (int64_t r = s; r < e;) {
      int64_t q = r + 1;
      while (q < e && x_of(q) == x_of(r)) ++q;
      runs.push_back({r, q});
      r = q;
    }
    for (;;) {
      int64_t fy = std::numeric_limits<int64_t>::max();
      for (const Span& run : runs) {
        if (run.at < run.end) fy = std::min(fy, qy(run.at));
      }
      if (fy == std::numeric_limits<int64_t>::max()) break;
      lines.clear();
      for (Span& run : runs) {
        while (run.at < run.end && qy(run.at) == fy) {
          int64_t q = run.at + 1;
          while (q < run.end && in[4 * q + 2] == in[4 * run.at + 2]) ++q;
          lines.push_back({run.at, q});
          run.at = q;
        }
      }
      for (;;) {
        int64_t fz = std::numeric_limits<int64_t>::max();
        for (const Span& line : lines) {
          if (line.at < line.end) fz = std::min(fz, qz(line.at));
        }
        if (fz == std::numeric_limits<int64_t>::max()) break;
        for (Span& line : lines) {
          for (; line.at < line.end && qz(line.at) == fz; ++line.at) {
            order[next++] = static_cast<int32_t>(line.at);
            row[line.at] = cell;
          }
        }
        cells.insert(cells.end(), {batch, static_cast<int32_t>(fx * div[0].step()),
                                   static_cast<int32_t>(fy * div[1].step()),
                                   static_cast<int32_t>(fz * div[2].step())});
        ++cell;
      }
    }
    s = e;
  }
}

// strided_outputs of ascending rows, slab by slab: parts of whole slabs in
// parallel, each part's cells numbered after the parts before it.
void merge_ascending(const int32_t* in, int64_t n, const FloorDiv* div, StridedOutputs& out) {
  constexpr int64_t kPartRows = 8192;
  const int64_t want = std::min<int64_t>(ceil_div(n, kPartRows), 4 * get_num_threads());
  std::vector<int64_t> bounds{0};
  for (int64_t p = 1; p < want; ++p) {
    int64_t b = std::max(bounds.back(), n * p / want);
    while (b > 0 && b < n && same_slab(in, div, b - 1, b)) ++b;  // to the next slab's start
    if (b > bounds.back() && b < n) bounds.push_back(b);
  }
  bounds.push_back(n);
  const int64_t parts = static_cast<int64_t>(bounds.size()) - 1;
  std::vector<std::vector<int32_t>> cells(parts);
  parallel_for(parts, [&](int64_t p) {
    // Appended to a vector of the thread's own, moved in once: the parts'
    // vectors sit side by side in `cells`, so growing cells[p] in place
    // would write its end pointer into a cache line the other threads'
    // parts are writing too (measured: half the merge's time).
    std::vector<int32_t> mine;
    mine.reserve(static_cast<size_t>(bounds[p + 1] - bounds[p]) * 4);
    merge_slabs(in, bounds[p], bounds[p + 1], div, out.order.data(), out.row.data(), mine);
    cells[p] = std::move(mine);
  });
  std::vector<int32_t> base(parts + 1, 0);
  for (int64_t p = 0; p < parts; ++p) {
    base[p + 1] = base[p] + static_cast<int32_t>(cells[p].size() / 4);
  }
  out.coords.resize(4 * static_cast<size_t>(base[parts]));
  parallel_for(parts, [&](int64_t p) {
    for (int64_t r = bounds[p]; r < bounds[p + 1]; ++r) out.row[r] += base[p];
    std::copy(cells[p].begin(), cells[p].end(), out.coords.begin() + 4 * int64_t{base[p]});
  });
}

int bit_width(unsigned __int128 v) {
  int bits = 0;
  for (; v != 0; v >>= 1) ++bits;
  return bits;
}

}  // namespace

StridedOutputs strided_outputs(const int32_t* in, int64_t n, const std::array<int64_t, 3>& step) {
  const std::string op = "build_kernel_relation";
  StridedOutputs out;
  out.row.resize(n);
  out.order.resize(n);
  if (n == 0) return out;
  const FloorDiv div[3] = {FloorDiv(step[0]), FloorDiv(step[1]), FloorDiv(step[2])};

  // One parallel pass: whether the rows ascend, and each column's range.
  // Flooring is monotone, so the quotients' ranges are the quotients of
  // the range's ends, and a floored coordinate below int32 exists exactly
  // when one end's is (the first such row is then searched for the
  // message).
  constexpr int64_t kChunk = int64_t{1} << 15;
  const int64_t n_chunks = ceil_div(n, kChunk);
  std::array<int64_t, 4> lo, hi;
  const bool ascending = rows_ascending(in, n, lo, hi);
  int64_t outside = -1;  // raised after duplicates, which come first
  for (int a = 0; a < 3; ++a) {
    lo[a + 1] = div[a].quotient(lo[a + 1]);
    hi[a + 1] = div[a].quotient(hi[a + 1]);
    if (lo[a + 1] * div[a].step() < std::numeric_limits<int32_t>::min()) outside = n;
  }
  for (int64_t r = 0; outside == n && r < n; ++r) {
    for (int a = 0; a < 3; ++a) {
      if (div[a].floor(in[4 * r + a + 1]) < std::numeric_limits<int32_t>::min()) outside = r;
    }
  }

  if (ascending) {
    // Strictly ascending rows have no duplicates: only the int32 check.
    merge_ascending(in, n, div, out);
    if (outside >= 0) fail_outside(in, outside, div, step);
    return out;
  }

  // Sort the rows by (batch, floored x, y, z), then (x, y, z): one key per
  // row, the floored cell in mixed radix above the offset within the cell,
  // when both fit 64 bits; else compare the coordinates.
  std::vector<int32_t>& order = out.order;
  std::iota(order.begin(), order.end(), 0);
  // An offset within a cell is below the step and below 2^32 (a floored
  // coordinate is in int32, so at most 2^32 - 1 below its row's).
  std::array<int64_t, 3> offset_radix;
  unsigned __int128 cells = static_cast<unsigned __int128>(hi[0] - lo[0] + 1);
  unsigned __int128 within = 1;
  for (int a = 0; a < 3; ++a) {
    offset_radix[a] = std::min<int64_t>(step[a], int64_t{1} << 32);
    cells *= static_cast<unsigned __int128>(hi[a + 1] - lo[a + 1] + 1);
    within *= static_cast<unsigned __int128>(offset_radix[a]);
  }
  const int cell_bits = bit_width(cells - 1), within_bits = bit_width(within - 1);
  const bool packed = cell_bits + within_bits <= 64;
  std::vector<uint64_t> keys;
  if (packed) {
    keys.resize(n);
    parallel_for(n_chunks, [&](int64_t t) {
      const FloorDiv d[3] = {div[0], div[1], div[2]};
      int64_t low[4], cell_radix[3], within_radix[3];
      for (int a = 0; a < 4; ++a) low[a] = lo[a];
      for (int a = 0; a < 3; ++a) {
        cell_radix[a] = hi[a + 1] - lo[a + 1] + 1;
        within_radix[a] = offset_radix[a];
      }
      const int shift = within_bits;
      uint64_t* out_keys = keys.data();
      for (int64_t r = t * kChunk; r < std::min(n, (t + 1) * kChunk); ++r) {
        const int32_t* c = in + 4 * r;
        uint64_t cell = static_cast<uint64_t>(c[0] - low[0]), offset = 0;
        for (int a = 0; a < 3; ++a) {
          const int64_t q = d[a].quotient(c[a + 1]);
          cell = cell * static_cast<uint64_t>(cell_radix[a]) +
                 static_cast<uint64_t>(q - low[a + 1]);
          offset = offset * static_cast<uint64_t>(within_radix[a]) +
                   static_cast<uint64_t>(c[a + 1] - q * d[a].step());
        }
        // (shifting by 64 would be undefined; there is no offset then)
        out_keys[r] = shift == 0 ? cell : (cell << (shift & 63)) | offset;
      }
    });
    radix_sort(keys, order, cell_bits + within_bits);
  } else {
    auto rank = [&](int32_t r) {
      const int32_t* c = in + 4 * static_cast<int64_t>(r);
      return std::array<int64_t, 8>{c[0],
                                    div[0].quotient(c[1]),
                                    div[1].quotient(c[2]),
                                    div[2].quotient(c[3]),
                                    c[1],
                                    c[2],
                                    c[3],
                                    r};
    };
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return rank(a) < rank(b); });
  }

  // Number the cells in order; a repeated key is a duplicated input row
  // (reported as a scan in row order would: the smallest second row).
  auto cell_of = [&](int64_t i) { return within_bits >= 64 ? 0 : keys[i] >> within_bits; };
  auto same_cell = [&](int64_t i) {
    if (packed) return cell_of(i) == cell_of(i - 1);
    const int32_t *a = in + 4 * static_cast<int64_t>(order[i - 1]),
                  *b = in + 4 * static_cast<int64_t>(order[i]);
    bool same = a[0] == b[0];
    for (int ax = 0; ax < 3 && same; ++ax) {
      same = div[ax].quotient(a[ax + 1]) == div[ax].quotient(b[ax + 1]);
    }
    return same;
  };
  auto same_row = [&](int64_t i) {
    if (packed) return keys[i] == keys[i - 1];
    return std::memcmp(in + 4 * static_cast<int64_t>(order[i - 1]),
                       in + 4 * static_cast<int64_t>(order[i]), 16) == 0;
  };
  int64_t first_dup = -1, dup_of = -1;
  int32_t id = -1;
  out.coords.resize(4 * n);
  int32_t* coords = out.coords.data();
  int32_t* row = out.row.data();
  for (int64_t i = 0; i < n; ++i) {
    const int32_t r = order[i];
    if (i == 0 || !same_cell(i)) {
      const int32_t* c = in + 4 * static_cast<int64_t>(r);
      int32_t* o = coords + 4 * static_cast<int64_t>(++id);
      o[0] = c[0];
      for (int a = 0; a < 3; ++a) o[a + 1] = static_cast<int32_t>(div[a].floor(c[a + 1]));
    } else if (same_row(i) && !(i >= 2 && same_row(i - 1)) && (first_dup < 0 || r < first_dup)) {
      first_dup = r;  // the second of a run of equal rows (rows ascend in a run)
      dup_of = order[i - 1];
    }
    row[r] = id;
  }
  out.coords.resize(4 * static_cast<int64_t>(id + 1));
  if (first_dup >= 0) {
    const int32_t* c = in + 4 * first_dup;
    std::ostringstream msg;
    msg << "in_coords has duplicate coordinate (" << c[0] << ", " << c[1] << ", " << c[2] << ", "
        << c[3] << ") at rows " << dup_of << " and " << first_dup << ".";
    fail(op, msg.str());
  }
  if (outside >= 0) fail_outside(in, outside, div, step);
  return out;
}

}  // namespace mlx_lattice
