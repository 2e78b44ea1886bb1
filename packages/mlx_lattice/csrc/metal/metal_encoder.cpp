// The Metal encoder (macOS): MLX's command encoder, with this folder's MSL
// sources compiled at run time into one cached library. Compiled only on
// macOS (the package BUILD's select on the OS picks it with metal/eval.cpp).
// NOT compiled or run on the Linux machines this project is developed on.

#include <algorithm>
#include <list>

// metal-cpp is header-only: one translation unit of each image defines its
// selector and class symbols (libmlx exports only MLX_API symbols).
#define NS_PRIVATE_IMPLEMENTATION
#define CA_PRIVATE_IMPLEMENTATION
#define MTL_PRIVATE_IMPLEMENTATION

#include "encoder.h"
#include "metal_sources.h"  // generated: kMetalSources, the .metal files concatenated
#include "mlx/backend/metal/device.h"
#include "mlx/version.h"

namespace mlx_lattice::gpu {

namespace {

namespace metal = mx::metal;

metal::CommandEncoder& command_encoder(mx::Stream stream) {
#if MLX_VERSION_NUMERIC >= 31002
  return metal::get_command_encoder(stream);
#else
  return metal::device(stream.device).get_command_encoder(stream.index);
#endif
}

class MetalEncoder final : public KernelEncoder {
 public:
  explicit MetalEncoder(mx::Stream stream)
      : device_(metal::device(stream.device)), encoder_(command_encoder(stream)) {}

  void kernel(const std::string& name) override {
    auto* library = device_.get_library("mlx_lattice_kernels", [] { return std::string(kMetalSources); });
    encoder_.set_compute_pipeline_state(device_.get_kernel(name, library));
  }
  void input(int index, Buffer buffer) override { encoder_.set_input_array(array_of(buffer), index); }
  void output(int index, Buffer buffer) override {
    encoder_.set_output_array(const_cast<mx::array&>(*buffer.array), index);
  }
  void bytes(int index, const void* data, size_t size) override {
    encoder_.set_bytes(static_cast<const uint8_t*>(data), static_cast<int>(size), index);
  }
  void threadgroup_memory(int index, size_t size) override {
    encoder_.set_threadgroup_memory_length(size, index);
  }
  void dispatch(Size3 groups, Size3 group_size) override {
    if (!groups.x || !groups.y || !groups.z) return;
    encoder_.dispatch_threadgroups(MTL::Size(groups.x, groups.y, groups.z),
                                   MTL::Size(group_size.x, group_size.y, group_size.z));
  }
  Buffer scratch(size_t bytes) override {
    const int n = static_cast<int>(std::max<size_t>((bytes + 3) / 4, 1));
    uploads_.emplace_back(mx::Shape{n}, mx::float32, nullptr, std::vector<mx::array>{});
    auto& a = uploads_.back();
    a.set_data(mx::allocator::malloc(a.nbytes()));
    encoder_.add_temporary(a);  // freed once the command buffer has completed
    return {&a, nullptr, a.nbytes()};
  }

 private:
  // Host-made index data (rebuilt groupings) goes up as a temporary array.
  const mx::array& array_of(const Buffer& buffer) {
    if (buffer.array) return *buffer.array;
    static const int32_t kZero = 0;  // Metal wants a non-empty buffer
    const int n = static_cast<int>(buffer.bytes / sizeof(int32_t));
    const auto* data = n ? static_cast<const int32_t*>(buffer.host) : &kZero;
    // Arrays made from host data hold it already: nothing to evaluate.
    uploads_.push_back(mx::array(data, {std::max(n, 1)}, mx::int32));
    encoder_.add_temporary(uploads_.back());
    return uploads_.back();
  }

  metal::Device& device_;
  metal::CommandEncoder& encoder_;
  std::list<mx::array> uploads_;  // uploads and scratch; stable addresses
};

}  // namespace

std::unique_ptr<KernelEncoder> metal_encoder(mx::Stream stream) {
  return std::make_unique<MetalEncoder>(stream);
}

}  // namespace mlx_lattice::gpu
