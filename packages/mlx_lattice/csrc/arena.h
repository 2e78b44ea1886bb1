// An activation arena: output buffers of the extension's CPU evaluations,
// allocated once and handed out again, call after call, instead of fresh
// memory on every evaluation (MLX's CPU allocator keeps no large buffers,
// so every large output is a fresh mapping, zero-filled and page-faulted).
//
// A compiled inference graph (mlx_lattice.compile) owns one and activates it
// on its thread while it evaluates its forward; cpu/eval.h's
// allocate_on_line then takes every large output buffer from it
// (output_data). Buffers are pooled by size (size_class: the request
// rounded up to whole pages), and a request takes an idle buffer of its
// size or at most kReuseSlack above it, so the outputs of a recurring
// coordinate set find the buffers an earlier forward left, across layers
// and calls. Not more than that: MLX copies an array whose buffer is more
// than 16 KiB larger than the array (mx.contiguous, which the ops apply to
// their inputs, and the donations of its elementwise ops), so a loose fit
// (an arena that once served requests up to 1/4 below a buffer's size)
// made every convolution's output be copied again, single-threaded, on
// MLX's stream.
//
// trim() ends a pass (the graph calls it after each forward): the idle
// buffers of every size no request of that pass asked for are freed, so a
// stream of scans of other sizes (the next frame of a LiDAR stream) keeps
// at most the buffers of the pass before next to its own, not a pool of
// stale sizes up to the bound. By size, not by buffer: which buffer of a
// size a request gets depends on which came back first, which varies
// from forward to forward.
//
// Ownership: a buffer the arena hands out is wrapped in an
// mlx::core::allocator::Data whose deleter gives it back. Only that deleter
// returns a buffer, so the arena never holds one an array still references;
// the deleter runs on whichever thread drops the last reference (the
// stream's worker or Python's), under the arena's mutex. Arrays that outlive
// the arena's owner keep the arena's state alive through their deleters;
// once closed, returned buffers are freed at once.
//
// Bound: the arena owns at most max_bytes (lent and idle together). A
// request that does not fit evicts idle buffers, least recently returned
// first; if it still does not fit it is served by MLX's allocator as usual
// (counted as bypassed), so the bound never fails an evaluation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <map>
#include <vector>

#include "mlx/allocator.h"

namespace mlx_lattice {

namespace allocator = mlx::core::allocator;

struct ArenaStats {
  size_t buffers = 0;       // buffers the arena owns (lent and idle)
  size_t bytes = 0;         // their bytes (at most max_bytes)
  size_t idle_buffers = 0;  // owned and not lent: ready for the next request
  size_t idle_bytes = 0;
  uint64_t hits = 0;      // requests served by an idle buffer (of their class or up to 1/4 above)
  uint64_t fresh = 0;     // requests served by a fresh buffer the arena then kept
  uint64_t bypassed = 0;  // requests over the bound, served by MLX's allocator
  uint64_t evicted = 0;   // idle buffers freed to make room
  uint64_t trimmed = 0;   // idle buffers freed by trim(): no request of a pass asked for their size
  size_t max_bytes = 0;
};

// The bytes of the buffer a request of `bytes` gets when fresh: rounded up
// to a multiple of kPageBytes.
constexpr size_t kPageBytes = 4096;
size_t size_class(size_t bytes);

// How far above a request's class an idle buffer may be and still serve it
// (with the page rounding, a buffer is then at most 12 KiB larger than the
// array it holds: under MLX's 16 KiB).
constexpr size_t kReuseSlack = 8192;

class ActivationArena : public std::enable_shared_from_this<ActivationArena> {
 public:
  explicit ActivationArena(size_t max_bytes) : max_bytes_(max_bytes) {}
  ~ActivationArena();
  ActivationArena(const ActivationArena&) = delete;
  ActivationArena& operator=(const ActivationArena&) = delete;

  // A buffer of `bytes` bytes, owned by the returned Data: pooled when the
  // arena can keep it, MLX's allocator's otherwise (or once closed).
  allocator::Data take(size_t bytes);

  // Frees the idle buffers; buffers still lent are freed when returned.
  void close();

  // Ends a pass: frees the idle buffers of the sizes no request asked for
  // since the previous trim (buffers lent now are kept).
  void trim();

  ArenaStats stats() const;

 private:
  struct Idle {
    allocator::Buffer buffer;
    uint64_t returned;  // give_back's clock when it came back
  };

  // `buffer` (owned) in a Data whose deleter gives it back.
  allocator::Data lend(allocator::Buffer buffer, size_t bytes);
  void give_back(allocator::Buffer buffer, size_t bytes) noexcept;
  // Moves least recently returned idle buffers into `out` until `bytes`
  // more fit under the bound or none is idle (caller holds mutex_).
  void evict_for(size_t bytes, std::vector<allocator::Buffer>& out);

  mutable std::mutex mutex_;
  const size_t max_bytes_;
  bool closed_ = false;
  std::map<size_t, std::vector<Idle>> idle_;  // by size class, each in return order
  uint64_t clock_ = 0;
  uint64_t pass_ = 0;  // trim() calls so far
  // size -> the last pass a request asked for it (trim() forgets the older).
  std::map<size_t, uint64_t> asked_;
  ArenaStats stats_;
};

// The arena the calling thread's evaluations allocate from: the innermost
// active one, or none. MLX calls eval_cpu on the thread that evaluates (the
// CPU stream's worker runs only the dispatched kernel bodies), so the
// activation is per thread: another thread's evaluations are unaffected.
std::shared_ptr<ActivationArena> active_arena();
void push_active_arena(std::shared_ptr<ActivationArena> arena);
// Pops the innermost active arena; false (nothing popped) unless it is `arena`.
bool pop_active_arena(const ActivationArena* arena);

// An output buffer of `bytes` bytes: from the thread's active arena, or
// MLX's allocator when none is active.
allocator::Data output_data(size_t bytes);

}  // namespace mlx_lattice
