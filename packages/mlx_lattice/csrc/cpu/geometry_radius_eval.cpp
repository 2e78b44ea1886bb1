// CPU evaluation of GeometryRadius (reached on CPU streams only when the
// primitive is built there; the product's radius_relation calls the CPU
// search directly): both passes from geometry::radius_search.
#include <algorithm>
#include "input_error.h"
#include <stdexcept>
#include <vector>

#include "../primitives.h"
#include "eval.h"
#include "geometry_kernels.h"

namespace mlx_lattice {

namespace {

std::vector<double> as_doubles(const array& a) {
  std::vector<double> out(a.size());
  if (a.size() == 0) return out;
  if (a.dtype() == mx::float64) {
    std::copy_n(a.data<double>(), a.size(), out.begin());
  } else {
    std::copy_n(a.data<float>(), a.size(), out.begin());
  }
  return out;
}

}  // namespace

void GeometryRadius::eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) {
  cpu::dispatch(stream(), inputs, outputs, [radius = radius_, fill = fill_](
                                               std::vector<array>& in, std::vector<array>& out) {
    const int64_t nq = in[0].shape(0), ns = in[2].shape(0);
    const auto query = as_doubles(in[0]);
    const auto support = as_doubles(in[2]);
    auto nbrs = geometry::radius_search(query.data(), nq ? in[1].data<int32_t>() : nullptr, nq,
                                        support.data(), ns ? in[3].data<int32_t>() : nullptr, ns,
                                        radius, 0);
    if (!fill) {
      for (int64_t q = 0; q < nq; ++q) {
        out[0].data<int32_t>()[q] = nbrs.offsets[q + 1] - nbrs.offsets[q];
      }
      return;
    }
    if (nbrs.rows.size() != out[0].size()) {
      throw ::mlx_lattice::InputError("GeometryRadius: offsets do not match the neighbour counts.");
    }
    std::copy(nbrs.rows.begin(), nbrs.rows.end(), out[0].data<int32_t>());
    std::transform(nbrs.dist2.begin(), nbrs.dist2.end(), out[1].data<float>(),
                   [](double d) { return static_cast<float>(d); });
  });
}

}  // namespace mlx_lattice
