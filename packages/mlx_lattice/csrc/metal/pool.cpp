// GPU encode body of SparsePool.
#include "encode.h"

namespace mlx_lattice::gpu {

void encode(const SparsePool& p, KernelEncoder& enc, Operands& ops,
            const std::vector<mx::array>& in, mx::array& out) {
  using S = SparsePool::Stage;
  const auto& r = p.relation();
  const auto stage = p.stage() == S::kForward     ? PoolStage::kForward
                     : p.stage() == S::kMaxSelect ? PoolStage::kMaxSelect
                                                  : PoolStage::kBackward;
  const uint32_t mode = p.mode() == kernels::PoolMode::kMax   ? 0
                        : p.mode() == kernels::PoolMode::kAvg ? 1
                                                              : 2;
  Buffer second = in.size() == 2 ? ops.floats(in[1]) : Buffer{};
  encode_pool(enc, stage, mode, ops.floats(in[0]), second, relation_buffers(ops, r),
              ops.output(out), u32(r.n_in), u32(r.n_out), u32(in[0].shape(1)));
}

}  // namespace mlx_lattice::gpu
