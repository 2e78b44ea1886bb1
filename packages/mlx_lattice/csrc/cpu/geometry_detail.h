// Helpers shared by the geometry kernels (cpu/geometry_*.cpp); internal.
#pragma once

#include <cmath>
#include "input_error.h"
#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

namespace mlx_lattice::geometry::detail {

[[noreturn]] inline void fail(const std::string& message) { throw ::mlx_lattice::InputError(message); }

inline bool same_row(const int32_t* a, const int32_t* b) { return std::memcmp(a, b, 16) == 0; }

inline void check_batch(const int32_t* batch, int64_t n, const char* name) {
  for (int64_t i = 0; i < n; ++i) {
    if (batch[i] < 0) {
      std::ostringstream msg;
      msg << name << "[" << i << "] = " << batch[i] << " is negative.";
      fail(msg.str());
    }
  }
}

inline void check_finite(const double* points, int64_t n, const char* name) {
  for (int64_t i = 0; i < 3 * n; ++i) {
    if (!std::isfinite(points[i])) {
      std::ostringstream msg;
      msg << name << " must be finite; row " << i / 3 << " has " << points[i] << ".";
      fail(msg.str());
    }
  }
}

}  // namespace mlx_lattice::geometry::detail
