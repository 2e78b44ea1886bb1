#include "weight_cache.h"

#include "cpu/parallel.h"

#include <cstdlib>
#include <list>
#include <mutex>
#include <string>
#include <utility>

namespace mlx_lattice {

namespace {

struct Entry {
  std::vector<WeightSources::Key> keys;
  std::vector<int64_t> spec;
  std::vector<std::shared_ptr<const void>> held;  // the sources' buffers
  std::shared_ptr<const void> weight;
  size_t bytes = 0;
};

size_t budget_from_env() {
  size_t bytes = kWeightCacheDefaultBytes;
  weight_cache_bytes_from_text(std::getenv("MLX_LATTICE_WEIGHT_CACHE_MB"), bytes);
  return bytes;
}

// A key seen once, with weak references to its buffers: a note whose buffer
// was freed is stale (malloc may hand the address to the next copy).
struct Note {
  std::vector<WeightSources::Key> keys;
  std::vector<int64_t> spec;
  std::vector<std::weak_ptr<const void>> alive;

  bool live() const {
    for (const auto& w : alive) {
      if (w.expired()) return false;
    }
    return true;
  }
};

// Mutable global state: the point of the cache is to outlive one call.
struct Cache {
  std::mutex mutex;
  std::list<Entry> entries;  // most recently used first
  std::list<Note> notes;     // keys seen once, most recent first
  size_t bytes = 0;
  size_t budget = budget_from_env();
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;

  // Drops least recently used entries until `bytes` fits the budget and
  // there are at most kWeightCacheEntries. The caller holds the mutex; a
  // dropped weight still in use by a running call lives on in that call's
  // shared_ptr.
  void trim() {
    while ((bytes > budget || entries.size() > kWeightCacheEntries) && !entries.empty()) {
      bytes -= entries.back().bytes;
      entries.pop_back();
      ++evictions;
    }
  }
};

Cache& cache() {
  static Cache* instance = new Cache();  // never destroyed: arrays may outlive MLX statics
  return *instance;
}

}  // namespace

WeightSources weight_sources(const std::vector<mx::array>& arrays) {
  WeightSources s;
  s.cacheable = !arrays.empty();
  for (const auto& a : arrays) {
    s.cacheable = s.cacheable && a.data_shared_ptr() != nullptr;
    s.keys.push_back({a.data_shared_ptr().get(), a.offset(), a.shape(), a.strides(), a.dtype()});
    s.held.push_back(a.data_shared_ptr());
    s.bytes += a.nbytes();
  }
  return s;
}

std::shared_ptr<const void> cached_weight(const WeightSources& sources,
                                          const std::vector<int64_t>& spec,
                                          const std::function<CachedWeight()>& make) {
  if (!sources.cacheable) return make().first;
  auto& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    for (auto it = c.entries.begin(); it != c.entries.end(); ++it) {
      if (it->spec == spec && it->keys == sources.keys) {
        c.entries.splice(c.entries.begin(), c.entries, it);
        ++c.hits;
        return it->weight;
      }
    }
    ++c.misses;
  }
  auto [weight, own_bytes] = make();
  const size_t bytes = own_bytes + sources.bytes;
  std::lock_guard<std::mutex> lock(c.mutex);
  if (bytes > c.budget) return weight;  // too large (or caching off): this call only
  // First sighting (or a note whose buffers have died since): note the key
  // with weak references only and keep this call's copy.
  auto noted = c.notes.begin();
  while (noted != c.notes.end() && !(noted->spec == spec && noted->keys == sources.keys)) ++noted;
  if (noted == c.notes.end() || !noted->live()) {
    if (noted != c.notes.end()) c.notes.erase(noted);
    c.notes.push_front({sources.keys, spec, {sources.held.begin(), sources.held.end()}});
    if (c.notes.size() > kWeightCacheNotes) c.notes.pop_back();
    return weight;
  }
  c.notes.erase(noted);
  for (const auto& e : c.entries) {
    // Filled meanwhile by another thread: keep one copy.
    if (e.spec == spec && e.keys == sources.keys) return e.weight;
  }
  c.entries.push_front({sources.keys, spec, sources.held, weight, bytes});
  c.bytes += bytes;
  c.trim();
  return weight;
}

std::shared_ptr<const kernels::LineVector<float>> cached_dequantized_weight(
    const WeightSources& sources, const std::vector<int64_t>& spec, size_t floats,
    const std::function<void(float*)>& fill) {
  std::vector<int64_t> key{0};  // kind 0: a dequantized float32 weight
  key.insert(key.end(), spec.begin(), spec.end());
  return std::static_pointer_cast<const kernels::LineVector<float>>(
      cached_weight(sources, key, [&] {
        auto weight = std::make_shared<kernels::LineVector<float>>(floats);
        fill(weight->data());
        return CachedWeight{weight, floats * sizeof(float)};
      }));
}

WeightCacheInfo weight_cache_info() {
  auto& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return {c.entries.size(), c.bytes, c.budget, c.hits, c.misses, c.evictions};
}

void clear_weight_cache() {
  auto& c = cache();
  std::list<Entry> dropped;  // released after the lock
  std::lock_guard<std::mutex> lock(c.mutex);
  dropped.swap(c.entries);
  c.notes.clear();
  c.bytes = 0;
  c.hits = c.misses = c.evictions = 0;
}

void set_weight_cache_budget(size_t bytes) {
  auto& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.budget = bytes;
  c.trim();
}

bool weight_cache_bytes_from_text(const char* text, size_t& bytes) {
  long long mb = 0;
  if (!decimal_from_text(text, (1LL << 40), mb)) return false;
  bytes = static_cast<size_t>(mb) << 20;
  return true;
}

}  // namespace mlx_lattice
