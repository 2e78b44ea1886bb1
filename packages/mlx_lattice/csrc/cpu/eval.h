// Shared plumbing of the CPU evaluations (cpu/<op>.cpp): output allocation,
// the stream's CPU encoder, and float32 views of half-precision operands.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "../arena.h"
#include "float_formats.h"
#include "line_vector.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"

namespace mlx_lattice::cpu {

namespace mx = mlx::core;

inline kernels::FloatFormat format_of(mx::Dtype dtype) {
  if (dtype == mx::float16) return kernels::FloatFormat::kF16;
  if (dtype == mx::bfloat16) return kernels::FloatFormat::kBF16;
  return kernels::FloatFormat::kF32;
}

inline const int32_t* idx(const mx::array& a) { return a.size() ? a.data<int32_t>() : nullptr; }

// Float32 staging buffers of half-precision operands, kept per evaluating
// thread: fresh multi-megabyte allocations per call cost more in page faults
// than the conversions themselves. Slot 0, 1: inputs; slot 2: the output.
inline float* staging(int slot, size_t n) {
  thread_local kernels::LineVector<float> buffers[3];
  auto& b = buffers[slot];
  if (b.size() < n) b.resize(n);
  return b.data();
}

// A float32 view of a floating array: its own data, or a converted copy.
class FloatIn {
 public:
  FloatIn(const mx::array& a, int slot) {
    if (a.dtype() == mx::float32 || a.size() == 0) {
      ptr_ = a.size() ? a.data<float>() : nullptr;
    } else {
      float* buf = staging(slot, a.size());
      kernels::to_float32(a.data<void>(), format_of(a.dtype()), a.size(), buf);
      ptr_ = buf;
    }
  }
  const float* get() const { return ptr_; }

 private:
  const float* ptr_ = nullptr;
};

// A float32 buffer for an output, written back in the output's dtype.
class FloatOut {
 public:
  explicit FloatOut(mx::array& out) : out_(out) {
    if (out.dtype() != mx::float32) {
      ptr_ = staging(2, out.size());
    } else {
      ptr_ = out.size() ? out.data<float>() : nullptr;
    }
  }
  float* get() { return ptr_; }
  void finish() {
    if (out_.dtype() != mx::float32 && out_.size()) {
      kernels::from_float32(ptr_, out_.size(), format_of(out_.dtype()), out_.data<void>());
    }
  }

 private:
  mx::array& out_;
  float* ptr_ = nullptr;
};

// Allocates `out` with its first element on a cache line (line_vector.h):
// MLX's CPU allocator returns buffers 8 bytes into a line, so the kernels'
// 64-byte stores into an output would each span two lines. The buffer is a
// line longer and the array starts at an offset into it, as a slice does.
// It comes from the thread's active activation arena if one is active
// (arena.h: a compiled graph's forward), from MLX's allocator otherwise.
inline void allocate_on_line(mx::array& out) {
  const size_t bytes = out.nbytes();
  constexpr size_t kMinBytes = 4096;  // below a page, left as MLX places it
  if (bytes < kMinBytes) {
    out.set_data(mx::allocator::malloc(bytes));
    return;
  }
  auto data = output_data(bytes + kernels::kLineBytes);
  const auto address = reinterpret_cast<uintptr_t>(data.buffer().raw_ptr());
  const auto offset =
      static_cast<int64_t>((kernels::kLineBytes - address % kernels::kLineBytes) %
                           kernels::kLineBytes);
  mx::array::Flags flags{};
  flags.contiguous = true;
  flags.row_contiguous = true;
  int64_t largest = 0;
  for (const auto d : out.shape()) largest = std::max<int64_t>(largest, d);
  flags.col_contiguous = out.size() <= 1 || static_cast<int64_t>(out.size()) == largest;
  out.set_data(std::move(data), out.size(), out.strides(), flags, offset);
}

// Allocates `out` and runs body(inputs, out) on the stream's CPU encoder,
// with weak copies of the arrays (the encoder keeps the originals alive).
template <typename Body>
void dispatch(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out, Body body) {
  allocate_on_line(out);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  std::vector<mx::array> in;
  for (auto& a : inputs) {
    encoder.set_input_array(a);
    in.push_back(mx::array::unsafe_weak_copy(a));
  }
  encoder.set_output_array(out);
  encoder.dispatch([in = std::move(in), o = mx::array::unsafe_weak_copy(out), body]() mutable {
    body(in, o);
  });
}

// The same for primitives with several outputs: body(inputs, outputs).
template <typename Body>
void dispatch(mx::Stream stream, const std::vector<mx::array>& inputs,
              std::vector<mx::array>& outputs, Body body) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  std::vector<mx::array> in, out;
  for (auto& a : inputs) {
    encoder.set_input_array(a);
    in.push_back(mx::array::unsafe_weak_copy(a));
  }
  for (auto& o : outputs) {
    allocate_on_line(o);
    encoder.set_output_array(o);
    out.push_back(mx::array::unsafe_weak_copy(o));
  }
  encoder.dispatch([in = std::move(in), out = std::move(out), body]() mutable { body(in, out); });
}

}  // namespace mlx_lattice::cpu
