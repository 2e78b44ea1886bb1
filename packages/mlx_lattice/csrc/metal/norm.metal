// Batch norm (+ optional ReLU) over the rows of (n, c) features. Training
// mode: the forward pass (block sums, per-channel statistics, the
// normalize-affine map) and the closed-form backward pass (block sums of g
// and g * (x - mean), per-channel coefficients, the fused map), as the CPU
// kernels in ../cpu/norm.cpp compute them. Eval mode: the normalize-affine
// map alone, with given statistics.
//
// Storage: float32, float16 or bfloat16 (bfloat16 as its raw ushort bits,
// converted here exactly as the CPU converts: widening by a shift, narrowing
// round-to-nearest-even with NaNs kept quiet), arithmetic in float32.
//
// Determinism: rows are reduced in fixed blocks of MLXL_NORM_BLOCK_ROWS (the
// CPU's kNormBlockRows): one thread per (channel, block) sums its block's rows
// in row order, then one thread per channel adds the blocks in block order,
// so no result depends on the grid, the threadgroup size or timing. Metal has
// no double: the sums are compensated (Neumaier) float-float pairs, products
// and centred values carry their rounding errors (fma / two-difference), and
// the mean is kept as hi + lo for the centring. MLX compiles this library
// with fast math off, so the compensations are not optimized away.
#include <metal_stdlib>
using namespace metal;

#define MLXL_NORM_BLOCK_ROWS 256u

struct NormDims {
  uint n;       // rows
  uint c;       // channels
  uint blocks;  // ceil(n / MLXL_NORM_BLOCK_ROWS)
  uint relu;    // 1: ReLU after the affine map (backward: mask by y > 0)
  uint stage;   // forward sums: 0 = sum of x, 1 = sum of squared deviations
  float eps;
};

// ---------------------------------------------------------------- storage

inline float mlxl_norm_load(float v) { return v; }
inline float mlxl_norm_load(half v) { return float(v); }
inline float mlxl_norm_load(ushort v) { return as_type<float>(uint(v) << 16); }

inline void mlxl_norm_store(device float* p, ulong i, float v) { p[i] = v; }
inline void mlxl_norm_store(device half* p, ulong i, float v) { p[i] = half(v); }
inline void mlxl_norm_store(device ushort* p, ulong i, float v) {
  uint x = as_type<uint>(v);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    p[i] = ushort((x >> 16) | 0x40u);  // NaN stays a quiet NaN
    return;
  }
  x += 0x7fffu + ((x >> 16) & 1u);
  p[i] = ushort(x >> 16);
}

// ------------------------------------------------------------ compensated sums

// s + c, accumulated with Neumaier's compensation (the order is fixed by the
// caller; the result does not depend on magnitudes being sorted).
struct MlxlNormSum {
  float s;
  float c;
};

inline void mlxl_norm_add(thread MlxlNormSum& a, float x) {
  const float t = a.s + x;
  if (abs(a.s) >= abs(x)) {
    a.c += (a.s - t) + x;
  } else {
    a.c += (x - t) + a.s;
  }
  a.s = t;
}

// a += p * q with the product's rounding error kept in the compensation.
inline void mlxl_norm_add_product(thread MlxlNormSum& a, float p, float q) {
  const float m = p * q;
  mlxl_norm_add(a, m);
  a.c += fma(p, q, -m);
}

// x - m as hi + lo (exact: Knuth's two-difference).
inline float2 mlxl_norm_diff(float x, float m) {
  const float d = x - m;
  const float b = d - x;
  return float2(d, (x - (d - b)) + (-m - b));
}

// --------------------------------------------------------------- forward

// partial[(b * c + j) * 2 + {0, 1}]: block b's compensated sum of channel j;
// stage 0 of x, stage 1 of (x - mean)^2 with mean = hi[j] + lo[j] (stats).
template <typename T>
void mlxl_norm_block_sums(device const T* x, device const float* stats, device float* partial,
                          constant NormDims& d, uint2 pos) {
  const uint j = pos.x, b = pos.y;
  if (j >= d.c || b >= d.blocks) return;
  const uint r0 = b * MLXL_NORM_BLOCK_ROWS;
  const uint r1 = min(d.n, r0 + MLXL_NORM_BLOCK_ROWS);
  MlxlNormSum acc = {0.0f, 0.0f};
  if (d.stage == 0) {
    for (uint r = r0; r < r1; ++r) mlxl_norm_add(acc, mlxl_norm_load(x[ulong(r) * d.c + j]));
  } else {
    const float hi = stats[j], lo = stats[d.c + j];
    for (uint r = r0; r < r1; ++r) {
      const float2 dv = mlxl_norm_diff(mlxl_norm_load(x[ulong(r) * d.c + j]), hi);
      const float v = dv.x + (dv.y - lo);
      mlxl_norm_add_product(acc, v, v);
    }
  }
  partial[(ulong(b) * d.c + j) * 2] = acc.s;
  partial[(ulong(b) * d.c + j) * 2 + 1] = acc.c;
}

kernel void mlxl_norm_sums_f32(device const float* x [[buffer(0)]],
                               device const float* stats [[buffer(1)]],
                               device float* partial [[buffer(2)]],
                               constant NormDims& d [[buffer(3)]],
                               uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_block_sums(x, stats, partial, d, pos);
}

kernel void mlxl_norm_sums_f16(device const half* x [[buffer(0)]],
                               device const float* stats [[buffer(1)]],
                               device float* partial [[buffer(2)]],
                               constant NormDims& d [[buffer(3)]],
                               uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_block_sums(x, stats, partial, d, pos);
}

kernel void mlxl_norm_sums_bf16(device const ushort* x [[buffer(0)]],
                                device const float* stats [[buffer(1)]],
                                device float* partial [[buffer(2)]],
                                constant NormDims& d [[buffer(3)]],
                                uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_block_sums(x, stats, partial, d, pos);
}

// Channel j's total over the blocks of `partial` (width pairs per (block,
// channel); `k` picks the pair), in block order.
inline MlxlNormSum mlxl_norm_total(device const float* partial, constant NormDims& d, uint j,
                                   uint width, uint k) {
  MlxlNormSum acc = {0.0f, 0.0f};
  float comp = 0.0f;
  for (uint b = 0; b < d.blocks; ++b) {
    const ulong at = ((ulong(b) * d.c + j) * width + k) * 2;
    mlxl_norm_add(acc, partial[at]);
    comp += partial[at + 1];
  }
  acc.c += comp;
  return acc;
}

// Stage 0: mean (output, float32) and stats = {hi (c), lo (c)} with hi + lo
// the mean to about twice float precision. Stage 1: var (output, biased)
// and stats[2c + j] = weight / sqrt(var + eps).
kernel void mlxl_norm_stats(device const float* partial [[buffer(0)]],
                            device const float* weight [[buffer(1)]],
                            device float* stats [[buffer(2)]],
                            device float* mean [[buffer(3)]],
                            device float* var [[buffer(4)]],
                            constant NormDims& d [[buffer(5)]],
                            uint j [[thread_position_in_grid]]) {
  if (j >= d.c) return;
  const MlxlNormSum t = mlxl_norm_total(partial, d, j, 1, 0);
  const float n = float(d.n);
  if (d.stage == 0) {
    const float hi = (t.s + t.c) / n;
    const float lo = (fma(-hi, n, t.s) + t.c) / n;  // what hi misses of the sum
    stats[j] = hi;
    stats[d.c + j] = lo;
    mean[j] = hi + lo;
  } else {
    const float v = (t.s + t.c) / n;
    var[j] = v;
    stats[2 * d.c + j] = weight[j] / sqrt(v + d.eps);
  }
}

// y = [relu]((x - mean) * scale + bias), one thread per element (the CPU's
// float32 expression on the same float32 mean): the training forward's last
// pass (scale from its statistics) and the eval-mode norm (scale given).
template <typename T>
void mlxl_norm_map(device const T* x, device const float* scale, device const float* mean,
                   device const float* bias, device T* y, constant NormDims& d, uint2 pos) {
  const uint j = pos.x, r = pos.y;
  if (j >= d.c || r >= d.n) return;
  const ulong i = ulong(r) * d.c + j;
  const float v = (mlxl_norm_load(x[i]) - mean[j]) * scale[j] + bias[j];
  mlxl_norm_store(y, i, d.relu ? max(v, 0.0f) : v);
}

kernel void mlxl_norm_forward_f32(device const float* x [[buffer(0)]],
                                  device const float* stats [[buffer(1)]],
                                  device const float* mean [[buffer(2)]],
                                  device const float* bias [[buffer(3)]],
                                  device float* y [[buffer(4)]],
                                  constant NormDims& d [[buffer(5)]],
                                  uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_map(x, stats + 2 * d.c, mean, bias, y, d, pos);
}

kernel void mlxl_norm_forward_f16(device const half* x [[buffer(0)]],
                                  device const float* stats [[buffer(1)]],
                                  device const float* mean [[buffer(2)]],
                                  device const float* bias [[buffer(3)]],
                                  device half* y [[buffer(4)]],
                                  constant NormDims& d [[buffer(5)]],
                                  uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_map(x, stats + 2 * d.c, mean, bias, y, d, pos);
}

kernel void mlxl_norm_forward_bf16(device const ushort* x [[buffer(0)]],
                                   device const float* stats [[buffer(1)]],
                                   device const float* mean [[buffer(2)]],
                                   device const float* bias [[buffer(3)]],
                                   device ushort* y [[buffer(4)]],
                                   constant NormDims& d [[buffer(5)]],
                                   uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_map(x, stats + 2 * d.c, mean, bias, y, d, pos);
}

// ------------------------------------------------------------ eval mode

// BatchNormEval: the map above with the given mean and scale.
kernel void mlxl_norm_eval_f32(device const float* x [[buffer(0)]],
                               device const float* mean [[buffer(1)]],
                               device const float* scale [[buffer(2)]],
                               device const float* bias [[buffer(3)]],
                               device float* y [[buffer(4)]],
                               constant NormDims& d [[buffer(5)]],
                               uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_map(x, scale, mean, bias, y, d, pos);
}

kernel void mlxl_norm_eval_f16(device const half* x [[buffer(0)]],
                               device const float* mean [[buffer(1)]],
                               device const float* scale [[buffer(2)]],
                               device const float* bias [[buffer(3)]],
                               device half* y [[buffer(4)]],
                               constant NormDims& d [[buffer(5)]],
                               uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_map(x, scale, mean, bias, y, d, pos);
}

kernel void mlxl_norm_eval_bf16(device const ushort* x [[buffer(0)]],
                                device const float* mean [[buffer(1)]],
                                device const float* scale [[buffer(2)]],
                                device const float* bias [[buffer(3)]],
                                device ushort* y [[buffer(4)]],
                                constant NormDims& d [[buffer(5)]],
                                uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_map(x, scale, mean, bias, y, d, pos);
}

// -------------------------------------------------------------- backward

// The cotangent with the ReLU's mask applied (gradients pass where y > 0).
template <typename T>
inline float mlxl_norm_masked(device const T* g, device const T* y, constant NormDims& d,
                              ulong i) {
  const float gv = mlxl_norm_load(g[i]);
  return d.relu && !(mlxl_norm_load(y[i]) > 0.0f) ? 0.0f : gv;
}

// partial[((b * c + j) * 2 + k) * 2 + {0, 1}]: block b's compensated sums of
// channel j, k = 0: sum(g), k = 1: sum(g * (x - mean)).
template <typename T>
void mlxl_norm_grad_block_sums(device const T* g, device const T* x, device const T* y,
                               device const float* mean, device float* partial,
                               constant NormDims& d, uint2 pos) {
  const uint j = pos.x, b = pos.y;
  if (j >= d.c || b >= d.blocks) return;
  const uint r0 = b * MLXL_NORM_BLOCK_ROWS;
  const uint r1 = min(d.n, r0 + MLXL_NORM_BLOCK_ROWS);
  const float m = mean[j];
  MlxlNormSum sg = {0.0f, 0.0f}, sgx = {0.0f, 0.0f};
  for (uint r = r0; r < r1; ++r) {
    const ulong i = ulong(r) * d.c + j;
    const float gv = mlxl_norm_masked(g, y, d, i);
    const float2 dv = mlxl_norm_diff(mlxl_norm_load(x[i]), m);
    mlxl_norm_add(sg, gv);
    mlxl_norm_add_product(sgx, gv, dv.x);
    sgx.c += gv * dv.y;
  }
  const ulong at = (ulong(b) * d.c + j) * 4;
  partial[at] = sg.s;
  partial[at + 1] = sg.c;
  partial[at + 2] = sgx.s;
  partial[at + 3] = sgx.c;
}

kernel void mlxl_norm_grad_sums_f32(device const float* g [[buffer(0)]],
                                    device const float* x [[buffer(1)]],
                                    device const float* y [[buffer(2)]],
                                    device const float* mean [[buffer(3)]],
                                    device float* partial [[buffer(4)]],
                                    constant NormDims& d [[buffer(5)]],
                                    uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_grad_block_sums(g, x, y, mean, partial, d, pos);
}

kernel void mlxl_norm_grad_sums_f16(device const half* g [[buffer(0)]],
                                    device const half* x [[buffer(1)]],
                                    device const half* y [[buffer(2)]],
                                    device const float* mean [[buffer(3)]],
                                    device float* partial [[buffer(4)]],
                                    constant NormDims& d [[buffer(5)]],
                                    uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_grad_block_sums(g, x, y, mean, partial, d, pos);
}

kernel void mlxl_norm_grad_sums_bf16(device const ushort* g [[buffer(0)]],
                                     device const ushort* x [[buffer(1)]],
                                     device const ushort* y [[buffer(2)]],
                                     device const float* mean [[buffer(3)]],
                                     device float* partial [[buffer(4)]],
                                     constant NormDims& d [[buffer(5)]],
                                     uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_grad_block_sums(g, x, y, mean, partial, d, pos);
}

// dbias = sum(g), dweight = sum(g * (x - mean)) * rstd, and the map's
// coefficients coef = {a (c), k (c), mean(g) (c)}: a = weight * rstd,
// k = -a * rstd * dweight / n.
kernel void mlxl_norm_grad_coefs(device const float* partial [[buffer(0)]],
                                 device const float* weight [[buffer(1)]],
                                 device const float* var [[buffer(2)]],
                                 device float* coef [[buffer(3)]],
                                 device float* dweight [[buffer(4)]],
                                 device float* dbias [[buffer(5)]],
                                 constant NormDims& d [[buffer(6)]],
                                 uint j [[thread_position_in_grid]]) {
  if (j >= d.c) return;
  const MlxlNormSum tg = mlxl_norm_total(partial, d, j, 2, 0);
  const MlxlNormSum tgx = mlxl_norm_total(partial, d, j, 2, 1);
  const float n = float(d.n);
  const float rstd = 1.0f / sqrt(var[j] + d.eps);
  const float db = tg.s + tg.c;
  const float dw = (tgx.s + tgx.c) * rstd;
  const float a = weight[j] * rstd;
  dbias[j] = db;
  dweight[j] = dw;
  coef[j] = a;
  coef[d.c + j] = -a * rstd * dw / n;
  coef[2 * d.c + j] = db / n;
}

// dx = a * (g - mean(g)) + k * (x - mean), one thread per element.
template <typename T>
void mlxl_norm_grad_map(device const T* g, device const T* x, device const T* y,
                        device const float* mean, device const float* coef, device T* dx,
                        constant NormDims& d, uint2 pos) {
  const uint j = pos.x, r = pos.y;
  if (j >= d.c || r >= d.n) return;
  const ulong i = ulong(r) * d.c + j;
  const float gv = mlxl_norm_masked(g, y, d, i);
  const float v = coef[j] * (gv - coef[2 * d.c + j]) +
                  coef[d.c + j] * (mlxl_norm_load(x[i]) - mean[j]);
  mlxl_norm_store(dx, i, v);
}

kernel void mlxl_norm_grad_f32(device const float* g [[buffer(0)]],
                               device const float* x [[buffer(1)]],
                               device const float* y [[buffer(2)]],
                               device const float* mean [[buffer(3)]],
                               device const float* coef [[buffer(4)]],
                               device float* dx [[buffer(5)]],
                               constant NormDims& d [[buffer(6)]],
                               uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_grad_map(g, x, y, mean, coef, dx, d, pos);
}

kernel void mlxl_norm_grad_f16(device const half* g [[buffer(0)]],
                               device const half* x [[buffer(1)]],
                               device const half* y [[buffer(2)]],
                               device const float* mean [[buffer(3)]],
                               device const float* coef [[buffer(4)]],
                               device half* dx [[buffer(5)]],
                               constant NormDims& d [[buffer(6)]],
                               uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_grad_map(g, x, y, mean, coef, dx, d, pos);
}

kernel void mlxl_norm_grad_bf16(device const ushort* g [[buffer(0)]],
                                device const ushort* x [[buffer(1)]],
                                device const ushort* y [[buffer(2)]],
                                device const float* mean [[buffer(3)]],
                                device const float* coef [[buffer(4)]],
                                device ushort* dx [[buffer(5)]],
                                constant NormDims& d [[buffer(6)]],
                                uint2 pos [[thread_position_in_grid]]) {
  mlxl_norm_grad_map(g, x, y, mean, coef, dx, d, pos);
}
