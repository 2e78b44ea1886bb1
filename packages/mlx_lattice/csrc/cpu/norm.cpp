// Batch norm kernels (norm.h): blocks of rows over the thread pool, double
// partial sums per block reduced in block order.
#include "norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "parallel.h"
#include "tiles.h"

namespace mlx_lattice::kernels {

namespace {

int64_t element_bytes(FloatFormat format) { return format == FloatFormat::kF32 ? 4 : 2; }

// Float32 rows [r0, r0 + m) of an (n, c) array: its own data or a converted
// copy in the calling thread's buffer `slot`.
const float* load_rows(const void* src, FloatFormat format, int64_t r0, int64_t m, int64_t c,
                       int slot) {
  const int64_t offset = r0 * c;
  if (format == FloatFormat::kF32) return static_cast<const float*>(src) + offset;
  thread_local std::vector<float> buffers[4];
  auto& b = buffers[slot];
  if (static_cast<int64_t>(b.size()) < m * c) b.resize(m * c);
  convert_to_float32(static_cast<const char*>(src) + offset * element_bytes(format), format, m * c,
                     b.data());
  return b.data();
}

float* out_rows(void* dst, FloatFormat format, int64_t r0, int64_t c, int64_t m) {
  if (format == FloatFormat::kF32) return static_cast<float*>(dst) + r0 * c;
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < m * c) buffer.resize(m * c);
  return buffer.data();
}

void store_rows(const float* rows, void* dst, FloatFormat format, int64_t r0, int64_t m,
                int64_t c) {
  if (format == FloatFormat::kF32) return;
  convert_from_float32(rows, m * c, format,
                       static_cast<char*>(dst) + r0 * c * element_bytes(format));
}

// Column sums over all rows: per-block partials (each block's rows in order),
// then the blocks in order. body(block, r0, m, acc) adds block rows into acc.
template <typename Body>
std::vector<double> column_sums(int64_t n, int64_t c, int width, Body body) {
  const int64_t blocks = (n + kNormBlockRows - 1) / kNormBlockRows;
  std::vector<double> partial(static_cast<size_t>(blocks * c * width), 0.0);
  parallel_for(blocks, [&](int64_t b) {
    const int64_t r0 = b * kNormBlockRows;
    body(r0, std::min(kNormBlockRows, n - r0), partial.data() + b * c * width);
  });
  std::vector<double> total(static_cast<size_t>(c * width), 0.0);
  for (int64_t b = 0; b < blocks; ++b) {
    const double* p = partial.data() + b * c * width;
    for (int64_t j = 0; j < c * width; ++j) total[j] += p[j];
  }
  return total;
}

}  // namespace

void batch_norm_forward(const void* x, FloatFormat format, int64_t n, int64_t c,
                        const float* weight, const float* bias, float eps, bool relu, void* y,
                        float* mean, float* var) {
  const auto sums = column_sums(n, c, 1, [&](int64_t r0, int64_t m, double* acc) {
    const float* xr = load_rows(x, format, r0, m, c, 0);
    for (int64_t i = 0; i < m; ++i, xr += c) {
      for (int64_t j = 0; j < c; ++j) acc[j] += static_cast<double>(xr[j]);
    }
  });
  std::vector<double> mu(c);
  for (int64_t j = 0; j < c; ++j) mu[j] = sums[j] / static_cast<double>(n);
  const auto squares = column_sums(n, c, 1, [&](int64_t r0, int64_t m, double* acc) {
    const float* xr = load_rows(x, format, r0, m, c, 0);
    for (int64_t i = 0; i < m; ++i, xr += c) {
      for (int64_t j = 0; j < c; ++j) {
        const double d = static_cast<double>(xr[j]) - mu[j];
        acc[j] += d * d;
      }
    }
  });
  // y = (x - mean) * scale + bias: the centring first, so features far from
  // zero keep their precision (x * scale + shift would cancel).
  std::vector<float> scale(c);
  for (int64_t j = 0; j < c; ++j) {
    const double v = squares[j] / static_cast<double>(n);
    scale[j] = static_cast<float>(static_cast<double>(weight[j]) /
                                  std::sqrt(v + static_cast<double>(eps)));
    mean[j] = static_cast<float>(mu[j]);
    var[j] = static_cast<float>(v);
  }
  const int64_t blocks = (n + kNormBlockRows - 1) / kNormBlockRows;
  parallel_for(blocks, [&](int64_t b) {
    const int64_t r0 = b * kNormBlockRows;
    const int64_t m = std::min(kNormBlockRows, n - r0);
    const float* xr = load_rows(x, format, r0, m, c, 0);
    float* yr = out_rows(y, format, r0, c, m);
    for (int64_t i = 0; i < m * c; i += c) {
      for (int64_t j = 0; j < c; ++j) {
        const float v = (xr[i + j] - mean[j]) * scale[j] + bias[j];
        yr[i + j] = relu ? std::max(v, 0.0f) : v;
      }
    }
    store_rows(yr, y, format, r0, m, c);
  });
}

void batch_norm_backward(const void* g, const void* x, const void* y, FloatFormat format,
                         int64_t n, int64_t c, const float* weight, const float* mean,
                         const float* var, float eps, bool relu, void* dx, float* dweight,
                         float* dbias) {
  // The masked cotangent of block rows (relu: g where y > 0, else 0).
  auto masked = [&](int64_t r0, int64_t m) {
    const float* gr = load_rows(g, format, r0, m, c, 1);
    if (!relu) return gr;
    const float* yr = load_rows(y, format, r0, m, c, 2);
    thread_local std::vector<float> buffer;
    if (static_cast<int64_t>(buffer.size()) < m * c) buffer.resize(m * c);
    for (int64_t i = 0; i < m * c; ++i) buffer[i] = yr[i] > 0.0f ? gr[i] : 0.0f;
    return static_cast<const float*>(buffer.data());
  };
  // sum(g) and sum(g * (x - mean)) per column, interleaved in acc.
  const auto sums = column_sums(n, c, 2, [&](int64_t r0, int64_t m, double* acc) {
    const float* gr = masked(r0, m);
    const float* xr = load_rows(x, format, r0, m, c, 0);
    for (int64_t i = 0; i < m * c; i += c) {
      for (int64_t j = 0; j < c; ++j) {
        const double gv = static_cast<double>(gr[i + j]);
        acc[j] += gv;
        acc[c + j] += gv * (static_cast<double>(xr[i + j]) - static_cast<double>(mean[j]));
      }
    }
  });
  // dx = a * (g - mean(g)) + k * (x - mean): a = w * rstd,
  // k = -a * rstd * dweight / n (the mean of g * xhat subtracted), with the
  // centred forms so nothing cancels.
  std::vector<float> a(c), k(c), d(c);
  const double inv_n = 1.0 / static_cast<double>(n);
  for (int64_t j = 0; j < c; ++j) {
    const double rstd = 1.0 / std::sqrt(static_cast<double>(var[j]) + static_cast<double>(eps));
    const double db = sums[j];
    const double dw = sums[c + j] * rstd;
    const double aj = static_cast<double>(weight[j]) * rstd;
    dbias[j] = static_cast<float>(db);
    dweight[j] = static_cast<float>(dw);
    a[j] = static_cast<float>(aj);
    k[j] = static_cast<float>(-aj * rstd * dw * inv_n);
    d[j] = static_cast<float>(db * inv_n);
  }
  const int64_t blocks = (n + kNormBlockRows - 1) / kNormBlockRows;
  parallel_for(blocks, [&](int64_t b) {
    const int64_t r0 = b * kNormBlockRows;
    const int64_t m = std::min(kNormBlockRows, n - r0);
    const float* gr = masked(r0, m);
    const float* xr = load_rows(x, format, r0, m, c, 0);
    float* out = out_rows(dx, format, r0, c, m);
    for (int64_t i = 0; i < m * c; i += c) {
      for (int64_t j = 0; j < c; ++j) {
        out[i + j] = a[j] * (gr[i + j] - d[j]) + k[j] * (xr[i + j] - mean[j]);
      }
    }
    store_rows(out, dx, format, r0, m, c);
  });
}

}  // namespace mlx_lattice::kernels
