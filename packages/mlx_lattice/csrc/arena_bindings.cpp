// Python binding of the activation arena (arena.h): ext.ActivationArena, a
// context manager that activates the arena on the calling thread.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <string>

#include "arena.h"
#include "cpu/input_error.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlx_lattice {

namespace {

// The Python object's handle: closing the arena when the object goes away
// frees its idle buffers at once (arrays still holding buffers keep the
// arena's state until they return them).
struct ArenaHandle {
  explicit ArenaHandle(size_t max_bytes) : arena(std::make_shared<ActivationArena>(max_bytes)) {}
  ~ArenaHandle() { arena->close(); }
  ArenaHandle(const ArenaHandle&) = delete;
  ArenaHandle& operator=(const ArenaHandle&) = delete;
  std::shared_ptr<ActivationArena> arena;
};

nb::dict stats_dict(const ArenaStats& s) {
  nb::dict d;
  d["buffers"] = s.buffers;
  d["bytes"] = s.bytes;
  d["idle_buffers"] = s.idle_buffers;
  d["idle_bytes"] = s.idle_bytes;
  d["hits"] = s.hits;
  d["fresh"] = s.fresh;
  d["bypassed"] = s.bypassed;
  d["evicted"] = s.evicted;
  d["trimmed"] = s.trimmed;
  d["max_bytes"] = s.max_bytes;
  return d;
}

}  // namespace

void bind_arena(nb::module_& m) {
  nb::class_<ArenaHandle>(m, "ActivationArena",
                          "Output buffers of the extension's CPU evaluations, reused across "
                          "calls (arena.h); ``with arena:`` activates it on this thread.")
      .def(
          "__init__",
          [](ArenaHandle* self, int64_t max_bytes) {
            if (max_bytes < 0) {
              throw InputError("ActivationArena: max_bytes must be >= 0, got " +
                               std::to_string(max_bytes) + ".");
            }
            new (self) ArenaHandle(static_cast<size_t>(max_bytes));
          },
          "max_bytes"_a)
      .def(
          "__enter__",
          [](ArenaHandle& self) -> ArenaHandle& {
            push_active_arena(self.arena);
            return self;
          },
          nb::rv_policy::reference)
      .def(
          "__exit__",
          [](ArenaHandle& self, nb::handle, nb::handle, nb::handle) {
            if (!pop_active_arena(self.arena.get())) {
              throw InputError(
                  "ActivationArena: exited on a thread where it is not the innermost active "
                  "arena.");
            }
          },
          "exc_type"_a.none(), "exc"_a.none(), "tb"_a.none())
      .def(
          "stats", [](const ArenaHandle& self) { return stats_dict(self.arena->stats()); },
          "Counters: buffers and bytes owned (lent and idle), idle_buffers, idle_bytes, hits, "
          "fresh, bypassed (over max_bytes: MLX's allocator), evicted, trimmed, max_bytes.")
      .def(
          "trim", [](ArenaHandle& self) { self.arena->trim(); },
          "End a pass: free the idle buffers of the sizes no request asked for since the "
          "previous trim.")
      .def(
          "close", [](ArenaHandle& self) { self.arena->close(); },
          "Free the idle buffers; buffers still lent are freed when returned, and later "
          "requests go to MLX's allocator.");
}

}  // namespace mlx_lattice
