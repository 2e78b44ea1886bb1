// A small persistent thread pool for the CPU kernels.
//
// Work is split into tasks whose results never depend on which thread runs
// them (each task owns its output rows and reduces in a fixed order), so the
// number of threads changes speed, never bits.
#pragma once

#include <cstdint>
#include <functional>

namespace mlx_lattice {

// Threads the kernels use. Defaults to MLX_LATTICE_NUM_THREADS when set to a
// positive integer, else to the hardware concurrency.
int get_num_threads();

// Sets the thread count (>= 1). Raises std::invalid_argument otherwise.
void set_num_threads(int n);

// A decimal integer in [0, max] spelled with digits only (no sign, space or
// suffix), as the kernels' environment variables spell their numbers: sets
// `value` and returns true; false otherwise.
bool decimal_from_text(const char* text, long long max, long long& value);

// The thread count `text` names (MLX_LATTICE_NUM_THREADS's spelling: a
// decimal integer in [1, 1024], nothing else); false otherwise.
bool threads_from_text(const char* text, int& n);

// Runs fn(task) for task in [0, n_tasks), spread over the pool; the calling
// thread takes part. Tasks are claimed dynamically. Exceptions thrown by fn
// are rethrown (the first one) after all tasks finished.
void parallel_for(int64_t n_tasks, const std::function<void(int64_t)>& fn);

// ceil(a / b) for a >= 0 and b > 0: the task or block count of a items
// split by b.
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Requests every 64-byte line that [p, p + bytes) touches into the cache: a
// row the kernel gathers by index next, loaded behind the current work. (A
// row that starts inside a line, as rows of MLX's buffers do, touches one
// line more than bytes / 64.)
inline void prefetch_lines(const void* p, int64_t bytes) {
  if (bytes <= 0) return;
  const auto start = reinterpret_cast<uintptr_t>(p);
  const uintptr_t end = start + static_cast<uintptr_t>(bytes);
  for (uintptr_t line = start & ~uintptr_t{63}; line < end; line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(line));
  }
}

// This thread's instance of a thread_local scratch object, as a reference
// computed once. In a shared library each thread_local address is a call
// (__tls_get_addr), and GCC 12 repeats that call at each use inside a loop
// instead of keeping the address in a register; the empty asm hides where
// the pointer came from, so the loop uses the register. Bind the result
// once at the top of a worker: `auto& s = this_thread(scratch);`.
template <typename T>
inline T& this_thread(T& tls) {
  T* p = &tls;
#if defined(__GNUC__)
  asm("" : "+r"(p));
#endif
  return *p;
}

}  // namespace mlx_lattice
