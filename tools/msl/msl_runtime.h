// A CPU runtime for Metal Shading Language kernels: runs the *same* MSL
// kernel bodies on Linux so that their logic is tested where no Apple GPU
// exists. Kernels are preprocessed by msl2cpp.py into C++ that includes
// msl_shim.h; this header is the host side (dispatch, schedules, errors).
//
// Threads of a threadgroup run as fibers on one OS thread, switching only at
// barriers and SIMD collectives, under a chosen interleaving; a barrier that
// only some threads reach, or threads waiting at different barriers, raises
// HarnessError (MSL leaves both undefined). A thread-per-lane mode runs each
// lane on its own OS thread for ThreadSanitizer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace msl {

struct Dim3 {
  uint32_t x = 1, y = 1, z = 1;
  uint32_t count() const { return x * y * z; }
};

enum class Schedule {
  kForward,         // lanes in order, each until it blocks
  kReverse,         // lanes in reverse order
  kSimdgroupFirst,  // the last simdgroup runs as far as it can before the others
};

enum class Mode { kFibers, kThreads };

class HarnessError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Launch {
  Dim3 groups;      // threadgroups per grid
  Dim3 group_size;  // threads per threadgroup
  std::vector<void*> buffers;                  // [[buffer(i)]]
  std::vector<size_t> threadgroup_bytes;       // [[threadgroup(i)]] lengths
  Schedule schedule = Schedule::kForward;
  Mode mode = Mode::kFibers;
};

using Launcher = void (*)();

// Registers a preprocessed kernel under its MSL name (done by msl2cpp.py).
struct Registration {
  Registration(const char* name, Launcher launcher);
};

// Runs kernel `name` over the launch. Throws HarnessError on a barrier
// misuse, an unknown kernel or a bad launch.
void dispatch(const std::string& name, const Launch& launch);

// Threadgroups run so far by this process (for tests and diagnostics).
uint64_t dispatched_groups();

// Names of the registered kernels.
std::vector<std::string> kernel_names();

}  // namespace msl
