// Sorted implicit-GEMM convolution (TorchSparse++'s sorted dataflow) with
// simdgroup_matrix 8x8 multiply-accumulate.
//
// One threadgroup (one simdgroup of 32 threads) per tile of 32 sorted rows.
// For every offset present in the tile's mask, the tile's neighbour rows and
// the offset's weight are staged in threadgroup memory as half, and the
// 32 x Cout tile accumulates in float32 fragments; offsets absent from the
// whole tile are skipped. Rows with no neighbour through an offset read zeros.
#include <metal_stdlib>
using namespace metal;

constant constexpr uint kTile = 32;     // rows per tile (= SORTED_TILE_ROWS)
constant constexpr uint kMaxC = 64;     // channels supported (32 or 64)

struct SortedDims {
  uint n_out;
  uint n_kernels;
  uint cin;
  uint cout;
  uint store_sorted;
};

kernel void mlxl_sorted_conv(
    device const float* feats [[buffer(0)]],
    device const float* weight [[buffer(1)]],
    device const int* sorted_map [[buffer(2)]],
    device const int* reorder [[buffer(3)]],
    device const int* tile_masks [[buffer(4)]],
    device float* out [[buffer(5)]],
    constant SortedDims& d [[buffer(6)]],
    uint tile [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup half a_tile[kTile * kMaxC];
  threadgroup half b_tile[kMaxC * kMaxC];
  threadgroup float c_tile[kTile * kMaxC];
  // This lane's fragment coordinates (MLX's 8x8 layout).
  const uint qid = lane / 4;
  const uint fm = (qid & 4) + (lane / 2) % 4;
  const uint fn = (qid & 2) * 2 + (lane % 2) * 2;
  const uint row = tile * kTile + lane;
  const uint col_blocks = d.cout / 8;
  simdgroup_matrix<float, 8, 8> acc[4][8];
  for (uint rb = 0; rb < 4; ++rb) {
    for (uint cb = 0; cb < 8; ++cb) acc[rb][cb] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  const uint mask = uint(tile_masks[tile]);
  for (uint k = 0; k < d.n_kernels; ++k) {
    if (((mask >> k) & 1u) == 0) continue;  // uniform: one mask per tile
    // Stage the tile's neighbour rows (one per lane) and W_k.
    const int in = row < d.n_out ? sorted_map[size_t(row) * d.n_kernels + k] : -1;
    for (uint i = 0; i < d.cin; ++i) {
      a_tile[lane * d.cin + i] = in >= 0 ? half(feats[size_t(in) * d.cin + i]) : half(0.0f);
    }
    for (uint x = lane; x < d.cin * d.cout; x += kTile) {
      b_tile[x] = half(weight[size_t(k) * d.cin * d.cout + x]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kb = 0; kb < d.cin / 8; ++kb) {
      for (uint rb = 0; rb < 4; ++rb) {
        simdgroup_matrix<float, 8, 8> a;
        a.thread_elements()[0] = float(a_tile[(rb * 8 + fm) * d.cin + kb * 8 + fn]);
        a.thread_elements()[1] = float(a_tile[(rb * 8 + fm) * d.cin + kb * 8 + fn + 1]);
        for (uint cb = 0; cb < col_blocks; ++cb) {
          simdgroup_matrix<float, 8, 8> b;
          b.thread_elements()[0] = float(b_tile[(kb * 8 + fm) * d.cout + cb * 8 + fn]);
          b.thread_elements()[1] = float(b_tile[(kb * 8 + fm) * d.cout + cb * 8 + fn + 1]);
          simdgroup_multiply_accumulate(acc[rb][cb], a, b, acc[rb][cb]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint rb = 0; rb < 4; ++rb) {
    for (uint cb = 0; cb < col_blocks; ++cb) {
      c_tile[(rb * 8 + fm) * d.cout + cb * 8 + fn] = acc[rb][cb].thread_elements()[0];
      c_tile[(rb * 8 + fm) * d.cout + cb * 8 + fn + 1] = acc[rb][cb].thread_elements()[1];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (row < d.n_out) {
    const uint dst = d.store_sorted ? row : uint(reorder[row]);
    for (uint c = 0; c < d.cout; ++c) out[size_t(dst) * d.cout + c] = c_tile[lane * d.cout + c];
  }
}
