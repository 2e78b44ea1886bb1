#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "msl_detail.h"
#include "msl_runtime.h"

namespace msl {

namespace {

std::map<std::string, Launcher>& registry() {
  static auto* kernels = new std::map<std::string, Launcher>();
  return *kernels;
}

}  // namespace

Registration::Registration(const char* name, Launcher launcher) { registry()[name] = launcher; }

namespace {
std::atomic<uint64_t> groups_run{0};
}  // namespace

uint64_t dispatched_groups() { return groups_run.load(); }

std::vector<std::string> kernel_names() {
  std::vector<std::string> names;
  for (const auto& [name, _] : registry()) names.push_back(name);
  return names;
}

namespace detail {

namespace {

constexpr size_t kStackBytes = 128 * 1024;
constexpr auto kThreadTimeout = std::chrono::seconds(20);

enum class State { kRunnable, kWaiting, kDone };

struct Site {
  Scope scope = Scope::kThreadgroup;
  const char* file = "";
  int line = 0;
  bool operator==(const Site& o) const {
    return scope == o.scope && line == o.line && std::string(file) == o.file;
  }
  std::string str() const {
    std::ostringstream out;
    out << (scope == Scope::kThreadgroup ? "threadgroup_barrier" : "simdgroup barrier") << " at "
        << file << ":" << line;
    return out.str();
  }
};

struct Group;

struct Lane {
  LaneInfo info;
  Group* group = nullptr;
  // fibers
  ucontext_t context{};
  char* stack = nullptr;  // owned by the dispatch, reused by every group
  State state = State::kRunnable;
  Site waiting;
  std::exception_ptr error;
  uint32_t compare_exchanges = 0;
};

// A threads-mode barrier with a timeout (a hang becomes an error).
struct TimedBarrier {
  std::mutex m;
  std::condition_variable cv;
  uint32_t expected = 0, arrived = 0;
  uint64_t generation = 0;
  void wait(const Site& site) {
    std::unique_lock<std::mutex> lock(m);
    uint64_t gen = generation;
    if (++arrived == expected) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    if (!cv.wait_for(lock, kThreadTimeout, [&] { return generation != gen; })) {
      throw HarnessError("timed out at " + site.str() +
                         ": not every thread of the scope reached it (divergent barrier?)");
    }
  }
};

struct Group {
  const Launch* launch = nullptr;
  std::vector<Lane> lanes;
  std::map<int, std::unique_ptr<unsigned char[]>> vars;
  std::vector<std::unique_ptr<unsigned char[]>> tg_buffers;
  std::vector<std::unique_ptr<unsigned char[]>> exchange;  // per simdgroup
  std::mutex vars_mutex;                                    // threads mode
  std::unique_ptr<TimedBarrier> group_barrier;
  std::vector<std::unique_ptr<TimedBarrier>> simd_barriers;
  ucontext_t scheduler{};
};

thread_local Lane* current = nullptr;

// Fresh threadgroup memory holds a poison pattern (quiet NaN bytes), so a
// read before any write shows up in results.
void poison(unsigned char* p, size_t n) { std::memset(p, 0xff, n); }

void lane_entry(int high, int low) {
  Launcher launcher = reinterpret_cast<Launcher>(
      (static_cast<uintptr_t>(static_cast<uint32_t>(high)) << 32) | static_cast<uint32_t>(low));
  Lane* self = current;
  try {
    launcher();
  } catch (...) {
    self->error = std::current_exception();
  }
  self->state = State::kDone;
  swapcontext(&self->context, &self->group->scheduler);
}

std::vector<uint32_t> order_of(const Group& g) {
  std::vector<uint32_t> order(g.lanes.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  switch (g.launch->schedule) {
    case Schedule::kForward:
      break;
    case Schedule::kReverse:
      std::reverse(order.begin(), order.end());
      break;
    case Schedule::kSimdgroupFirst: {
      // The last simdgroup first, then the rest in order.
      uint32_t last = g.lanes.back().info.simd_group;
      std::stable_partition(order.begin(), order.end(),
                            [&](uint32_t i) { return g.lanes[i].info.simd_group == last; });
      break;
    }
  }
  return order;
}

// Releases the lanes waiting at a barrier that all lanes of its scope reached.
// Returns false when nothing could be released (a deadlock).
bool release_barriers(Group& g) {
  bool released = false;
  // threadgroup barrier: every lane waiting at one threadgroup site
  const Lane& first = g.lanes.front();
  bool all_group = std::all_of(g.lanes.begin(), g.lanes.end(), [&](const Lane& l) {
    return l.state == State::kWaiting && l.waiting.scope == Scope::kThreadgroup &&
           l.waiting == first.waiting;
  });
  if (all_group) {
    for (auto& l : g.lanes) l.state = State::kRunnable;
    return true;
  }
  // simdgroup barriers, one simdgroup at a time
  std::map<uint32_t, std::vector<Lane*>> simd;
  for (auto& l : g.lanes) simd[l.info.simd_group].push_back(&l);
  for (auto& [sg, lanes] : simd) {
    const Lane* head = lanes.front();
    bool all = std::all_of(lanes.begin(), lanes.end(), [&](const Lane* l) {
      return l->state == State::kWaiting && l->waiting.scope == Scope::kSimdgroup &&
             l->waiting == head->waiting;
    });
    if (all) {
      for (auto* l : lanes) l->state = State::kRunnable;
      released = true;
    }
  }
  return released;
}

[[noreturn]] void report_deadlock(const Group& g) {
  std::map<std::string, int> at;
  int done = 0;
  for (const auto& l : g.lanes) {
    if (l.state == State::kDone) {
      ++done;
    } else {
      ++at[l.waiting.str()];
    }
  }
  std::ostringstream msg;
  msg << "threadgroup (" << g.lanes.front().info.group.x << ", " << g.lanes.front().info.group.y
      << ", " << g.lanes.front().info.group.z << ") cannot proceed: ";
  if (done) msg << done << " thread(s) returned while others wait (barrier in divergent code); ";
  msg << "waiting:";
  for (const auto& [site, n] : at) msg << " " << n << " at " << site << ";";
  throw HarnessError(msg.str());
}

void run_fibers(Group& g, Launcher launcher, std::vector<std::unique_ptr<char[]>>& stacks) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(launcher);
  for (size_t i = 0; i < g.lanes.size(); ++i) {
    auto& l = g.lanes[i];
    if (!stacks[i]) stacks[i].reset(new char[kStackBytes]);  // not zeroed: cheap to make
    l.stack = stacks[i].get();
    getcontext(&l.context);
    l.context.uc_stack.ss_sp = l.stack;
    l.context.uc_stack.ss_size = kStackBytes;
    l.context.uc_link = nullptr;
    makecontext(&l.context, reinterpret_cast<void (*)()>(lane_entry), 2,
                static_cast<int>(bits >> 32), static_cast<int>(bits & 0xffffffffu));
  }
  const auto order = order_of(g);
  for (;;) {
    bool ran = false;
    for (uint32_t i : order) {
      Lane& l = g.lanes[i];
      // Each runnable lane runs until it blocks or returns.
      while (l.state == State::kRunnable) {
        current = &l;
        swapcontext(&g.scheduler, &l.context);
        current = nullptr;
        ran = true;
        if (l.error) std::rethrow_exception(l.error);
        if (g.launch->schedule != Schedule::kSimdgroupFirst) break;
      }
    }
    if (std::all_of(g.lanes.begin(), g.lanes.end(),
                    [](const Lane& l) { return l.state == State::kDone; })) {
      return;
    }
    if (std::any_of(g.lanes.begin(), g.lanes.end(),
                    [](const Lane& l) { return l.state == State::kRunnable; })) {
      continue;
    }
    if (!release_barriers(g) && !ran) report_deadlock(g);
    if (!std::any_of(g.lanes.begin(), g.lanes.end(),
                     [](const Lane& l) { return l.state == State::kRunnable; })) {
      report_deadlock(g);
    }
  }
}

void run_threads(Group& g, Launcher launcher) {
  g.group_barrier = std::make_unique<TimedBarrier>();
  g.group_barrier->expected = static_cast<uint32_t>(g.lanes.size());
  uint32_t simd_groups = g.lanes.back().info.simd_group + 1;
  for (uint32_t s = 0; s < simd_groups; ++s) {
    g.simd_barriers.push_back(std::make_unique<TimedBarrier>());
    g.simd_barriers.back()->expected = 0;
  }
  for (auto& l : g.lanes) ++g.simd_barriers[l.info.simd_group]->expected;
  std::vector<std::thread> threads;
  for (auto& l : g.lanes) {
    threads.emplace_back([&l, launcher] {
      current = &l;
      try {
        launcher();
      } catch (...) {
        l.error = std::current_exception();
      }
      l.state = State::kDone;
    });
  }
  for (auto& t : threads) t.join();
  for (auto& l : g.lanes) {
    if (l.error) std::rethrow_exception(l.error);
  }
}

}  // namespace

const LaneInfo& lane() { return current->info; }

void* buffer(int index) {
  const auto& buffers = current->group->launch->buffers;
  if (index < 0 || static_cast<size_t>(index) >= buffers.size()) {
    throw HarnessError("kernel reads [[buffer(" + std::to_string(index) + ")]] but the launch binds " +
                       std::to_string(buffers.size()));
  }
  return buffers[index];
}

void* threadgroup_buffer(int index) {
  auto& tg = current->group->tg_buffers;
  if (index < 0 || static_cast<size_t>(index) >= tg.size()) {
    throw HarnessError("kernel uses [[threadgroup(" + std::to_string(index) +
                       ")]] but the launch sets " + std::to_string(tg.size()));
  }
  return tg[index].get();
}

void* threadgroup_var(int site, size_t bytes, size_t align) {
  Group& g = *current->group;
  std::lock_guard<std::mutex> lock(g.vars_mutex);
  auto& slot = g.vars[site];
  if (!slot) {
    slot = std::make_unique<unsigned char[]>(bytes + align);
    poison(slot.get(), bytes + align);
  }
  auto p = reinterpret_cast<uintptr_t>(slot.get());
  return reinterpret_cast<void*>((p + align - 1) / align * align);
}

void atomic_point() {
  Lane& l = *current;
  if (l.group->launch->mode == Mode::kThreads) return;
  // Still runnable: the scheduler moves on to the next lane of its order.
  swapcontext(&l.context, &l.group->scheduler);
}

bool spurious_failure() {
  Lane& l = *current;
  if (l.group->launch->mode == Mode::kThreads) return false;
  return ++l.compare_exchanges % 3 == 0;
}

unsigned char* exchange_area() { return current->group->exchange[current->info.simd_group].get(); }

void barrier(Scope scope, const char* file, int line) {
  Lane& l = *current;
  Site site{scope, file, line};
  if (l.group->launch->mode == Mode::kThreads) {
    auto& b = scope == Scope::kThreadgroup ? *l.group->group_barrier
                                           : *l.group->simd_barriers[l.info.simd_group];
    b.wait(site);
    return;
  }
  l.state = State::kWaiting;
  l.waiting = site;
  swapcontext(&l.context, &l.group->scheduler);
}

}  // namespace detail

void dispatch(const std::string& name, const Launch& launch) {
  auto it = registry().find(name);
  if (it == registry().end()) throw HarnessError("no kernel named '" + name + "'");
  const uint32_t lanes = launch.group_size.count();
  if (lanes == 0 || lanes > 1024) {
    throw HarnessError("threadgroup size must be 1..1024 threads, got " + std::to_string(lanes));
  }
  std::vector<std::unique_ptr<char[]>> stacks(lanes);
  for (uint32_t gz = 0; gz < launch.groups.z; ++gz) {
    for (uint32_t gy = 0; gy < launch.groups.y; ++gy) {
      for (uint32_t gx = 0; gx < launch.groups.x; ++gx) {
        detail::Group g;
        g.launch = &launch;
        for (size_t bytes : launch.threadgroup_bytes) {
          g.tg_buffers.push_back(std::make_unique<unsigned char[]>(bytes));
          detail::poison(g.tg_buffers.back().get(), bytes);
        }
        g.lanes.resize(lanes);
        const uint32_t simd_groups = (lanes + detail::kSimdWidth - 1) / detail::kSimdWidth;
        for (uint32_t s = 0; s < simd_groups; ++s) {
          g.exchange.push_back(
              std::make_unique<unsigned char[]>(detail::kSimdWidth * detail::kExchangeBytes));
        }
        const Dim3& gs = launch.group_size;
        for (uint32_t i = 0; i < lanes; ++i) {
          auto& info = g.lanes[i].info;
          info.thread_in_group = {i % gs.x, (i / gs.x) % gs.y, i / (gs.x * gs.y)};
          info.group = {gx, gy, gz};
          info.position_in_grid = {gx * gs.x + info.thread_in_group.x,
                                   gy * gs.y + info.thread_in_group.y,
                                   gz * gs.z + info.thread_in_group.z};
          info.group_size = gs;
          info.groups = launch.groups;
          info.index_in_group = i;
          info.simd_lane = i % detail::kSimdWidth;
          info.simd_group = i / detail::kSimdWidth;
          info.simd_size = std::min(detail::kSimdWidth, lanes - info.simd_group * detail::kSimdWidth);
          g.lanes[i].group = &g;
        }
        groups_run.fetch_add(1);
        if (launch.mode == Mode::kThreads) {
          detail::run_threads(g, it->second);
        } else {
          detail::run_fibers(g, it->second, stacks);
        }
      }
    }
  }
}

}  // namespace msl
