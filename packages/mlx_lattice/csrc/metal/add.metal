// FeatureAdd: out = a + b elementwise in the operands' storage (float32,
// float16, or bfloat16 as raw ushort bits), each sum computed in float32 and
// rounded once to the storage format (round to nearest even; bfloat16 NaNs
// kept quiet), as the CPU kernel (../cpu/add.cpp) rounds. One thread per
// element; no reduction, so no order to fix.
#include <metal_stdlib>
using namespace metal;

inline float mlxl_add_load(float v) { return v; }
inline float mlxl_add_load(half v) { return float(v); }
inline float mlxl_add_load(ushort v) { return as_type<float>(uint(v) << 16); }

inline float mlxl_add_round(float v, float) { return v; }
inline half mlxl_add_round(float v, half) { return half(v); }
inline ushort mlxl_add_round(float v, ushort) {
  uint x = as_type<uint>(v);
  if ((x & 0x7fffffffu) > 0x7f800000u) return ushort((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return ushort(x >> 16);
}

template <typename T>
void mlxl_add(device const T* a, device const T* b, device T* out, uint n, uint i) {
  if (i >= n) return;
  out[i] = mlxl_add_round(mlxl_add_load(a[i]) + mlxl_add_load(b[i]), T(0));
}

kernel void mlxl_add_f32(device const float* a [[buffer(0)]],
                         device const float* b [[buffer(1)]],
                         device float* out [[buffer(2)]],
                         constant uint& n [[buffer(3)]],
                         uint i [[thread_position_in_grid]]) {
  mlxl_add(a, b, out, n, i);
}

kernel void mlxl_add_f16(device const half* a [[buffer(0)]],
                         device const half* b [[buffer(1)]],
                         device half* out [[buffer(2)]],
                         constant uint& n [[buffer(3)]],
                         uint i [[thread_position_in_grid]]) {
  mlxl_add(a, b, out, n, i);
}

kernel void mlxl_add_bf16(device const ushort* a [[buffer(0)]],
                          device const ushort* b [[buffer(1)]],
                          device ushort* out [[buffer(2)]],
                          constant uint& n [[buffer(3)]],
                          uint i [[thread_position_in_grid]]) {
  mlxl_add(a, b, out, n, i);
}
