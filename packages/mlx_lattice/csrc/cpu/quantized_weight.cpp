// The dequantization of mx.quantize's group-affine weights to float32.
#include "quantized_weight.h"

#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLX_LATTICE_X86 1
#endif

#include "isa.h"
#include "parallel.h"

namespace mlx_lattice::kernels {

namespace {

// One offset's codes re-laid out as (cin, cout) bytes, its scales and
// biases as (groups, cout): its panel then dequantizes with contiguous
// vector loads. Per-thread scratch.
struct Codes {
  std::vector<uint8_t> q;
  std::vector<float> s;
  std::vector<float> b;
};

thread_local Codes offset_codes;

void unpack_offset(const QuantizedWeightView& w, int64_t k, int64_t cin, int64_t cout,
                   Codes& out) {
  const int64_t groups = w.storage_in / w.group_size;
  out.q.resize(cin * cout);
  out.s.resize(groups * cout);
  out.b.resize(groups * cout);
  for (int64_t o = 0; o < cout; ++o) {
    const int64_t row = k * cout + o;
    const uint8_t* p = w.packed + row * w.row_bytes;
    for (int64_t c = 0; c < cin; ++c) {
      out.q[c * cout + o] = static_cast<uint8_t>(unpack_code(p, w.row_bytes, c, w.bits));
    }
    for (int64_t g = 0; g < groups; ++g) {
      out.s[g * cout + o] = w.scales[row * groups + g];
      out.b[g * cout + o] = w.biases[row * groups + g];
    }
  }
}

// panel[c, x] = s[g, x] * q[c, x] + b[g, x] (g = c / group), rounded after
// the product and after the sum (no contraction into an FMA).
MLX_LATTICE_NO_CONTRACT void dequantize_panel_scalar(const uint8_t* q, const float* s,
                                                     const float* b, int64_t cin, int64_t cout,
                                                     int64_t group, float* panel) {
  MLX_LATTICE_NO_CONTRACT_BODY
  for (int64_t c = 0; c < cin; ++c) {
    const float* sg = s + (c / group) * cout;
    const float* bg = b + (c / group) * cout;
    for (int64_t x = 0; x < cout; ++x) {
      panel[c * cout + x] = sg[x] * static_cast<float>(q[c * cout + x]) + bg[x];
    }
  }
}

#ifdef MLX_LATTICE_X86
__attribute__((target("avx512f"))) void dequantize_panel_avx512(const uint8_t* q, const float* s,
                                                                const float* b, int64_t cin,
                                                                int64_t cout, int64_t group,
                                                                float* panel) {
  for (int64_t c = 0; c < cin; ++c) {
    const float* sg = s + (c / group) * cout;
    const float* bg = b + (c / group) * cout;
    const uint8_t* qc = q + c * cout;
    float* pc = panel + c * cout;
    int64_t x = 0;
    for (; x + 16 <= cout; x += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qc + x));
      // (Zero-masked forms, all lanes: GCC 12 reports the plain forms'
      // undefined pass-through operand as "may be used uninitialized".)
      const __m512 codes =
          _mm512_maskz_cvtepi32_ps(0xffff, _mm512_maskz_cvtepu8_epi32(0xffff, bytes));
      __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sg + x), codes);
      asm("" : "+v"(v));  // no fused multiply-add: the product rounds on its own
      _mm512_storeu_ps(pc + x, _mm512_add_ps(v, _mm512_loadu_ps(bg + x)));
    }
    for (; x < cout; ++x) pc[x] = sg[x] * static_cast<float>(qc[x]) + bg[x];
  }
}
#endif

}  // namespace

void dequantize_weight_panels(const QuantizedWeightView& weight, int64_t n_kernels, int64_t cin,
                              int64_t cout, float* out) {
  auto dequantize = dequantize_panel_scalar;
#ifdef MLX_LATTICE_X86
  if (isa::isa_usable(isa::Isa::kAvx512)) dequantize = dequantize_panel_avx512;
#endif
  parallel_for(n_kernels, [&](int64_t k) {
    Codes& c = this_thread(offset_codes);
    unpack_offset(weight, k, cin, cout, c);
    dequantize(c.q.data(), c.s.data(), c.b.data(), cin, cout, weight.group_size,
               out + k * cin * cout);
  });
}

}  // namespace mlx_lattice::kernels
