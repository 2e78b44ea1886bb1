// The harness encoder (test-only): binds host pointers and runs the preprocessed MSL
// kernels with tools/msl's runtime (fiber schedule, forward order).
#include <cstring>
#include <list>
#include <vector>

#include "../metal/encoder.h"
#include "harness.h"
#include "msl_runtime.h"

namespace mlx_lattice::gpu {

namespace {

class HarnessEncoder final : public KernelEncoder {
 public:
  void kernel(const std::string& name) override {
    name_ = name;
    launch_ = msl::Launch{};
    owned_.clear();
  }
  void input(int index, Buffer buffer) override { bind(index, const_cast<void*>(buffer.host)); }
  void output(int index, Buffer buffer) override { bind(index, const_cast<void*>(buffer.host)); }
  void bytes(int index, const void* data, size_t size) override {
    owned_.emplace_back(size);
    std::memcpy(owned_.back().data(), data, size);
    bind(index, owned_.back().data());
  }
  void threadgroup_memory(int index, size_t size) override {
    if (launch_.threadgroup_bytes.size() <= static_cast<size_t>(index)) {
      launch_.threadgroup_bytes.resize(index + 1);
    }
    launch_.threadgroup_bytes[index] = size;
  }
  void dispatch(Size3 groups, Size3 group_size) override {
    launch_.groups = {groups.x, groups.y, groups.z};
    launch_.group_size = {group_size.x, group_size.y, group_size.z};
    if (groups.x && groups.y && groups.z) msl::dispatch(name_, launch_);
  }
  Buffer scratch(size_t bytes) override {
    auto& b = scratch_.emplace_back((bytes + sizeof(float) - 1) / sizeof(float));
    return {nullptr, b.data(), bytes};
  }

 private:
  void bind(int index, void* p) {
    if (launch_.buffers.size() <= static_cast<size_t>(index)) launch_.buffers.resize(index + 1);
    launch_.buffers[index] = p;
  }
  std::string name_;
  msl::Launch launch_;
  std::vector<std::vector<unsigned char>> owned_;
  std::list<std::vector<float>> scratch_;  // list: stable addresses
};

}  // namespace

std::unique_ptr<KernelEncoder> harness_encoder() { return std::make_unique<HarnessEncoder>(); }

}  // namespace mlx_lattice::gpu
