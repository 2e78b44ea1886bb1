// The fused int8 convolution's epilogue (gemm_int8.h: int8_conv_fused,
// Int8Epilogue) on every driver, with no MLX: the AMX-INT8 row driver on
// the tile model (scalar and AVX-512 accumulation epilogues; the hardware
// where this host has AMX) and every int8 path the dispatch offers give
// the bits of the documented math computed here directly: int8_conv's
// float32 sums (the unfused kernel), then bias, a float32 or int8
// residual, ReLU and the int8 requantization or a float32 / bfloat16
// output. Float and int8 inputs (-128 among the codes; or non-negative
// but for some rows, as a ReLU's output, which the AVX2 kernel multiplies
// without sign instructions), rows without
// edges, a non-finite input row, channels off the vector widths.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "amx_model_drivers.h"
#include "float_formats.h"
#include "gemm_int8.h"
#include "isa.h"

namespace {

using namespace mlx_lattice;
using namespace mlx_lattice::kernels;

int failures = 0;

struct Case {
  int64_t n_in, n_out, cin, cout, group;
  int bits;
  bool int8_input, bias, relu;
  int residual;       // 0 none, 1 float32, 2 int8
  float out_scale;    // > 0: int8 output
  FloatFormat format; // float output
  bool relu_input = false;  // inputs >= 0 but in every 7th row (AVX2's unsigned form)
};

// The epilogue of one value, as gemm_int8.h documents it.
float epilogue(float acc, const Case& c, float bias, float res_f, int8_t res_q, float rs) {
  volatile float y = acc;
  if (c.bias) y = y + bias;
  if (c.residual == 1) y = y + res_f;
  if (c.residual == 2) {
    volatile float r = static_cast<float>(res_q) * rs;
    y = y + r;
  }
  if (c.relu && y < 0.0f) y = 0.0f;
  return y;
}

int8_t requantize(float y, float s) {
  const float v = y / s;
  if (std::isnan(v)) return 0;
  return static_cast<int8_t>(std::nearbyint(std::fmin(std::fmax(v, -127.0f), 127.0f)));
}

void run_case(std::mt19937& gen, const Case& c) {
  const int64_t storage_in = (c.cin + c.group - 1) / c.group * c.group;
  const int64_t groups = storage_in / c.group;
  const int64_t row_bytes = storage_in * c.bits / 8;
  const int64_t n_kernels = 5;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> f(std::max<int64_t>(1, c.n_in * c.cin));
  for (auto& v : f) v = nd(gen);
  std::vector<int8_t> codes(f.size());
  for (auto& v : codes) v = static_cast<int8_t>(gen());
  if (c.relu_input) {
    for (size_t i = 0; i < f.size(); ++i) {
      const bool keep_sign = (i / std::max<int64_t>(1, c.cin)) % 7 == 3;
      if (!keep_sign) {
        f[i] = std::fabs(f[i]);
        codes[i] = static_cast<int8_t>(static_cast<uint8_t>(codes[i]) & 0x7fu);
      }
    }
  }
  if (!c.int8_input && c.n_in > 2) f[2 * c.cin + 1] = INFINITY;
  std::vector<uint8_t> packed(n_kernels * c.cout * row_bytes);
  for (auto& v : packed) v = static_cast<uint8_t>(gen());
  std::vector<float> sc(n_kernels * c.cout * groups), bi(sc.size());
  for (auto& v : sc) v = 0.01f + 0.02f * std::fabs(nd(gen));
  for (auto& v : bi) v = -0.1f * std::fabs(nd(gen));
  std::vector<int32_t> offsets{0}, a_index, kid;
  for (int64_t o = 0; o < c.n_out; ++o) {
    const bool none = gen() % 5 == 0;
    for (int64_t k = 0; k < n_kernels && !none && c.n_in > 0; ++k) {
      if (gen() % 3 == 0) continue;
      a_index.push_back(static_cast<int32_t>(gen() % c.n_in));
      kid.push_back(static_cast<int32_t>(k));
    }
    offsets.push_back(static_cast<int32_t>(a_index.size()));
  }
  if (a_index.empty()) {
    a_index.push_back(0);
    kid.push_back(0);
  }
  Csr csr;
  csr.offsets = offsets.data();
  csr.groups = c.n_out;
  std::vector<float> bias(c.cout), res_f(std::max<int64_t>(1, c.n_out * c.cout));
  std::vector<int8_t> res_q(res_f.size());
  for (auto& v : bias) v = nd(gen);
  for (auto& v : res_f) v = nd(gen);
  for (auto& v : res_q) v = static_cast<int8_t>(gen() % 255 - 127);
  const float in_scale = 0.02f, rs = 0.013f;
  // The unfused sums: int8_conv on the codes as floats at in_scale
  // ((code * s) / s is within a few ulps of the code, so its rint is the
  // code again), -128 as -127.
  std::vector<float> x = f;
  if (c.int8_input) {
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = static_cast<float>(std::max<int8_t>(codes[i], -127)) * in_scale;
    }
  }
  std::vector<float> acc(std::max<int64_t>(1, c.n_out * c.cout));
  int8_conv(x.data(), c.n_in, c.cin, packed.data(), row_bytes, sc.data(), bi.data(), n_kernels,
            c.cout, storage_in, c.group, c.bits, in_scale, csr, a_index.data(), nullptr,
            kid.data(), acc.data());
  Int8Epilogue ep;
  ep.bias = c.bias ? bias.data() : nullptr;
  ep.residual = c.residual == 1 ? static_cast<const void*>(res_f.data())
                : c.residual == 2 ? static_cast<const void*>(res_q.data())
                                  : nullptr;
  ep.residual_int8 = c.residual == 2;
  ep.residual_scale = rs;
  ep.relu = c.relu;
  ep.out_scale = c.out_scale;
  ep.out_format = c.format;
  const int64_t n = c.n_out * c.cout;
  const size_t elem = c.out_scale > 0 ? 1 : c.format == FloatFormat::kF32 ? 4 : 2;
  std::vector<uint8_t> want(std::max<int64_t>(1, n) * elem), got(want.size());
  for (int64_t i = 0; i < n; ++i) {
    const float y = epilogue(acc[i], c, bias[i % c.cout], res_f[i], res_q[i], rs);
    if (c.out_scale > 0) {
      want[i] = static_cast<uint8_t>(requantize(y, c.out_scale));
    } else {
      convert_from_float32(&y, 1, c.format, want.data() + i * elem);
    }
  }
  const std::string name = "cin " + std::to_string(c.cin) + " cout " + std::to_string(c.cout) +
                           " group " + std::to_string(c.group) + " bits " +
                           std::to_string(c.bits) + (c.int8_input ? " int8-in" : " float-in") +
                           " residual " + std::to_string(c.residual) +
                           (c.relu ? " relu" : "") +
                           (c.out_scale > 0 ? " int8-out" : " float-out") +
                           (c.relu_input ? " relu-input" : "");
  auto check = [&](const std::string& path) {
    if (n > 0 && std::memcmp(got.data(), want.data(), n * elem) != 0) {
      ++failures;
      std::fprintf(stderr, "FAIL %s: %s\n", path.c_str(), name.c_str());
    }
  };
  const float* feats = c.int8_input ? nullptr : f.data();
  const int8_t* in8 = c.int8_input ? codes.data() : nullptr;
  auto rows = [&](Int8RowsFn fn, const char* path) {
    std::fill(got.begin(), got.end(), 0xAB);
    int8_conv_rows_fused(fn, feats, in8, c.n_in, c.cin, packed.data(), row_bytes, sc.data(),
                         bi.data(), n_kernels, c.cout, storage_in, c.group, c.bits, in_scale,
                         csr, a_index.data(), kid.data(), ep, got.data());
    check(path);
  };
  rows(amx_model::int8_rows_scalar, "model/scalar-epilogue");
#if defined(__x86_64__)
  if (isa::isa_supported(isa::Isa::kAvx512)) {
    rows(amx_model::int8_rows_avx512, "model/avx512-epilogue");
  }
#endif
  if (kAmxInt8RowsHw && isa::isa_supported(isa::Isa::kAmxInt8)) rows(kAmxInt8RowsHw, "hardware");
  // Each path packs the weight per call, takes it packed once
  // (pack_int8_weight: the fused op's cached form), and takes one packed
  // for the first path (another kernel's layout where the paths differ:
  // packed again, the same bits).
  std::shared_ptr<const PackedInt8Weight> first;
  for (isa::Isa level : {isa::Isa::kAmxInt8, isa::Isa::kAvx512Vnni, isa::Isa::kAvxVnni,
                         isa::Isa::kAvx2, isa::Isa::kNeonI8mm, isa::Isa::kNeonDot,
                         isa::Isa::kScalar}) {
    if (level != isa::Isa::kScalar && !isa::isa_supported(level)) continue;
    isa::set_isa_ceiling(level);
    const auto own = pack_int8_weight(packed.data(), row_bytes, sc.data(), bi.data(), n_kernels,
                                      c.cout, c.cin, storage_in, c.group, c.bits, in_scale);
    if (!first) first = own;
    for (const PackedInt8Weight* w : {static_cast<const PackedInt8Weight*>(nullptr), own.get(),
                                      first.get()}) {
      std::fill(got.begin(), got.end(), 0xAB);
      int8_conv_fused(feats, in8, c.n_in, c.cin, packed.data(), row_bytes, sc.data(), bi.data(),
                      n_kernels, c.cout, storage_in, c.group, c.bits, in_scale, csr,
                      a_index.data(), kid.data(), ep, got.data(), w);
      check(std::string(int8_isa()) + (w == nullptr ? "" : w == own.get() ? "/packed once"
                                                                          : "/first's packing"));
    }
  }
  isa::reset_isa_ceiling();
}

// quantize_rows_int8 and load_rows_int8 mark each row without a negative
// code (the AVX2 kernel's unsigned form), on every row path (AVX-512 rows
// need c and group multiples of 16, AVX2 rows multiples of 8, scalar rows
// anything): rows of non-negative values but for one value in every third
// row (-128 or -1 among the int8 codes, a value below -S/2 among the
// floats, which rounds to -1), and a negative value too small to give a
// code (it rounds to 0) in others.
void check_nonneg_marks(std::mt19937& gen, int64_t c, int64_t group) {
  const int64_t n = 30, stride = 64;
  const float s = 0.05f;
  std::uniform_int_distribution<int> pos(0, 127), col(0, static_cast<int>(c) - 1);
  std::vector<int8_t> codes(n * c);
  std::vector<float> feats(n * c);
  std::vector<uint8_t> want(n);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < c; ++i) {
      codes[r * c + i] = static_cast<int8_t>(pos(gen));
      feats[r * c + i] = static_cast<float>(pos(gen)) * s;
    }
    want[r] = r % 3 != 0;
    if (r % 3 == 0) {
      codes[r * c + col(gen)] = r % 2 == 0 ? -128 : -1;
      feats[r * c + col(gen)] = -0.6f * s;
    } else if (r % 3 == 1) {
      feats[r * c + col(gen)] = -0.4f * s;  // code 0: still non-negative
    }
  }
  std::vector<int8_t> q(n * stride);
  std::vector<float> scale(n);
  std::vector<int32_t> gsum(n * stride / group);
  for (isa::Isa level : {isa::Isa::kAvx512, isa::Isa::kAvx2, isa::Isa::kScalar}) {
    if (level != isa::Isa::kScalar && !isa::isa_supported(level)) continue;
    isa::set_isa_ceiling(level);
    for (int from_codes = 0; from_codes < 2; ++from_codes) {
      std::vector<uint8_t> got(n, 7);
      if (from_codes) {
        load_rows_int8(codes.data(), n, c, stride, group, q.data(), scale.data(), gsum.data(),
                       got.data());
      } else {
        quantize_rows_int8(feats.data(), n, c, stride, group, q.data(), scale.data(),
                           gsum.data(), s, got.data());
      }
      for (int64_t r = 0; r < n; ++r) {
        if (got[r] != want[r] || got[r] != codes_nonneg(q.data() + r * stride, stride)) {
          std::printf("FAIL nonneg mark, %s rows, c %lld, group %lld, row %lld, ceiling %d: "
                      "%d, want %d\n",
                      from_codes ? "int8" : "float", static_cast<long long>(c),
                      static_cast<long long>(group), static_cast<long long>(r),
                      static_cast<int>(level), got[r], want[r]);
          ++failures;
        }
      }
    }
  }
  isa::reset_isa_ceiling();
}

}  // namespace

int main() {
  std::mt19937 gen(20261207u);
  int cases = 0;
  for (const auto& [cin, cout, group, bits] :
       std::vector<std::tuple<int64_t, int64_t, int64_t, int>>{
           {64, 64, 64, 8}, {40, 20, 32, 4}, {33, 70, 32, 8}, {16, 16, 16, 8}}) {
    for (int variant = 0; variant < 6; ++variant) {
      Case c{300, 280, cin, cout, group, bits, variant % 2 == 1, variant != 2, variant % 3 == 0,
             variant % 3, variant < 3 ? 0.05f : 0.0f,
             variant == 5 ? FloatFormat::kBF16 : FloatFormat::kF32};
      run_case(gen, c);
      c.relu_input = true;
      run_case(gen, c);
      cases += 2;
    }
  }
  // A float32 output large enough to be streamed out of per-thread windows
  // (output_window.h: twice the L2 of the threads on the hosts this runs
  // on), finished in the window.
  run_case(gen, Case{20000, 24000, 16, 64, 16, 8, false, true, true, 1, 0.0f, FloatFormat::kF32});
  // No rows at all.
  run_case(gen, Case{0, 0, 32, 16, 32, 8, true, true, true, 2, 0.05f, FloatFormat::kF32});
  for (const auto& [c, group] :
       std::vector<std::pair<int64_t, int64_t>>{{48, 16}, {40, 8}, {33, 32}}) {
    check_nonneg_marks(gen, c, group);
  }
  std::printf("%d cases, %d failures (the AMX driver on the tile model%s)\n", cases + 2, failures,
              kAmxInt8RowsHw && isa::isa_supported(isa::Isa::kAmxInt8) ? " and the hardware"
                                                                       : "");
  return failures == 0 ? 0 : 1;
}
