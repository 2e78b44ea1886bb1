// Internal interface between msl_shim.h (device side) and msl_runtime.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include "msl_runtime.h"

namespace msl::detail {

constexpr uint32_t kSimdWidth = 32;
// Bytes per lane in a simdgroup's exchange area (collectives, 8x8 MMA).
constexpr size_t kExchangeBytes = 64;

struct LaneInfo {
  Dim3 thread_in_group;
  Dim3 group;
  Dim3 position_in_grid;
  Dim3 group_size;
  Dim3 groups;
  uint32_t index_in_group = 0;
  uint32_t simd_lane = 0;
  uint32_t simd_group = 0;
  uint32_t simd_size = 0;  // lanes in this simdgroup (the last may be partial)
};

const LaneInfo& lane();
void* buffer(int index);
void* threadgroup_buffer(int index);
// Threadgroup-scope variable declared in a kernel body (keyed by its site).
void* threadgroup_var(int site, size_t bytes, size_t align);
// This lane's slot and the simdgroup's exchange area (kSimdWidth slots).
unsigned char* exchange_area();

enum class Scope { kThreadgroup, kSimdgroup };
// Blocks until every lane of the scope arrives at the same site.
void barrier(Scope scope, const char* file, int line);

// After an atomic operation: with fibers the lane yields to the scheduler
// (lanes interleave at atomics); with threads nothing happens.
void atomic_point();
// With fibers, true on every third compare-exchange of a lane (a spurious
// failure of the weak form); never with threads.
bool spurious_failure();

}  // namespace msl::detail
