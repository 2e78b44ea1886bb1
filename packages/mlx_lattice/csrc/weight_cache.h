// The dequantized-weight cache of the weight-only quantized convolution: the
// float32 (K, cin, cout) weight of a quantized weight object is computed
// once and reused by later calls, instead of dequantized on every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "cpu/line_vector.h"

#include "common.h"

namespace mlx_lattice {

// Default byte budget of the cache (MLX_LATTICE_WEIGHT_CACHE_MB overrides it
// when set to a non-negative integer number of MiB; 0 turns caching off).
constexpr size_t kWeightCacheDefaultBytes = size_t{256} << 20;

// Keys of weights seen once (see cached_dequantized_weight).
constexpr size_t kWeightCacheNotes = 64;

// At most this many entries, whatever their bytes (a lookup scans them).
constexpr size_t kWeightCacheEntries = 1024;

// What identifies a quantized weight's arrays (packed codes, scales,
// biases): each one's buffer (its array::Data), offset, shape, strides and
// dtype, and references that keep those buffers alive. Made from the
// primitive's own inputs in eval_cpu, not from the weak copies the CPU
// encoder's task gets (those wrap the buffer in a Data of their own and keep
// nothing alive).
struct WeightSources {
  struct Key {
    const void* data = nullptr;
    int64_t offset = 0;
    mx::Shape shape;
    mx::Strides strides;
    mx::Dtype dtype = mx::float32;
    bool operator==(const Key&) const = default;
  };
  std::vector<Key> keys;
  std::vector<std::shared_ptr<const void>> held;
  size_t bytes = 0;  // the arrays' bytes
  bool cacheable = false;  // every array has its buffer
};

WeightSources weight_sources(const std::vector<mx::array>& arrays);

// The object `make` builds from the arrays of `sources` and the integers
// `spec` (its kind first, then bits, group size, shapes...), with its bytes,
// remembered under their identities.
//
// A weight is cached on its second call while its first call's buffers
// still live: the first call only notes the key with weak references
// (kWeightCacheNotes keys, least recently noted first out), so arrays
// converted anew on every call (a non-contiguous weight is copied by the
// op, a conversion in the caller) never fill the cache, even when the
// allocator hands a freed copy's address to the next one.
// An entry is keyed on `sources` and `spec` and holds the sources'
// references: a buffer cannot be freed (so its address cannot be reused for
// another weight) while its entry lives, and an array whose buffer is
// referenced twice is never donated to an op's output, so the values under
// a live entry never change (MLX arrays are immutable). An entry is charged
// the object's bytes plus the sources' bytes; least recently used entries
// are dropped to stay within the budget and kWeightCacheEntries, and a
// weight larger than the budget is built for its call only. Thread-safe;
// `make` runs outside the lock.
using CachedWeight = std::pair<std::shared_ptr<const void>, size_t>;  // object, bytes
std::shared_ptr<const void> cached_weight(const WeightSources& sources,
                                          const std::vector<int64_t>& spec,
                                          const std::function<CachedWeight()>& make);

// The float32 weight of `floats` values computed by `fill` (the
// weight-only convolution's dequantized weight), cached as above.
std::shared_ptr<const kernels::LineVector<float>> cached_dequantized_weight(
    const WeightSources& sources, const std::vector<int64_t>& spec, size_t floats,
    const std::function<void(float*)>& fill);

struct WeightCacheInfo {
  size_t entries = 0;
  size_t bytes = 0;   // charged to the budget: dequantized plus held sources
  size_t budget = 0;  // bytes
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;
};

WeightCacheInfo weight_cache_info();

// Drops every entry (and with it the references to the sources' buffers)
// and the noted keys, and zeroes the counters.
void clear_weight_cache();

// Sets the byte budget (0 turns caching off), dropping entries beyond it.
void set_weight_cache_budget(size_t bytes);

// MLX_LATTICE_WEIGHT_CACHE_MB's value: a decimal integer of MiB in
// [0, 2^40], nothing else, sets `bytes` and returns true; false otherwise.
bool weight_cache_bytes_from_text(const char* text, size_t& bytes);

}  // namespace mlx_lattice
