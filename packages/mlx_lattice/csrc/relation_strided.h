// The computed outputs of a strided `forward` relation: the input
// coordinates floored to the stride, unique, in ascending (batch, x, y, z)
// order, so a network's coarser levels stay sorted and their relations take
// the sorted walk (relation_sorted.h).
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <vector>

namespace mlx_lattice {

// Floor division by a step >= 1 (toward minus infinity): a shift when the
// step is a power of two, as tensor strides are.
class FloorDiv {
 public:
  FloorDiv() : FloorDiv(1) {}
  explicit FloorDiv(int64_t step)
      : step_(step),
        shift_(std::has_single_bit(static_cast<uint64_t>(step))
                   ? std::countr_zero(static_cast<uint64_t>(step))
                   : -1) {}
  int64_t quotient(int64_t v) const {
    if (shift_ >= 0) return v >> shift_;  // arithmetic: floors negatives too
    const int64_t q = v / step_;
    return q * step_ > v ? q - 1 : q;
  }
  int64_t floor(int64_t v) const { return quotient(v) * step_; }
  int64_t step() const { return step_; }

 private:
  int64_t step_;
  int shift_;
};

struct StridedOutputs {
  std::vector<int32_t> coords;  // (m, 4) floored rows, ascending
  std::vector<int32_t> row;     // each input row's output row
  // The input rows grouped by output row (ascending), and within an output
  // by (x, y, z): the order of a kernel's offsets when every input row is
  // its output plus one offset.
  std::vector<int32_t> order;
};

// The outputs of n input rows floored to `step` per axis: for rows
// ascending by (batch, x, y, z), as every level of a network has them, by a
// merge of each (batch, floored x) slab's lines in parallel; otherwise by a
// radix sort of (floored cell, offset in cell) keys. Raises (naming
// build_kernel_relation) on a duplicated input row, or a floored coordinate
// outside int32.
StridedOutputs strided_outputs(const int32_t* in, int64_t n, const std::array<int64_t, 3>& step);

}  // namespace mlx_lattice
