// CPU kernels of the sparse primitives, on raw row-major float32 buffers and
// int32 index arrays that the primitives have validated.
//
// Every kernel owns its output rows per task and reduces in a fixed order
// (kernel offsets ascending, then edges in CSR order), so results are the same
// bits for any thread count.
#pragma once

#include <cstdint>
#include <vector>

// Functions whose documented rounding is "after the product and after the
// sum" (the weight dequantization s * q + b): no fused multiply-add
// contraction, which GCC applies by default on AArch64 and which would make
// the values differ from the float reference there.
#if defined(__clang__)
#define MLX_LATTICE_NO_CONTRACT
#define MLX_LATTICE_NO_CONTRACT_BODY _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define MLX_LATTICE_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#define MLX_LATTICE_NO_CONTRACT_BODY
#else
#define MLX_LATTICE_NO_CONTRACT
#define MLX_LATTICE_NO_CONTRACT_BODY
#endif

namespace mlx_lattice::kernels {

// Rows of output tiles (output-stationary work unit).
constexpr int64_t kTileRows = 128;
// Rows per tile of the sorted implicit-GEMM view's tile_masks.
constexpr int64_t kSortedTileRows = 32;

// A CSR grouping of edges: edges of group g are edge_ids[offsets[g]:offsets[g+1]]
// (edge_ids == nullptr means the identity: edges are stored grouped).
struct Csr {
  const int32_t* offsets = nullptr;
  const int32_t* edge_ids = nullptr;
  int64_t groups = 0;
};

// Builds a CSR grouping of `n_edges` edges by key (stable: edge order kept
// within a group).
void group_by(const int32_t* keys, int64_t n_edges, int64_t groups, std::vector<int32_t>& offsets,
              std::vector<int32_t>& edge_ids);

// Stationary conv: for every group g (a row of C) and edge e in it,
//   C[c_index[e]] += A[a_index[e]] @ B[kernel_ids[e]]
// with B a stack of (a_width x c_width) matrices. C rows are zeroed first.
// Forward conv: groups = outputs, A = features, C = output.
// Input gradient: groups = inputs, A = output gradient, C = feature gradient,
// B = transposed weights.
// c_index[e] must be e's group (the CSR groups C's rows); the tiles address
// C by group and do not read it.
void stationary_conv(const float* a, int64_t a_width, const float* b, int64_t n_kernels,
                     float* c, int64_t c_width, const Csr& csr, const int32_t* a_index,
                     const int32_t* c_index, const int32_t* kernel_ids);

// Storage formats of floating arrays the kernels read and write.
enum class FloatFormat { kF32, kF16, kBF16 };

// The forward stationary_conv with features and output stored as `format`:
// half-precision input rows are converted to float32 per tile as the tile
// gathers them, and the tile's output rows accumulate in a float32 buffer
// rounded to `format` once (nearest even). The arithmetic is
// stationary_conv's, so the result is its float32 result rounded. c_index
// must be the output CSR's own rows.
void forward_conv(const void* feats, FloatFormat format, int64_t cin, const float* weight,
                  int64_t n_kernels, int64_t cout, const Csr& csr, const int32_t* a_index,
                  const int32_t* c_index, const int32_t* kernel_ids, void* out);

// A group-affine quantized weight in mx.quantize's layout: packed codes
// (K, cout, row_bytes), `bits` each little-endian over rows of storage_in
// values, scales and biases (K, cout, storage_in / group_size).
struct QuantizedWeightView {
  const uint8_t* packed = nullptr;
  int64_t row_bytes = 0;
  const float* scales = nullptr;
  const float* biases = nullptr;
  int64_t storage_in = 0;
  int64_t group_size = 0;
  int bits = 8;
};

// Code `c` of one packed row of mx.quantize's layout (`bits` per value,
// little-endian, `row_bytes` bytes): the value's bits start at bit c * bits
// and span at most two bytes (bits <= 8); the second byte is read only when
// it lies inside the row.
inline uint32_t unpack_code(const uint8_t* row, int64_t row_bytes, int64_t c, int bits) {
  const int64_t bit = c * bits;
  const int64_t byte = bit >> 3;
  uint32_t v = row[byte];
  if (byte + 1 < row_bytes) v |= static_cast<uint32_t>(row[byte + 1]) << 8;
  return (v >> (bit & 7)) & ((1u << bits) - 1u);
}

// The float32 weight (K, cin, cout) of a quantized weight (mx.quantize's
// group-affine layout): s * q + b, rounded after the product and after the
// sum. Offsets in parallel, each offset's codes re-laid out as (cin, cout)
// and dequantized as one panel (AVX-512 where usable).
void dequantize_weight_panels(const QuantizedWeightView& weight, int64_t n_kernels, int64_t cin,
                              int64_t cout, float* out);

// dW[k] = sum over edges e of offset k of F[in_rows[e]]^T G[out_rows[e]].
// dW is (K, cin, cout), overwritten. The edges are cut into slabs by output
// row (how many and where depends on the relation and the sizes, never on
// the thread count); a slab's partial sums its edges of each offset in
// kernel-CSR order and the partials are added in slab order.
void weight_gradient(const float* feats, int64_t cin, const float* grad, int64_t cout,
                     const Csr& kernel_csr, const int32_t* in_rows, const int32_t* out_rows,
                     float* dweight);

// weight_gradient with F and G stored as `feats_format` / `grad_format`: a
// half-precision row is widened to float32 (exactly) as its chunk of edges is
// gathered, into a per-thread buffer of kChunk rows, never as a whole array.
// The micro-kernel and its order are the float32 path's, so dW is bit for bit
// weight_gradient on the arrays widened first.
void weight_gradient(const void* feats, FloatFormat feats_format, int64_t cin, const void* grad,
                     FloatFormat grad_format, int64_t cout, const Csr& kernel_csr,
                     const int32_t* in_rows, const int32_t* out_rows, float* dweight);

// Sorted implicit GEMM: row r of the sorted view takes input rows
// sorted_map[r * K + k] (or -1). Output row reorder[r], or r if store_sorted.
void sorted_conv(const float* feats, int64_t cin, const float* weight, int64_t n_kernels,
                 int64_t cout, const int32_t* sorted_map, const int32_t* reorder, int64_t n_out,
                 bool store_sorted, float* out);

// out[o] = sum over edges e of o of colsum(W[kernel_ids[e]]).
void normalization_denominator(const float* weight, int64_t n_kernels, int64_t cin,
                               int64_t cout, const int32_t* kernel_ids, const int32_t* out_offsets,
                               int64_t n_out, float* out);

// dS[k] = sum over edges e of offset k (in edge order) of G[out(e)]; (K, cout).
void denominator_gradient(const float* grad, int64_t cout, const int32_t* kernel_ids,
                          const int32_t* out_offsets, int64_t n_out, int64_t n_kernels,
                          float* out);

// dst[i] = float(src[i]) / dst[i] = round-to-nearest-even(src[i]), in parallel.
void to_float32(const void* src, FloatFormat format, int64_t n, float* dst);
void from_float32(const float* src, int64_t n, FloatFormat format, void* dst);

enum class PoolMode { kMax, kAvg, kSum };

// Pooling over the output CSR; outputs without edges are 0.
void pool_forward(const float* feats, int64_t channels, const int32_t* in_rows,
                  const int32_t* out_offsets, int64_t n_out, PoolMode mode, float* out);

// out[o, c] = tangent[argmax_e feats[in_rows[e], c]] (first maximum in edge order).
void pool_max_select(const float* feats, const float* tangent, int64_t channels,
                     const int32_t* in_rows, const int32_t* out_offsets, int64_t n_out,
                     float* out);

// Gradient of pool_forward with respect to its features (n_in rows).
void pool_backward(const float* grad, const float* feats, int64_t channels,
                   const int32_t* in_rows, const int32_t* out_offsets, int64_t n_out,
                   int64_t n_in, PoolMode mode, float* dfeats);

}  // namespace mlx_lattice::kernels
