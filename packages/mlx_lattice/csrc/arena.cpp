// The activation arena (arena.h): a pool of MLX buffers by byte size.
#include "arena.h"

#include <new>
#include <utility>

namespace mlx_lattice {

namespace {

void free_all(std::vector<allocator::Buffer>& buffers) {
  for (auto& b : buffers) allocator::allocator().free(b);
  buffers.clear();
}

// The thread's active arenas, innermost last.
std::vector<std::shared_ptr<ActivationArena>>& active_stack() {
  thread_local std::vector<std::shared_ptr<ActivationArena>> stack;
  return stack;
}

}  // namespace

size_t size_class(size_t bytes) {
  return bytes > ~size_t{0} - kPageBytes ? bytes : (bytes + kPageBytes - 1) / kPageBytes * kPageBytes;
}

ActivationArena::~ActivationArena() {
  // Every deleter holds a reference to this arena, so none is lent now.
  for (auto& [bytes, list] : idle_) {
    for (auto& idle : list) allocator::allocator().free(idle.buffer);
  }
}

void ActivationArena::evict_for(size_t bytes, std::vector<allocator::Buffer>& out) {
  while (stats_.bytes + bytes > max_bytes_ && stats_.idle_buffers > 0) {
    // The least recently returned idle buffer of any size (the lists are in
    // return order, so each list's front is its oldest).
    auto oldest = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if (!it->second.empty() &&
          (oldest == idle_.end() || it->second.front().returned < oldest->second.front().returned)) {
        oldest = it;
      }
    }
    const size_t size = oldest->first;
    out.push_back(oldest->second.front().buffer);
    oldest->second.erase(oldest->second.begin());
    if (oldest->second.empty()) idle_.erase(oldest);
    stats_.bytes -= size;
    stats_.idle_bytes -= size;
    --stats_.buffers;
    --stats_.idle_buffers;
    ++stats_.evicted;
  }
}

allocator::Data ActivationArena::lend(allocator::Buffer buffer, size_t bytes) {
  try {
    return allocator::Data(buffer, [self = shared_from_this(), bytes](allocator::Buffer b) {
      self->give_back(b, bytes);
    });
  } catch (...) {
    give_back(buffer, bytes);  // no Data owns it: it is idle again
    throw;
  }
}

allocator::Data ActivationArena::take(size_t request) {
  const size_t bytes = size_class(request);
  std::vector<allocator::Buffer> evicted;
  bool keep = false;
  allocator::Buffer buffer{nullptr};
  size_t size = bytes;  // the buffer's bytes
  {
    std::lock_guard lock(mutex_);
    if (closed_) return allocator::malloc(request);
    asked_[bytes] = pass_;
    // The smallest idle buffer of the class or at most kReuseSlack above it.
    auto it = idle_.lower_bound(bytes);
    if (it != idle_.end() && it->first - bytes <= kReuseSlack) {
      // Its most recently returned buffer: the likeliest in cache.
      size = it->first;
      asked_[size] = pass_;
      buffer = it->second.back().buffer;
      it->second.pop_back();
      if (it->second.empty()) idle_.erase(it);
      stats_.idle_bytes -= size;
      --stats_.idle_buffers;
      ++stats_.hits;
    } else {
      // Kept if it fits beside the lent buffers, after evicting idle ones
      // (none is evicted for a request that would not fit anyway).
      keep = bytes <= max_bytes_ && stats_.bytes - stats_.idle_bytes <= max_bytes_ - bytes;
      if (keep) {
        evict_for(bytes, evicted);
        // Counted before the allocation (made outside the lock), undone if it fails.
        stats_.bytes += bytes;
        ++stats_.buffers;
        ++stats_.fresh;
      } else {
        ++stats_.bypassed;
      }
    }
  }
  free_all(evicted);
  if (buffer.ptr() != nullptr) return lend(buffer, size);  // a hit
  if (!keep) return allocator::malloc(request);
  try {
    buffer = allocator::allocator().malloc(bytes);
    if (buffer.ptr() == nullptr) throw std::bad_alloc();
  } catch (...) {
    std::lock_guard lock(mutex_);
    stats_.bytes -= bytes;
    --stats_.buffers;
    --stats_.fresh;
    throw;
  }
  return lend(buffer, bytes);
}

void ActivationArena::give_back(allocator::Buffer buffer, size_t bytes) noexcept {
  {
    std::lock_guard lock(mutex_);
    if (!closed_) {
      try {
        idle_[bytes].push_back({buffer, ++clock_});
        stats_.idle_bytes += bytes;
        ++stats_.idle_buffers;
        return;
      } catch (...) {
        // No memory for the list entry: the buffer is freed instead.
      }
    }
    stats_.bytes -= bytes;
    --stats_.buffers;
  }
  allocator::allocator().free(buffer);
}

void ActivationArena::close() {
  std::vector<allocator::Buffer> idle;
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
    for (auto& [bytes, list] : idle_) {
      for (auto& entry : list) idle.push_back(entry.buffer);
    }
    idle_.clear();
    stats_.bytes -= stats_.idle_bytes;
    stats_.buffers -= stats_.idle_buffers;
    stats_.idle_bytes = 0;
    stats_.idle_buffers = 0;
  }
  free_all(idle);
}

void ActivationArena::trim() {
  std::vector<allocator::Buffer> stale;
  {
    std::lock_guard lock(mutex_);
    for (auto it = idle_.begin(); it != idle_.end();) {
      const auto asked = asked_.find(it->first);
      if (asked != asked_.end() && asked->second == pass_) {
        ++it;
        continue;
      }
      const size_t freed = it->second.size();
      for (auto& entry : it->second) stale.push_back(entry.buffer);
      stats_.bytes -= freed * it->first;
      stats_.idle_bytes -= freed * it->first;
      stats_.buffers -= freed;
      stats_.idle_buffers -= freed;
      stats_.trimmed += freed;
      it = idle_.erase(it);
    }
    std::erase_if(asked_, [this](const auto& entry) { return entry.second < pass_; });
    ++pass_;
  }
  free_all(stale);
}

ArenaStats ActivationArena::stats() const {
  std::lock_guard lock(mutex_);
  ArenaStats s = stats_;
  s.max_bytes = max_bytes_;
  return s;
}

std::shared_ptr<ActivationArena> active_arena() {
  auto& stack = active_stack();
  return stack.empty() ? nullptr : stack.back();
}

void push_active_arena(std::shared_ptr<ActivationArena> arena) {
  active_stack().push_back(std::move(arena));
}

bool pop_active_arena(const ActivationArena* arena) {
  auto& stack = active_stack();
  if (stack.empty() || stack.back().get() != arena) return false;
  stack.pop_back();
  return true;
}

allocator::Data output_data(size_t bytes) {
  auto& stack = active_stack();
  return stack.empty() ? allocator::malloc(bytes) : stack.back()->take(bytes);
}

}  // namespace mlx_lattice
