// Batch norm kernels (norm.h): blocks of rows over the thread pool, double
// partial sums per block reduced in block order.
#include "norm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "parallel.h"
#include "float_formats.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLX_LATTICE_NORM_AVX2 1
#endif

namespace mlx_lattice::kernels {

namespace {

int64_t element_bytes(FloatFormat format) { return format == FloatFormat::kF32 ? 4 : 2; }

// Rows [r0, r0 + m) of an (n, c) array in `format` as the loops of format
// `loops` read them: its own data when the formats agree, else (loops in
// float32) a converted copy in the calling thread's buffer `slot`.
const void* load_rows(const void* src, FloatFormat format, FloatFormat loops, int64_t r0,
                      int64_t m, int64_t c, int slot) {
  const int64_t offset = r0 * c * element_bytes(format);
  if (format == loops) return static_cast<const char*>(src) + offset;
  thread_local std::vector<float> buffers[4];
  auto& b = buffers[slot];
  if (static_cast<int64_t>(b.size()) < m * c) b.resize(m * c);
  convert_to_float32(static_cast<const char*>(src) + offset, format, m * c, b.data());
  return b.data();
}

// Where the loops write rows [r0, r0 + m): dst itself when the formats
// agree, else a float32 buffer that store_rows converts into dst.
void* out_rows(void* dst, FloatFormat format, FloatFormat loops, int64_t r0, int64_t c,
               int64_t m) {
  if (format == loops) return static_cast<char*>(dst) + r0 * c * element_bytes(format);
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < m * c) buffer.resize(m * c);
  return buffer.data();
}

void store_rows(const void* rows, void* dst, FloatFormat format, FloatFormat loops, int64_t r0,
                int64_t m, int64_t c) {
  if (format == loops) return;
  convert_from_float32(static_cast<const float*>(rows), m * c, format,
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

// The scalar loops read and write float32 rows (half-precision data reaches
// them as converted copies).

// acc[j] += x[i][j] over the block's m rows.
void sum_rows_scalar(const void* x, int64_t m, int64_t c, double* acc) {
  const float* xr = static_cast<const float*>(x);
  for (int64_t i = 0; i < m; ++i, xr += c) {
    for (int64_t j = 0; j < c; ++j) acc[j] += static_cast<double>(xr[j]);
  }
}

// acc[j] += (x[i][j] - mu[j])^2 in double.
void square_rows_scalar(const void* x, int64_t m, int64_t c, const double* mu, double* acc) {
  const float* xr = static_cast<const float*>(x);
  for (int64_t i = 0; i < m; ++i, xr += c) {
    for (int64_t j = 0; j < c; ++j) {
      const double d = static_cast<double>(xr[j]) - mu[j];
      acc[j] += d * d;
    }
  }
}

// y = [relu]((x - mean) * scale + bias) over m * c elements.
void affine_rows_scalar(const void* x, int64_t mc, int64_t c, const float* mean,
                        const float* scale, const float* bias, bool relu, void* y) {
  const float* xr = static_cast<const float*>(x);
  float* yr = static_cast<float*>(y);
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

// acc[j] += g, acc[c + j] += g * (x - mean) (g masked by y > 0 when y).
void grad_sums_scalar(const void* g, const void* y, const void* x, int64_t m, int64_t c,
                      const float* mean, double* acc) {
  const float* gr = static_cast<const float*>(g);
  const float* yr = static_cast<const float*>(y);
  const float* xr = static_cast<const float*>(x);
  for (int64_t i = 0; i < m * c; i += c) {
    for (int64_t j = 0; j < c; ++j) {
      const double gv = static_cast<double>(masked_scalar(gr, yr, i + j));
      acc[j] += gv;
      acc[c + j] += gv * (static_cast<double>(xr[i + j]) - static_cast<double>(mean[j]));
    }
  }
}

// dx = a * (g - d) + k * (x - mean) over m * c elements (g masked as above).
void grad_map_scalar(const void* g, const void* y, const void* x, int64_t mc, int64_t c,
                     const float* a, const float* d, const float* k, const float* mean,
                     void* dx) {
  const float* gr = static_cast<const float*>(g);
  const float* yr = static_cast<const float*>(y);
  const float* xr = static_cast<const float*>(x);
  float* out = static_cast<float*>(dx);
  for (int64_t i = 0; i < mc; i += c) {
    for (int64_t j = 0; j < c; ++j) {
      out[i + j] = a[j] * (masked_scalar(gr, yr, i + j) - d[j]) + k[j] * (xr[i + j] - mean[j]);
    }
  }
}

#if defined(MLX_LATTICE_NORM_AVX2)
// AVX2 without FMA (the target names no fma, so nothing can contract). The
// reductions over rows of up to kRowMajorAbove channels hold G groups of 4
// channels in double accumulators over all the block's rows, then 4-channel
// groups, then the channels left one at a time; wider rows go row by row.
//
// Each loop is instantiated per element format F and reads and writes rows
// in F: float16 widened by vcvtph2ps and rounded by vcvtps2ph (nearest
// even), bfloat16 widened by a shift and rounded as convert_from_float32
// does. The widened values are the ones a float32 copy would hold, so every
// format runs the float32 arithmetic in the same order.

#define NORM_AVX2 __attribute__((target("avx2,f16c")))

// Wider rows than this are reduced row by row (all channels of a row, the
// accumulators in memory): the column passes of the loops below would walk
// the block once per channel group with a stride of one row, which the
// prefetchers serve poorly. Each channel's additions keep their order.
inline constexpr int64_t kRowMajorAbove = 16;

template <FloatFormat F>
using Elem = std::conditional_t<F == FloatFormat::kF32, float, uint16_t>;

template <FloatFormat F>
NORM_AVX2 inline __m128 load4(const Elem<F>* p) {
  if constexpr (F == FloatFormat::kF32) {
    return _mm_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    if constexpr (F == FloatFormat::kF16) return _mm_cvtph_ps(h);
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
  }
}

template <FloatFormat F>
NORM_AVX2 inline __m256 load8(const Elem<F>* p) {
  if constexpr (F == FloatFormat::kF32) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (F == FloatFormat::kF16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <FloatFormat F>
NORM_AVX2 inline float load1(const Elem<F>* p) {
  if constexpr (F == FloatFormat::kF32) {
    return *p;
  } else if constexpr (F == FloatFormat::kF16) {
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(*p)));
  } else {
    return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(static_cast<int>(*p) << 16)));
  }
}

// float_to_bfloat on 8 lanes: NaN keeps its top half, quieted; the rest
// rounds to nearest even.
NORM_AVX2 inline __m128i bfloat8(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i top = _mm256_srli_epi32(x, 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                        _mm256_and_si256(top, _mm256_set1_epi32(1)));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(x, bias), 16);
  const __m256i quiet = _mm256_or_si256(top, _mm256_set1_epi32(0x40));
  const __m256i bits = _mm256_blendv_epi8(rounded, quiet, nan);
  // Lanes are 0..0xffff, so the unsigned pack is exact; keep its qwords 0, 2.
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08));
}

template <FloatFormat F>
NORM_AVX2 inline void store8(Elem<F>* p, __m256 v) {
  if constexpr (F == FloatFormat::kF32) {
    _mm256_storeu_ps(p, v);
  } else if constexpr (F == FloatFormat::kF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bfloat8(v));
  }
}

template <FloatFormat F>
NORM_AVX2 inline void store1(Elem<F>* p, float v) {
  if constexpr (F == FloatFormat::kF32) {
    *p = v;
  } else if constexpr (F == FloatFormat::kF16) {
    *p = static_cast<uint16_t>(
        _mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(v), _MM_FROUND_TO_NEAREST_INT), 0));
  } else {
    *p = static_cast<uint16_t>(_mm_extract_epi16(bfloat8(_mm256_set1_ps(v)), 0));
  }
}

template <FloatFormat F, int G>
NORM_AVX2 inline void sum_columns_avx2(const Elem<F>* xr, int64_t m, int64_t c, int64_t j,
                                       double* acc) {
  __m256d s[G];
  for (int g = 0; g < G; ++g) s[g] = _mm256_loadu_pd(acc + j + 4 * g);
  const Elem<F>* p = xr + j;
  for (int64_t i = 0; i < m; ++i, p += c) {
    for (int g = 0; g < G; ++g) {
      s[g] = _mm256_add_pd(s[g], _mm256_cvtps_pd(load4<F>(p + 4 * g)));
    }
  }
  for (int g = 0; g < G; ++g) _mm256_storeu_pd(acc + j + 4 * g, s[g]);
}

template <FloatFormat F>
NORM_AVX2 void sum_rows_avx2(const void* x, int64_t m, int64_t c, double* acc) {
  const Elem<F>* xr = static_cast<const Elem<F>*>(x);
  if (c > kRowMajorAbove) {
    for (int64_t i = 0; i < m; ++i, xr += c) {
      int64_t j = 0;
      for (; j + 4 <= c; j += 4) {
        _mm256_storeu_pd(acc + j, _mm256_add_pd(_mm256_loadu_pd(acc + j),
                                                _mm256_cvtps_pd(load4<F>(xr + j))));
      }
      for (; j < c; ++j) acc[j] += static_cast<double>(load1<F>(xr + j));
    }
    return;
  }
  int64_t j = 0;
  for (; j + 32 <= c; j += 32) sum_columns_avx2<F, 8>(xr, m, c, j, acc);
  for (; j + 4 <= c; j += 4) sum_columns_avx2<F, 1>(xr, m, c, j, acc);
  for (; j < c; ++j) {
    double s = acc[j];
    for (int64_t i = 0; i < m; ++i) s += static_cast<double>(load1<F>(xr + i * c + j));
    acc[j] = s;
  }
}

template <FloatFormat F, int G>
NORM_AVX2 inline void square_columns_avx2(const Elem<F>* xr, int64_t m, int64_t c, int64_t j,
                                          const double* mu, double* acc) {
  __m256d s[G], u[G];
  for (int g = 0; g < G; ++g) {
    s[g] = _mm256_loadu_pd(acc + j + 4 * g);
    u[g] = _mm256_loadu_pd(mu + j + 4 * g);
  }
  const Elem<F>* p = xr + j;
  for (int64_t i = 0; i < m; ++i, p += c) {
    for (int g = 0; g < G; ++g) {
      const __m256d d = _mm256_sub_pd(_mm256_cvtps_pd(load4<F>(p + 4 * g)), u[g]);
      s[g] = _mm256_add_pd(s[g], _mm256_mul_pd(d, d));
    }
  }
  for (int g = 0; g < G; ++g) _mm256_storeu_pd(acc + j + 4 * g, s[g]);
}

template <FloatFormat F>
NORM_AVX2 void square_rows_avx2(const void* x, int64_t m, int64_t c, const double* mu,
                                double* acc) {
  const Elem<F>* xr = static_cast<const Elem<F>*>(x);
  if (c > kRowMajorAbove) {
    for (int64_t i = 0; i < m; ++i, xr += c) {
      int64_t j = 0;
      for (; j + 4 <= c; j += 4) {
        const __m256d d = _mm256_sub_pd(_mm256_cvtps_pd(load4<F>(xr + j)), _mm256_loadu_pd(mu + j));
        _mm256_storeu_pd(acc + j, _mm256_add_pd(_mm256_loadu_pd(acc + j), _mm256_mul_pd(d, d)));
      }
      for (; j < c; ++j) {
        const double d = static_cast<double>(load1<F>(xr + j)) - mu[j];
        acc[j] += d * d;
      }
    }
    return;
  }
  int64_t j = 0;
  for (; j + 24 <= c; j += 24) square_columns_avx2<F, 6>(xr, m, c, j, mu, acc);
  for (; j + 4 <= c; j += 4) square_columns_avx2<F, 1>(xr, m, c, j, mu, acc);
  for (; j < c; ++j) {
    double s = acc[j];
    for (int64_t i = 0; i < m; ++i) {
      const double d = static_cast<double>(load1<F>(xr + i * c + j)) - mu[j];
      s += d * d;
    }
    acc[j] = s;
  }
}

template <FloatFormat F>
NORM_AVX2 void affine_rows_avx2(const void* x, int64_t mc, int64_t c, const float* mean,
                                const float* scale, const float* bias, bool relu, void* y) {
  const Elem<F>* xr = static_cast<const Elem<F>*>(x);
  Elem<F>* yr = static_cast<Elem<F>*>(y);
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < mc; i += c) {
    int64_t j = 0;
    for (; j + 8 <= c; j += 8) {
      const __m256 centred = _mm256_sub_ps(load8<F>(xr + i + j), _mm256_loadu_ps(mean + j));
      __m256 v = _mm256_add_ps(_mm256_mul_ps(centred, _mm256_loadu_ps(scale + j)),
                               _mm256_loadu_ps(bias + j));
      // max_ps(0, v) is (0 > v ? 0 : v): std::max(v, 0.0f) for NaN and -0.
      if (relu) v = _mm256_max_ps(zero, v);
      store8<F>(yr + i + j, v);
    }
    for (; j < c; ++j) {
      const float v = (load1<F>(xr + i + j) - mean[j]) * scale[j] + bias[j];
      store1<F>(yr + i + j, relu ? std::max(v, 0.0f) : v);
    }
  }
}

// Four masked cotangents as floats: g where y > 0 (ordered: NaN y gives 0).
template <FloatFormat F>
NORM_AVX2 inline __m128 masked4_avx2(const Elem<F>* gr, const Elem<F>* yr, int64_t e) {
  const __m128 g = load4<F>(gr + e);
  if (yr == nullptr) return g;
  return _mm_and_ps(_mm_cmp_ps(load4<F>(yr + e), _mm_setzero_ps(), _CMP_GT_OQ), g);
}

template <FloatFormat F>
NORM_AVX2 inline float masked1(const Elem<F>* gr, const Elem<F>* yr, int64_t e) {
  return yr == nullptr || load1<F>(yr + e) > 0.0f ? load1<F>(gr + e) : 0.0f;
}

template <FloatFormat F, int G>
NORM_AVX2 inline void grad_columns_avx2(const Elem<F>* gr, const Elem<F>* yr,
                                        const Elem<F>* xr, int64_t m, int64_t c, int64_t j,
                                        const float* mean, double* acc) {
  __m256d sg[G], sx[G], u[G];
  for (int g = 0; g < G; ++g) {
    sg[g] = _mm256_loadu_pd(acc + j + 4 * g);
    sx[g] = _mm256_loadu_pd(acc + c + j + 4 * g);
    u[g] = _mm256_cvtps_pd(_mm_loadu_ps(mean + j + 4 * g));
  }
  for (int64_t e = j; e < m * c; e += c) {
    for (int g = 0; g < G; ++g) {
      const __m256d gv = _mm256_cvtps_pd(masked4_avx2<F>(gr, yr, e + 4 * g));
      const __m256d xc = _mm256_sub_pd(_mm256_cvtps_pd(load4<F>(xr + e + 4 * g)), u[g]);
      sg[g] = _mm256_add_pd(sg[g], gv);
      sx[g] = _mm256_add_pd(sx[g], _mm256_mul_pd(gv, xc));
    }
  }
  for (int g = 0; g < G; ++g) {
    _mm256_storeu_pd(acc + j + 4 * g, sg[g]);
    _mm256_storeu_pd(acc + c + j + 4 * g, sx[g]);
  }
}

template <FloatFormat F>
NORM_AVX2 void grad_sums_avx2(const void* g, const void* y, const void* x, int64_t m, int64_t c,
                              const float* mean, double* acc) {
  const Elem<F>* gr = static_cast<const Elem<F>*>(g);
  const Elem<F>* yr = static_cast<const Elem<F>*>(y);
  const Elem<F>* xr = static_cast<const Elem<F>*>(x);
  if (c > kRowMajorAbove) {
    std::vector<double> u(c);
    for (int64_t j = 0; j < c; ++j) u[j] = static_cast<double>(mean[j]);
    for (int64_t e = 0; e < m * c; e += c) {
      int64_t j = 0;
      for (; j + 4 <= c; j += 4) {
        const __m256d gv = _mm256_cvtps_pd(masked4_avx2<F>(gr, yr, e + j));
        const __m256d xc =
            _mm256_sub_pd(_mm256_cvtps_pd(load4<F>(xr + e + j)), _mm256_loadu_pd(u.data() + j));
        _mm256_storeu_pd(acc + j, _mm256_add_pd(_mm256_loadu_pd(acc + j), gv));
        _mm256_storeu_pd(acc + c + j,
                         _mm256_add_pd(_mm256_loadu_pd(acc + c + j), _mm256_mul_pd(gv, xc)));
      }
      for (; j < c; ++j) {
        const double gv = static_cast<double>(masked1<F>(gr, yr, e + j));
        acc[j] += gv;
        acc[c + j] += gv * (static_cast<double>(load1<F>(xr + e + j)) - u[j]);
      }
    }
    return;
  }
  int64_t j = 0;
  for (; j + 16 <= c; j += 16) grad_columns_avx2<F, 4>(gr, yr, xr, m, c, j, mean, acc);
  for (; j + 4 <= c; j += 4) grad_columns_avx2<F, 1>(gr, yr, xr, m, c, j, mean, acc);
  for (; j < c; ++j) {
    double sg = acc[j], sx = acc[c + j];
    for (int64_t e = j; e < m * c; e += c) {
      const double gv = static_cast<double>(masked1<F>(gr, yr, e));
      sg += gv;
      sx += gv * (static_cast<double>(load1<F>(xr + e)) - static_cast<double>(mean[j]));
    }
    acc[j] = sg;
    acc[c + j] = sx;
  }
}

template <FloatFormat F>
NORM_AVX2 void grad_map_avx2(const void* g, const void* y, const void* x, int64_t mc, int64_t c,
                             const float* a, const float* d, const float* k, const float* mean,
                             void* dx) {
  const Elem<F>* gr = static_cast<const Elem<F>*>(g);
  const Elem<F>* yr = static_cast<const Elem<F>*>(y);
  const Elem<F>* xr = static_cast<const Elem<F>*>(x);
  Elem<F>* out = static_cast<Elem<F>*>(dx);
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < mc; i += c) {
    int64_t j = 0;
    for (; j + 8 <= c; j += 8) {
      __m256 gv = load8<F>(gr + i + j);
      if (yr != nullptr) {
        gv = _mm256_and_ps(_mm256_cmp_ps(load8<F>(yr + i + j), zero, _CMP_GT_OQ), gv);
      }
      const __m256 left = _mm256_mul_ps(_mm256_loadu_ps(a + j),
                                        _mm256_sub_ps(gv, _mm256_loadu_ps(d + j)));
      const __m256 right = _mm256_mul_ps(
          _mm256_loadu_ps(k + j), _mm256_sub_ps(load8<F>(xr + i + j), _mm256_loadu_ps(mean + j)));
      store8<F>(out + i + j, _mm256_add_ps(left, right));
    }
    for (; j < c; ++j) {
      store1<F>(out + i + j, a[j] * (masked1<F>(gr, yr, i + j) - d[j]) +
                                 k[j] * (load1<F>(xr + i + j) - mean[j]));
    }
  }
}

#undef NORM_AVX2
#endif  // MLX_LATTICE_NORM_AVX2

// One path's block loops, chosen once per call, and the format of the rows
// they read and write (the data's own, or float32 over converted copies).
struct NormPath {
  FloatFormat rows;
  void (*sum_rows)(const void*, int64_t, int64_t, double*);
  void (*square_rows)(const void*, int64_t, int64_t, const double*, double*);
  void (*affine_rows)(const void*, int64_t, int64_t, const float*, const float*, const float*,
                      bool, void*);
  void (*grad_sums)(const void*, const void*, const void*, int64_t, int64_t, const float*,
                    double*);
  void (*grad_map)(const void*, const void*, const void*, int64_t, int64_t, const float*,
                   const float*, const float*, const float*, void*);
};

#if defined(MLX_LATTICE_NORM_AVX2)
template <FloatFormat F>
NormPath avx2_path() {
  return {F, sum_rows_avx2<F>, square_rows_avx2<F>, affine_rows_avx2<F>, grad_sums_avx2<F>,
          grad_map_avx2<F>};
}
#endif

// AVX2 where the CPU has it and MLX_LATTICE_GEMM_ISA allows it (the avx2-fma
// level; these loops use no FMA), else the scalar loops (aarch64 included).
// Half-precision rows go to the AVX2 loops in their own format when c is a
// multiple of 8 (float16 also needs F16C): every element then widens and
// rounds 8 at a time with the same instructions as convert_to_float32 and
// convert_from_float32, so the bits equal those of the float32 copies
// (whose scalar tails round NaN payloads differently). Other channel counts
// convert blocks of rows to float32 first.
NormPath norm_path(FloatFormat format, int64_t c) {
#if defined(MLX_LATTICE_NORM_AVX2)
  if (isa::isa_usable(isa::Isa::kAvx2)) {
    static const bool f16c = __builtin_cpu_supports("f16c");
    if (format == FloatFormat::kF16 && c % 8 == 0 && f16c) {
      return avx2_path<FloatFormat::kF16>();
    }
    if (format == FloatFormat::kBF16 && c % 8 == 0) return avx2_path<FloatFormat::kBF16>();
    return avx2_path<FloatFormat::kF32>();
  }
#else
  (void)format;
  (void)c;
#endif
  return {FloatFormat::kF32, sum_rows_scalar, square_rows_scalar, affine_rows_scalar,
          grad_sums_scalar, grad_map_scalar};
}

}  // namespace

void batch_norm_forward(const void* x, FloatFormat format, int64_t n, int64_t c,
                        const float* weight, const float* bias, float eps, bool relu, void* y,
                        float* mean, float* var) {
  const NormPath path = norm_path(format, c);
  const auto sums = column_sums(n, c, 1, [&](int64_t r0, int64_t m, double* acc) {
    path.sum_rows(load_rows(x, format, path.rows, r0, m, c, 0), m, c, acc);
  });
  std::vector<double> mu(c);
  for (int64_t j = 0; j < c; ++j) mu[j] = sums[j] / static_cast<double>(n);
  const auto squares = column_sums(n, c, 1, [&](int64_t r0, int64_t m, double* acc) {
    path.square_rows(load_rows(x, format, path.rows, r0, m, c, 0), m, c, mu.data(), acc);
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
  batch_norm_affine(x, format, n, c, mean, scale.data(), bias, relu, y);
}

void batch_norm_affine(const void* x, FloatFormat format, int64_t n, int64_t c, const float* mean,
                       const float* scale, const float* bias, bool relu, void* y) {
  const NormPath path = norm_path(format, c);
  parallel_for((n + kNormBlockRows - 1) / kNormBlockRows, [&](int64_t b) {
    const int64_t r0 = b * kNormBlockRows;
    const int64_t m = std::min(kNormBlockRows, n - r0);
    void* yr = out_rows(y, format, path.rows, r0, c, m);
    path.affine_rows(load_rows(x, format, path.rows, r0, m, c, 0), m * c, c, mean, scale, bias,
                     relu, yr);
    store_rows(yr, y, format, path.rows, r0, m, c);
  });
}

void batch_norm_backward(const void* g, const void* x, const void* y, FloatFormat format,
                         int64_t n, int64_t c, const float* weight, const float* mean,
                         const float* var, float eps, bool relu, void* dx, float* dweight,
                         float* dbias) {
  const NormPath path = norm_path(format, c);
  // The cotangent g passes where y > 0 (relu) or everywhere: the loops take
  // y's block rows (null without relu) and mask as they read.
  auto y_rows = [&](int64_t r0, int64_t m) -> const void* {
    return relu ? load_rows(y, format, path.rows, r0, m, c, 2) : nullptr;
  };
  // sum(g) and sum(g * (x - mean)) per column, interleaved in acc.
  const auto sums = column_sums(n, c, 2, [&](int64_t r0, int64_t m, double* acc) {
    path.grad_sums(load_rows(g, format, path.rows, r0, m, c, 1), y_rows(r0, m),
                   load_rows(x, format, path.rows, r0, m, c, 0), m, c, mean, acc);
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
    const void* gr = load_rows(g, format, path.rows, r0, m, c, 1);
    const void* yr = y_rows(r0, m);
    const void* xr = load_rows(x, format, path.rows, r0, m, c, 0);
    void* out = out_rows(dx, format, path.rows, r0, c, m);
    path.grad_map(gr, yr, xr, m * c, c, a.data(), d.data(), k.data(), mean, out);
    store_rows(out, dx, format, path.rows, r0, m, c);
  });
}

}  // namespace mlx_lattice::kernels
