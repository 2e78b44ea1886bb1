// Shared helpers of the extension: dtype dispatch and error messages.
#pragma once

#include <sstream>
#include "cpu/input_error.h"
#include <stdexcept>
#include <string>

#include "mlx/mlx.h"

namespace mlx_lattice {

namespace mx = mlx::core;

inline std::string shape_str(const mx::Shape& shape) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    out << (i ? ", " : "") << shape[i];
  }
  out << (shape.size() == 1 ? ",)" : ")");
  return out.str();
}

inline std::string dtype_str(mx::Dtype dtype) {
  std::ostringstream out;
  out << dtype;
  return out.str();
}

// A number as the error messages print it.
inline std::string num_str(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

// `a` row-contiguous in `dtype` (cast only where it differs).
inline mx::array as_rows(const mx::array& a, mx::Dtype dtype, mx::Stream s) {
  return mx::contiguous(a.dtype() == dtype ? a : mx::astype(a, dtype, s), false, s);
}

inline void check_float_dtype(const char* op, const char* arg, const mx::array& a) {
  if (a.dtype() != mx::float32 && a.dtype() != mx::float16 && a.dtype() != mx::bfloat16) {
    throw ::mlx_lattice::InputError(std::string(op) + ": " + arg +
                                " must be float32, float16 or bfloat16, got " +
                                dtype_str(a.dtype()) + ".");
  }
}

// Calls f.template operator()<T>() with T the C++ type of a floating dtype.
template <typename F>
void dispatch_float(mx::Dtype dtype, F&& f) {
  if (dtype == mx::float32) {
    f.template operator()<float>();
  } else if (dtype == mx::float16) {
    f.template operator()<mx::float16_t>();
  } else if (dtype == mx::bfloat16) {
    f.template operator()<mx::bfloat16_t>();
  } else {
    throw ::mlx_lattice::InputError("unsupported dtype " + dtype_str(dtype));
  }
}

[[noreturn]] inline void throw_no_gpu(const char* primitive) {
  throw std::runtime_error(std::string(primitive) +
                           ": mlx_lattice was built without Metal kernels; "
                           "run it on the CPU stream (mx.cpu).");
}

}  // namespace mlx_lattice
