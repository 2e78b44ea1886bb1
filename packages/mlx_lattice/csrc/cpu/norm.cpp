// Batch norm kernels (norm.h): blocks of rows over the thread pool, double
// partial sums per block reduced in block order.
#include "norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "isa.h"
#include "parallel.h"
#include "tiles.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLX_LATTICE_NORM_AVX2 1
#endif

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


// The per-block loops. Every path keeps each channel's order of operations:
// the reductions add a block's rows in row order into one double per
// channel (vector paths run across channels, never across rows), and the
// elementwise maps round each float32 multiply and add separately.

// acc[j] += x[i][j] over the block's m rows.
void sum_rows_scalar(const float* xr, int64_t m, int64_t c, double* acc) {
  for (int64_t i = 0; i < m; ++i, xr += c) {
    for (int64_t j = 0; j < c; ++j) acc[j] += static_cast<double>(xr[j]);
  }
}

// acc[j] += (x[i][j] - mu[j])^2 in double.
void square_rows_scalar(const float* xr, int64_t m, int64_t c, const double* mu, double* acc) {
  for (int64_t i = 0; i < m; ++i, xr += c) {
    for (int64_t j = 0; j < c; ++j) {
      const double d = static_cast<double>(xr[j]) - mu[j];
      acc[j] += d * d;
    }
  }
}

// y = [relu]((x - mean) * scale + bias) over m * c elements.
void affine_rows_scalar(const float* xr, int64_t mc, int64_t c, const float* mean,
                        const float* scale, const float* bias, bool relu, float* yr) {
  for (int64_t i = 0; i < mc; i += c) {
    for (int64_t j = 0; j < c; ++j) {
      const float v = (xr[i + j] - mean[j]) * scale[j] + bias[j];
      yr[i + j] = relu ? std::max(v, 0.0f) : v;
    }
  }
}

// The masked cotangent: g where y > 0 (relu; yr non-null), else g.
inline float masked_scalar(const float* gr, const float* yr, int64_t e) {
  return yr == nullptr || yr[e] > 0.0f ? gr[e] : 0.0f;
}

// acc[j] += g, acc[c + j] += g * (x - mean) (g masked by y > 0 when yr).
void grad_sums_scalar(const float* gr, const float* yr, const float* xr, int64_t m, int64_t c,
                      const float* mean, double* acc) {
  for (int64_t i = 0; i < m * c; i += c) {
    for (int64_t j = 0; j < c; ++j) {
      const double gv = static_cast<double>(masked_scalar(gr, yr, i + j));
      acc[j] += gv;
      acc[c + j] += gv * (static_cast<double>(xr[i + j]) - static_cast<double>(mean[j]));
    }
  }
}

// dx = a * (g - d) + k * (x - mean) over m * c elements (g masked as above).
void grad_map_scalar(const float* gr, const float* yr, const float* xr, int64_t mc, int64_t c,
                     const float* a, const float* d, const float* k, const float* mean,
                     float* out) {
  for (int64_t i = 0; i < mc; i += c) {
    for (int64_t j = 0; j < c; ++j) {
      out[i + j] = a[j] * (masked_scalar(gr, yr, i + j) - d[j]) + k[j] * (xr[i + j] - mean[j]);
    }
  }
}

#if defined(MLX_LATTICE_NORM_AVX2)
// AVX2 without FMA (the target names no fma, so nothing can contract): G
// groups of 4 channels held in double accumulators over all the block's
// rows, then 4-channel groups, then the channels left one at a time.

#define NORM_AVX2 __attribute__((target("avx2")))

template <int G>
NORM_AVX2 inline void sum_columns_avx2(const float* xr, int64_t m, int64_t c, int64_t j,
                                       double* acc) {
  __m256d s[G];
  for (int g = 0; g < G; ++g) s[g] = _mm256_loadu_pd(acc + j + 4 * g);
  const float* p = xr + j;
  for (int64_t i = 0; i < m; ++i, p += c) {
    for (int g = 0; g < G; ++g) {
      s[g] = _mm256_add_pd(s[g], _mm256_cvtps_pd(_mm_loadu_ps(p + 4 * g)));
    }
  }
  for (int g = 0; g < G; ++g) _mm256_storeu_pd(acc + j + 4 * g, s[g]);
}

NORM_AVX2 void sum_rows_avx2(const float* xr, int64_t m, int64_t c, double* acc) {
  int64_t j = 0;
  for (; j + 32 <= c; j += 32) sum_columns_avx2<8>(xr, m, c, j, acc);
  for (; j + 4 <= c; j += 4) sum_columns_avx2<1>(xr, m, c, j, acc);
  for (; j < c; ++j) {
    double s = acc[j];
    for (int64_t i = 0; i < m; ++i) s += static_cast<double>(xr[i * c + j]);
    acc[j] = s;
  }
}

template <int G>
NORM_AVX2 inline void square_columns_avx2(const float* xr, int64_t m, int64_t c, int64_t j,
                                          const double* mu, double* acc) {
  __m256d s[G], u[G];
  for (int g = 0; g < G; ++g) {
    s[g] = _mm256_loadu_pd(acc + j + 4 * g);
    u[g] = _mm256_loadu_pd(mu + j + 4 * g);
  }
  const float* p = xr + j;
  for (int64_t i = 0; i < m; ++i, p += c) {
    for (int g = 0; g < G; ++g) {
      const __m256d d = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(p + 4 * g)), u[g]);
      s[g] = _mm256_add_pd(s[g], _mm256_mul_pd(d, d));
    }
  }
  for (int g = 0; g < G; ++g) _mm256_storeu_pd(acc + j + 4 * g, s[g]);
}

NORM_AVX2 void square_rows_avx2(const float* xr, int64_t m, int64_t c, const double* mu,
                                double* acc) {
  int64_t j = 0;
  for (; j + 24 <= c; j += 24) square_columns_avx2<6>(xr, m, c, j, mu, acc);
  for (; j + 4 <= c; j += 4) square_columns_avx2<1>(xr, m, c, j, mu, acc);
  for (; j < c; ++j) {
    double s = acc[j];
    for (int64_t i = 0; i < m; ++i) {
      const double d = static_cast<double>(xr[i * c + j]) - mu[j];
      s += d * d;
    }
    acc[j] = s;
  }
}

NORM_AVX2 void affine_rows_avx2(const float* xr, int64_t mc, int64_t c, const float* mean,
                                const float* scale, const float* bias, bool relu, float* yr) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < mc; i += c) {
    int64_t j = 0;
    for (; j + 8 <= c; j += 8) {
      const __m256 centred = _mm256_sub_ps(_mm256_loadu_ps(xr + i + j), _mm256_loadu_ps(mean + j));
      __m256 v = _mm256_add_ps(_mm256_mul_ps(centred, _mm256_loadu_ps(scale + j)),
                               _mm256_loadu_ps(bias + j));
      // max_ps(0, v) is (0 > v ? 0 : v): std::max(v, 0.0f) for NaN and -0.
      if (relu) v = _mm256_max_ps(zero, v);
      _mm256_storeu_ps(yr + i + j, v);
    }
    for (; j < c; ++j) {
      const float v = (xr[i + j] - mean[j]) * scale[j] + bias[j];
      yr[i + j] = relu ? std::max(v, 0.0f) : v;
    }
  }
}

// Four masked cotangents as floats: g where y > 0 (ordered: NaN y gives 0).
NORM_AVX2 inline __m128 masked4_avx2(const float* gr, const float* yr, int64_t e) {
  const __m128 g = _mm_loadu_ps(gr + e);
  if (yr == nullptr) return g;
  return _mm_and_ps(_mm_cmp_ps(_mm_loadu_ps(yr + e), _mm_setzero_ps(), _CMP_GT_OQ), g);
}

template <int G>
NORM_AVX2 inline void grad_columns_avx2(const float* gr, const float* yr, const float* xr,
                                        int64_t m, int64_t c, int64_t j, const float* mean,
                                        double* acc) {
  __m256d sg[G], sx[G], u[G];
  for (int g = 0; g < G; ++g) {
    sg[g] = _mm256_loadu_pd(acc + j + 4 * g);
    sx[g] = _mm256_loadu_pd(acc + c + j + 4 * g);
    u[g] = _mm256_cvtps_pd(_mm_loadu_ps(mean + j + 4 * g));
  }
  for (int64_t e = j; e < m * c; e += c) {
    for (int g = 0; g < G; ++g) {
      const __m256d gv = _mm256_cvtps_pd(masked4_avx2(gr, yr, e + 4 * g));
      const __m256d xc = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(xr + e + 4 * g)), u[g]);
      sg[g] = _mm256_add_pd(sg[g], gv);
      sx[g] = _mm256_add_pd(sx[g], _mm256_mul_pd(gv, xc));
    }
  }
  for (int g = 0; g < G; ++g) {
    _mm256_storeu_pd(acc + j + 4 * g, sg[g]);
    _mm256_storeu_pd(acc + c + j + 4 * g, sx[g]);
  }
}

NORM_AVX2 void grad_sums_avx2(const float* gr, const float* yr, const float* xr, int64_t m,
                              int64_t c, const float* mean, double* acc) {
  int64_t j = 0;
  for (; j + 16 <= c; j += 16) grad_columns_avx2<4>(gr, yr, xr, m, c, j, mean, acc);
  for (; j + 4 <= c; j += 4) grad_columns_avx2<1>(gr, yr, xr, m, c, j, mean, acc);
  for (; j < c; ++j) {
    double sg = acc[j], sx = acc[c + j];
    for (int64_t e = j; e < m * c; e += c) {
      const double gv = static_cast<double>(masked_scalar(gr, yr, e));
      sg += gv;
      sx += gv * (static_cast<double>(xr[e]) - static_cast<double>(mean[j]));
    }
    acc[j] = sg;
    acc[c + j] = sx;
  }
}

NORM_AVX2 void grad_map_avx2(const float* gr, const float* yr, const float* xr, int64_t mc,
                             int64_t c, const float* a, const float* d, const float* k,
                             const float* mean, float* out) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < mc; i += c) {
    int64_t j = 0;
    for (; j + 8 <= c; j += 8) {
      __m256 g = _mm256_loadu_ps(gr + i + j);
      if (yr != nullptr) {
        g = _mm256_and_ps(_mm256_cmp_ps(_mm256_loadu_ps(yr + i + j), zero, _CMP_GT_OQ), g);
      }
      const __m256 left = _mm256_mul_ps(_mm256_loadu_ps(a + j),
                                        _mm256_sub_ps(g, _mm256_loadu_ps(d + j)));
      const __m256 right = _mm256_mul_ps(
          _mm256_loadu_ps(k + j), _mm256_sub_ps(_mm256_loadu_ps(xr + i + j), _mm256_loadu_ps(mean + j)));
      _mm256_storeu_ps(out + i + j, _mm256_add_ps(left, right));
    }
    for (; j < c; ++j) {
      out[i + j] = a[j] * (masked_scalar(gr, yr, i + j) - d[j]) + k[j] * (xr[i + j] - mean[j]);
    }
  }
}

#undef NORM_AVX2
#endif  // MLX_LATTICE_NORM_AVX2

// One path's block loops, chosen once per call.
struct NormPath {
  void (*sum_rows)(const float*, int64_t, int64_t, double*);
  void (*square_rows)(const float*, int64_t, int64_t, const double*, double*);
  void (*affine_rows)(const float*, int64_t, int64_t, const float*, const float*, const float*,
                      bool, float*);
  void (*grad_sums)(const float*, const float*, const float*, int64_t, int64_t, const float*,
                    double*);
  void (*grad_map)(const float*, const float*, const float*, int64_t, int64_t, const float*,
                   const float*, const float*, const float*, float*);
};

// AVX2 where the CPU has it and MLX_LATTICE_GEMM_ISA allows it (the avx2-fma
// level; these loops use no FMA), else the scalar loops (aarch64 included).
NormPath norm_path() {
#if defined(MLX_LATTICE_NORM_AVX2)
  if (isa::isa_usable(isa::Isa::kAvx2)) {
    return {sum_rows_avx2, square_rows_avx2, affine_rows_avx2, grad_sums_avx2, grad_map_avx2};
  }
#endif
  return {sum_rows_scalar, square_rows_scalar, affine_rows_scalar, grad_sums_scalar,
          grad_map_scalar};
}

}  // namespace

void batch_norm_forward(const void* x, FloatFormat format, int64_t n, int64_t c,
                        const float* weight, const float* bias, float eps, bool relu, void* y,
                        float* mean, float* var) {
  const NormPath path = norm_path();
  const auto sums = column_sums(n, c, 1, [&](int64_t r0, int64_t m, double* acc) {
    path.sum_rows(load_rows(x, format, r0, m, c, 0), m, c, acc);
  });
  std::vector<double> mu(c);
  for (int64_t j = 0; j < c; ++j) mu[j] = sums[j] / static_cast<double>(n);
  const auto squares = column_sums(n, c, 1, [&](int64_t r0, int64_t m, double* acc) {
    path.square_rows(load_rows(x, format, r0, m, c, 0), m, c, mu.data(), acc);
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
    path.affine_rows(xr, m * c, c, mean, scale.data(), bias, relu, yr);
    store_rows(yr, y, format, r0, m, c);
  });
}

void batch_norm_backward(const void* g, const void* x, const void* y, FloatFormat format,
                         int64_t n, int64_t c, const float* weight, const float* mean,
                         const float* var, float eps, bool relu, void* dx, float* dweight,
                         float* dbias) {
  const NormPath path = norm_path();
  // The cotangent g passes where y > 0 (relu) or everywhere: the loops take
  // y's block rows (null without relu) and mask as they read.
  auto y_rows = [&](int64_t r0, int64_t m) -> const float* {
    return relu ? load_rows(y, format, r0, m, c, 2) : nullptr;
  };
  // sum(g) and sum(g * (x - mean)) per column, interleaved in acc.
  const auto sums = column_sums(n, c, 2, [&](int64_t r0, int64_t m, double* acc) {
    path.grad_sums(load_rows(g, format, r0, m, c, 1), y_rows(r0, m),
                   load_rows(x, format, r0, m, c, 0), m, c, mean, acc);
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
    const float* gr = load_rows(g, format, r0, m, c, 1);
    const float* yr = y_rows(r0, m);
    const float* xr = load_rows(x, format, r0, m, c, 0);
    float* out = out_rows(dx, format, r0, c, m);
    path.grad_map(gr, yr, xr, m * c, c, a.data(), d.data(), k.data(), mean, out);
    store_rows(out, dx, format, r0, m, c);
  });
}

}  // namespace mlx_lattice::kernels
