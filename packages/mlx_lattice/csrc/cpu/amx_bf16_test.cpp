// The AMX-BF16 driver (cpu/amx_bf16.h) with no MLX:
// - the tile model's TDPBF16PS: subnormal inputs and results flushed to
//   zero; on AMX hosts the hardware's instruction against the model within
//   the instruction's bound;
// - the bf16 convolution forward and its feature gradient (the transposed
//   convolution over the input CSR, each offset's weight transposed)
//   through the driver on the model (bit for bit against the documented
//   order computed here, and within the header's bound of a float64
//   reference) and, where this host has AMX (CPUID, XCR0, permission), on
//   the hardware (within the bound); the bf16 forward path the dispatch
//   chose (any block) within the same bound; tile-edge shapes: channels not
//   multiples of 16/32/64, output rows not multiples of 16, one row, no
//   rows, no input rows, rows without edges, every kernel size 1..7 (K =
//   size^3), relations with fewer and more input rows than output rows (as
//   strided ones), a weight with infinities and NaN, offsets whose
//   edges read 16 consecutive input rows (loaded in place);
// - the weight gradient (cpu/amx_bf16_wgrad.h) on the same relations: the
//   model bit for bit against its documented order (with the portable and,
//   where the host has AVX-512, the register slab gather), every driver within
//   its bound, offsets with more edges than one slab; windows of 1 to 40
//   output rows or sized from L2, and every third case with each offset's
//   edges reversed (output rows descending: still each edge once, in order);
// - a repeated offset or an index out of range raises InputError and
//   leaves the tiles released.
// Prints which tile kind ran ("model" always, "hardware" where available).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "amx_bf16.h"
#include "amx_bf16_wgrad.h"
#include "amx_model_drivers.h"
#include "amx_tile_model.h"
#include "gemm_bf16.h"
#include "input_error.h"
#include "isa.h"
#include "parallel.h"

namespace {

using namespace mlx_lattice;
using namespace mlx_lattice::kernels;

int failures = 0;
unsigned seed = 20261204u;

void fail(const std::string& what) {
  ++failures;
  if (failures <= 20) std::fprintf(stderr, "FAIL (seed %u) %s\n", seed, what.c_str());
}

using amx_model::bf16_rows;
using amx_model::wgrad_scalar;
#if defined(__x86_64__)
using amx_model::wgrad_avx512;
#endif

bool hw_usable() { return kAmxBf16RowsHw && isa::isa_supported(isa::Isa::kAmxBf16); }

float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t to_bf16(float f) { return amx_bf16::round_bf16(f); }

float ftz(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }

// ---- the instruction ----

void test_model_flush() {
  using M = amx::TileModel;
  amx::TileConfig cfg;
  cfg.set(0, 1, 4);
  cfg.set(1, 1, 4);
  cfg.set(2, 1, 4);
  M::configure(cfg);
  // A subnormal input reads as zero: 2^-130 * 2^10 would be 2^-120.
  const uint16_t a[2] = {0x0004 /* 2^-130, subnormal */, 0};
  const uint16_t b[2] = {to_bf16(1024.0f), 0};
  M::load<1>(a, 4);
  M::load<2>(b, 4);
  M::dpbf16ps<0, 1, 2>();
  float c = 1.0f;
  M::store<0>(&c, 4);
  if (c != 0.0f) fail("model: subnormal input not read as zero");
  // A subnormal result is flushed: 2^-70 * 2^-70 = 2^-140.
  const uint16_t a2[2] = {to_bf16(0x1p-70f), 0};
  const uint16_t b2[2] = {to_bf16(0x1p-70f), 0};
  M::zero<0>();
  M::load<1>(a2, 4);
  M::load<2>(b2, 4);
  M::dpbf16ps<0, 1, 2>();
  M::store<0>(&c, 4);
  if (c != 0.0f) fail("model: subnormal result not flushed");
  M::release();
}

#if defined(MLX_LATTICE_AMX)
// The hardware's TDPBF16PS against the model, within the instruction's
// bound (the hardware may order or fuse the additions differently).
void test_hw_op(std::mt19937& gen) {
  using H = amx::TileHw;
  using M = amx::TileModel;
  const amx::TileConfig cfg = amx_bf16::bf16_tile_config();
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> a(16 * 32), b(16 * 32);
  for (auto& v : a) v = to_bf16(nd(gen));
  for (auto& v : b) v = to_bf16(nd(gen));
  std::vector<float> ch(256), cm(256);
  H::configure(cfg);
  H::zero<0>();
  H::load<4>(a.data(), 64);
  H::load<5>(b.data(), 64);
  H::dpbf16ps<0, 4, 5>();
  H::store<0>(ch.data(), 64);
  H::release();
  M::configure(cfg);
  M::load<4>(a.data(), 64);
  M::load<5>(b.data(), 64);
  M::dpbf16ps<0, 4, 5>();
  M::store<0>(cm.data(), 64);
  M::release();
  int same = 0;
  for (int m = 0; m < 16; ++m) {
    for (int n = 0; n < 16; ++n) {
      double mag = 0.0;
      for (int k = 0; k < 32; ++k) {
        mag += std::fabs(double(from_bf16(a[m * 32 + k])) * from_bf16(b[(k / 2) * 32 + 2 * n + k % 2]));
      }
      same += ch[m * 16 + n] == cm[m * 16 + n];
      if (std::fabs(double(ch[m * 16 + n]) - cm[m * 16 + n]) > 2 * 32 * 0x1p-24 * mag + 1e-30) {
        fail("hardware TDPBF16PS outside the bound of the model");
      }
    }
  }
  std::printf("hardware TDPBF16PS: %d of 256 sums bit-equal to the model's order\n", same);
}
#endif

// ---- the convolution ----

struct Problem {
  int64_t n_in, n_out, cin, cout, n_kernels;
  bool non_finite;  // infinities and a NaN in the weight
  // Nearly every output row takes every offset, so an offset's edges run
  // over 16 consecutive input rows (read in place when cin fills chunks).
  bool runs = false;
};

struct Relation {
  std::vector<int32_t> out_offsets, a_index, c_index, kid;  // output CSR (edge order)
  std::vector<int32_t> in_offsets, in_edge_ids;              // input CSR
};

// Per offset k an injective map from some output rows to input rows (o ->
// (o + shift_k) mod n_in for o < n_in), as a convolution relation: at most
// one edge per (output row, offset) and per (input row, offset). Edge order
// inside an output row is shuffled.
Relation make_relation(std::mt19937& gen, const Problem& p) {
  Relation r;
  std::vector<int64_t> shift(p.n_kernels);
  for (auto& s : shift) s = p.n_in > 0 ? gen() % p.n_in : 0;
  r.out_offsets.push_back(0);
  for (int64_t o = 0; o < p.n_out; ++o) {
    const int64_t density = p.runs ? (o % 37 == 36 ? 0 : 4) : gen() % 4;  // 0: no edges
    const size_t first = r.a_index.size();
    for (int64_t k = 0; k < p.n_kernels; ++k) {
      if (o < p.n_in && density > 0 && static_cast<int64_t>(gen() % 4) < density) {
        r.a_index.push_back(static_cast<int32_t>((o + shift[k]) % p.n_in));
        r.c_index.push_back(static_cast<int32_t>(o));
        r.kid.push_back(static_cast<int32_t>(k));
      }
    }
    for (size_t j = r.a_index.size(); j > first + 1; --j) {
      const size_t q = first + gen() % (j - first);
      std::swap(r.a_index[j - 1], r.a_index[q]);
      std::swap(r.kid[j - 1], r.kid[q]);
    }
    r.out_offsets.push_back(static_cast<int32_t>(r.a_index.size()));
  }
  r.in_offsets.assign(p.n_in + 1, 0);
  for (int32_t i : r.a_index) ++r.in_offsets[i + 1];
  for (int64_t i = 0; i < p.n_in; ++i) r.in_offsets[i + 1] += r.in_offsets[i];
  r.in_edge_ids.resize(r.a_index.size());
  std::vector<int32_t> cur(r.in_offsets.begin(), r.in_offsets.end() - 1);
  for (size_t e = 0; e < r.a_index.size(); ++e) r.in_edge_ids[cur[r.a_index[e]]++] = static_cast<int32_t>(e);
  if (r.a_index.empty()) {  // keep the pointers valid
    r.a_index.push_back(0);
    r.c_index.push_back(0);
    r.kid.push_back(0);
    r.in_edge_ids.push_back(0);
  }
  return r;
}

// What one output row should be: per column the documented order on the
// tile model (offsets ascending; per offset a fresh sum over pairs
// ascending, even then odd, float32, flushed, then added into the row's
// sum), and the float64 exact sum and magnitude.
struct Expect {
  std::vector<uint16_t> model_bits;
  std::vector<double> exact, mag;
  std::vector<int64_t> terms;
};

// rows (n_rows, rc) bf16, W' accessor wv(k, c, x) over c < rc, x < oc;
// edges of output row o: (input row, offset) pairs.
template <class WV>
void expect_rows(const std::vector<uint16_t>& rows, int64_t rc, int64_t oc, int64_t n_kernels,
                 const std::vector<std::vector<std::pair<int32_t, int32_t>>>& edges, WV wv,
                 Expect& ex) {
  const int64_t n = static_cast<int64_t>(edges.size());
  ex.model_bits.assign(n * oc, 0);
  ex.exact.assign(n * oc, 0.0);
  ex.mag.assign(n * oc, 0.0);
  ex.terms.assign(n * oc, 0);
  const int64_t pairs = (rc + 1) / 2;
  for (int64_t o = 0; o < n; ++o) {
    for (int64_t x = 0; x < oc; ++x) {
      float acc = 0.0f;
      double exact = 0.0, mag = 0.0;
      for (int64_t k = 0; k < n_kernels; ++k) {
        for (const auto& [i, kk] : edges[o]) {
          if (kk != k) continue;
          float sum = 0.0f;  // the offset's own sum, as TDPBF16PS runs it
          for (int64_t q = 0; q < 2 * pairs; ++q) {
            const float a = q < rc ? ftz(from_bf16(rows[i * rc + q])) : 0.0f;
            const float b = q < rc ? ftz(from_bf16(wv(k, q, x))) : 0.0f;
            sum = ftz(sum + a * b);
            exact += double(a) * double(b);
            mag += std::fabs(double(a) * double(b));
          }
          acc = acc + sum;
          ex.terms[o * oc + x] += 2 * pairs;
        }
      }
      ex.model_bits[o * oc + x] = to_bf16(acc);
      ex.exact[o * oc + x] = exact;
      ex.mag[o * oc + x] = mag;
    }
  }
}

// Within the header's bound of the exact sum (or the same non-finite class).
bool within(uint16_t got_bits, double exact, double mag, int64_t terms) {
  const float got = from_bf16(got_bits);
  if (!std::isfinite(exact) || std::isnan(mag)) {
    if (std::isnan(exact)) return std::isnan(got);
    return got == static_cast<float>(exact);
  }
  const double err = std::fabs(double(got) - exact);
  // x 1.01: n u is the first-order term of the bound (1 + u)^n - 1.
  const double bound = 0x1p-8 * std::fabs(exact) +
                       (1 + 0x1p-8) * 1.01 * double(terms) * 0x1p-24 * mag + 0x1p-120;
  return err <= bound;
}

void compare(const char* path, const std::string& name, const std::vector<uint16_t>& got,
             const Expect& ex, bool bits) {
  for (size_t j = 0; j < ex.exact.size(); ++j) {
    if (bits && got[j] != ex.model_bits[j] &&
        !(std::isnan(from_bf16(got[j])) && std::isnan(from_bf16(ex.model_bits[j])))) {
      fail(std::string(path) + " differs from the documented order at " + std::to_string(j) +
           " (" + std::to_string(from_bf16(got[j])) + " vs " +
           std::to_string(from_bf16(ex.model_bits[j])) + "): " + name);
      return;
    }
    if (!within(got[j], ex.exact[j], ex.mag[j], ex.terms[j])) {
      fail(std::string(path) + " outside the bound at " + std::to_string(j) + " (" +
           std::to_string(from_bf16(got[j])) + " vs exact " + std::to_string(ex.exact[j]) +
           "): " + name);
      return;
    }
  }
}

// The weight gradient: kernel CSR (edges of each offset in edge order),
// the model bit for bit against the order of cpu/amx_bf16_wgrad.h (edges
// ascending, float32, flushed) and every driver within its bound.
void check_weight_grad(const Problem& p, const Relation& r, const std::vector<uint16_t>& f,
                       const std::vector<uint16_t>& g, const std::string& name,
                       int64_t window_rows, bool reversed) {
  const int64_t n_edges = r.out_offsets.back();
  std::vector<int32_t> k_offsets(p.n_kernels + 1, 0), k_edges(std::max<int64_t>(1, n_edges));
  for (int64_t e = 0; e < n_edges; ++e) ++k_offsets[r.kid[e] + 1];
  for (int64_t k = 0; k < p.n_kernels; ++k) k_offsets[k + 1] += k_offsets[k];
  std::vector<int32_t> cur(k_offsets.begin(), k_offsets.end() - 1);
  for (int64_t e = 0; e < n_edges; ++e) k_edges[cur[r.kid[e]]++] = static_cast<int32_t>(e);
  if (reversed) {
    for (int64_t k = 0; k < p.n_kernels; ++k) {
      std::reverse(k_edges.begin() + k_offsets[k], k_edges.begin() + k_offsets[k + 1]);
    }
  }
  const int64_t size = p.n_kernels * p.cin * p.cout;
  std::vector<float> chain(std::max<int64_t>(1, size));
  std::vector<double> exact(chain.size()), mag(chain.size());
  for (int64_t k = 0; k < p.n_kernels; ++k) {
    for (int64_t c = 0; c < p.cin; ++c) {
      for (int64_t x = 0; x < p.cout; ++x) {
        float acc = 0.0f;
        double ex = 0.0, mg = 0.0;
        for (int32_t j = k_offsets[k]; j < k_offsets[k + 1]; ++j) {
          const int32_t e = k_edges[j];
          const float a = ftz(from_bf16(f[r.a_index[e] * p.cin + c]));
          const float b = ftz(from_bf16(g[r.c_index[e] * p.cout + x]));
          acc = ftz(acc + a * b);
          ex += double(a) * b;
          mg += std::fabs(double(a) * b);
        }
        const int64_t at = (k * p.cin + c) * p.cout + x;
        chain[at] = acc;
        exact[at] = ex;
        mag[at] = mg;
      }
    }
  }
  const Csr kcsr{k_offsets.data(), k_edges.data(), p.n_kernels};
  auto check = [&](const char* path, Bf16WgradFn fn, bool bits) {
    std::vector<float> got(chain.size(), 12345.0f);
    if (fn) {
      bf16_weight_grad_rows(fn, f.data(), p.n_in, p.cin, g.data(), p.n_out, p.cout, kcsr,
                            r.a_index.data(), r.c_index.data(), got.data(), window_rows);
    } else {
      half_weight_grad(FloatFormat::kBF16, f.data(), p.n_in, p.cin, g.data(), p.n_out, p.cout,
                       kcsr, r.a_index.data(), r.c_index.data(), got.data());
    }
    for (int64_t j = 0; j < size; ++j) {
      const int64_t n = k_offsets[j / (p.cin * p.cout) + 1] - k_offsets[j / (p.cin * p.cout)];
      // The header's n u sum|products| for any order of the n additions
      // (x 1.01: the first-order bound's higher terms), plus flushed
      // subnormals.
      const double bound = 1.01 * double(n) * 0x1p-24 * mag[j] + 0x1p-120;
      const bool same = std::memcmp(&got[j], &chain[j], 4) == 0 ||
                        (std::isnan(got[j]) && std::isnan(chain[j]));
      if ((bits && !same) ||
          (std::isfinite(exact[j]) ? !(std::fabs(double(got[j]) - exact[j]) <= bound)
                                   : !same)) {
        fail(std::string(path) + " weight gradient at " + std::to_string(j) + " (" +
             std::to_string(got[j]) + " vs " + std::to_string(chain[j]) + "), windows of " +
             std::to_string(window_rows) + " rows" + (reversed ? ", edges reversed" : "") +
             ": " + name);
        return;
      }
    }
  };
  check("model", wgrad_scalar, true);
#if defined(__x86_64__)
  if (isa::isa_supported(isa::Isa::kAvx512)) check("model/avx512-gather", wgrad_avx512, true);
#endif
  if (kAmxBf16WgradHw && hw_usable()) check("hardware", kAmxBf16WgradHw, false);
  if (half_weight_grad_available(FloatFormat::kBF16)) check("dispatch", nullptr, false);
}

int run_case(std::mt19937& gen, const Problem& p, bool verbose) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> f(std::max<int64_t>(1, p.n_in * p.cin));
  std::vector<uint16_t> g(std::max<int64_t>(1, p.n_out * p.cout));
  std::vector<uint16_t> w(std::max<int64_t>(1, p.n_kernels * p.cin * p.cout));
  for (auto& v : f) v = to_bf16(nd(gen));
  for (auto& v : g) v = to_bf16(nd(gen));
  for (auto& v : w) v = to_bf16(0.2f * nd(gen));
  if (p.non_finite && p.n_kernels * p.cin * p.cout > 2) {
    w[gen() % w.size()] = 0x7f80;  // +inf
    w[gen() % w.size()] = 0xff80;  // -inf
    w[gen() % w.size()] = 0x7fc0;  // NaN
  }
  const Relation r = make_relation(gen, p);
  const std::string name = "n_in " + std::to_string(p.n_in) + " n_out " +
                           std::to_string(p.n_out) + " cin " + std::to_string(p.cin) + " cout " +
                           std::to_string(p.cout) + " K " + std::to_string(p.n_kernels) +
                           (p.non_finite ? " non-finite weight" : "") + (p.runs ? " runs" : "");
  const bool finite = !p.non_finite;
  // Forward: rows of the output CSR.
  std::vector<std::vector<std::pair<int32_t, int32_t>>> out_edges(p.n_out), in_edges(p.n_in);
  for (int64_t o = 0; o < p.n_out; ++o) {
    for (int32_t e = r.out_offsets[o]; e < r.out_offsets[o + 1]; ++e) {
      out_edges[o].push_back({r.a_index[e], r.kid[e]});
      in_edges[r.a_index[e]].push_back({static_cast<int32_t>(o), r.kid[e]});
    }
  }
  Expect fwd, bwd;
  expect_rows(f, p.cin, p.cout, p.n_kernels, out_edges,
              [&](int64_t k, int64_t c, int64_t x) { return w[(k * p.cin + c) * p.cout + x]; },
              fwd);
  expect_rows(g, p.cout, p.cin, p.n_kernels, in_edges,
              [&](int64_t k, int64_t c, int64_t x) { return w[(k * p.cin + x) * p.cout + c]; },
              bwd);
  const Csr out_csr{r.out_offsets.data(), nullptr, p.n_out};
  const Csr in_csr{r.in_offsets.data(), r.in_edge_ids.data(), p.n_in};
  std::vector<uint16_t> got_f(std::max<int64_t>(1, p.n_out * p.cout));
  std::vector<uint16_t> got_b(std::max<int64_t>(1, p.n_in * p.cin));
  auto run = [&](Bf16RowsFn fn) {
    std::fill(got_f.begin(), got_f.end(), 0xdead);
    std::fill(got_b.begin(), got_b.end(), 0xdead);
    bf16_conv_rows(fn, f.data(), p.n_in, p.cin, w.data(), p.n_kernels, p.cout, false, out_csr,
                   r.a_index.data(), r.kid.data(), got_f.data());
    bf16_conv_rows(fn, g.data(), p.n_out, p.cin, w.data(), p.n_kernels, p.cout, true, in_csr,
                   r.c_index.data(), r.kid.data(), got_b.data());
    got_f.resize(p.n_out * p.cout);
    got_b.resize(p.n_in * p.cin);
  };
  run(bf16_rows);
  compare("model forward", name, got_f, fwd, true);
  compare("model feature gradient", name, got_b, bwd, true);
  if (hw_usable()) {
    got_f.resize(std::max<int64_t>(1, p.n_out * p.cout));
    got_b.resize(std::max<int64_t>(1, p.n_in * p.cin));
    run(kAmxBf16RowsHw);
    compare("hardware forward", name, got_f, fwd, false);
    compare("hardware feature gradient", name, got_b, bwd, false);
  }
  // The path the dispatch chose (any bf16 block; none: the float32 path
  // runs in the caller, not here), finite weights (the avx512-bf16 block
  // leaves non-finite products of absent pairs to the caller's float32 path
  // no more than the driver does, but its bound is the one checked).
  if (half_conv_available(FloatFormat::kBF16) && finite) {
    std::vector<uint16_t> out(std::max<int64_t>(1, p.n_out * p.cout), 0xdead);
    half_conv(FloatFormat::kBF16, f.data(), p.n_in, p.cin, w.data(), p.n_kernels, p.cout,
              out_csr, r.a_index.data(), r.c_index.data(), r.kid.data(), out.data());
    out.resize(p.n_out * p.cout);
    compare(half_isa(FloatFormat::kBF16), name, out, fwd, false);
  }
  if (half_conv_transposed_available(FloatFormat::kBF16) && finite) {
    std::vector<uint16_t> out(std::max<int64_t>(1, p.n_in * p.cin), 0xdead);
    half_conv_transposed(FloatFormat::kBF16, g.data(), p.n_out, p.cout, w.data(), p.n_kernels,
                         p.cin, in_csr, r.c_index.data(), r.a_index.data(), r.kid.data(),
                         out.data());
    out.resize(p.n_in * p.cin);
    compare("dispatch feature gradient", name, out, bwd, false);
  }
  // Windows: sized from L2 (0) or 1 to 40 rows; every third case reversed.
  const int64_t window_rows = gen() % 4 == 0 ? 0 : 1 + static_cast<int64_t>(gen() % 40);
  check_weight_grad(p, r, f, g, name, window_rows, gen() % 3 == 0);
  if (verbose) std::printf("  ok: %s\n", name.c_str());
  return 1;
}

void test_bad_relations() {
  const std::vector<uint16_t> f(2 * 4, to_bf16(1.0f)), w(2 * 4 * 4, to_bf16(1.0f));
  std::vector<uint16_t> out(4);
  struct Bad {
    const char* what;
    std::vector<int32_t> a_index, kid;
  };
  const Bad bads[] = {{"repeated offset", {0, 1}, {1, 1}},
                      {"offset out of range", {0, 1}, {0, 2}},
                      {"input row out of range", {0, 2}, {0, 1}},
                      {"negative input row", {-1, 0}, {0, 1}}};
  std::vector<Bf16RowsFn> fns{bf16_rows};
  if (hw_usable()) fns.push_back(kAmxBf16RowsHw);
  for (const Bad& b : bads) {
    const std::vector<int32_t> offsets{0, 2};
    const Csr csr{offsets.data(), nullptr, 1};
    for (Bf16RowsFn fn : fns) {
      try {
        bf16_conv_rows(fn, f.data(), 2, 4, w.data(), 2, 4, false, csr, b.a_index.data(),
                       b.kid.data(), out.data());
        fail(std::string(b.what) + ": no error");
      } catch (const InputError&) {
      }
      if (amx::TileModel::configured()) fail("model tiles left configured after an error");
    }
  }
  // 20 rows with an edge of offset 0 each, row 7 with two more of offset 1
  // (the window's bucket of offset 1 does not overflow: the driver must see
  // the row repeat).
  std::vector<int32_t> offsets{0}, a_index, kid;
  for (int32_t o = 0; o < 20; ++o) {
    a_index.push_back(o % 2);
    kid.push_back(0);
    if (o == 7) {
      a_index.insert(a_index.end(), {0, 1});
      kid.insert(kid.end(), {1, 1});
    }
    offsets.push_back(static_cast<int32_t>(a_index.size()));
  }
  const Csr csr{offsets.data(), nullptr, 20};
  std::vector<uint16_t> out20(20 * 4);
  for (Bf16RowsFn fn : fns) {
    try {
      bf16_conv_rows(fn, f.data(), 2, 4, w.data(), 2, 4, false, csr, a_index.data(), kid.data(),
                     out20.data());
      fail("repeated offset in a window: no error");
    } catch (const InputError&) {
    }
    if (amx::TileModel::configured()) fail("model tiles left configured after an error");
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) seed = static_cast<unsigned>(std::strtoul(argv[1], nullptr, 10));
  std::mt19937 gen(seed);
  const bool hw = hw_usable();
  std::printf("tile kinds: model%s (amx-bf16 %s on this host); dispatch bf16 path: %s\n",
              hw ? " + hardware" : "",
              hw ? "usable" : "not usable: CPUID, XCR0 or permission missing",
              half_isa(FloatFormat::kBF16));
  test_model_flush();
#if defined(MLX_LATTICE_AMX)
  if (hw) test_hw_op(gen);
#endif
  test_bad_relations();
  int cases = 0;
  // Tile edges: channels around the 16-column tiles, the 32-channel chunks
  // and the 64-column strips; output rows around the 16-row blocks.
  const int64_t cins[] = {1, 2, 15, 16, 17, 31, 32, 33, 64, 70, 130};
  const int64_t couts[] = {1, 15, 16, 17, 48, 64, 65, 129};
  const int64_t nouts[] = {0, 1, 15, 16, 17, 40};
  for (int64_t cin : cins) {
    for (int64_t cout : couts) {
      const int64_t n_out = nouts[gen() % 6];
      const int64_t n_in = (gen() % 2) ? 30 : 3 * n_out + 1;  // fewer / more inputs
      cases += run_case(gen, {n_in, n_out, cin, cout, 27, gen() % 5 == 0}, false);
    }
  }
  // Every kernel size the relations allow (1..7, K = size^3).
  for (int64_t size = 1; size <= 7; ++size) {
    cases += run_case(gen, {50, 33, 40, 70, size * size * size, size == 3}, true);
  }
  // No input rows, one row, and more threads over several blocks and tasks.
  cases += run_case(gen, {0, 5, 16, 16, 27, false}, true);
  cases += run_case(gen, {1, 1, 33, 17, 8, false}, true);
  set_num_threads(3);
  cases += run_case(gen, {300, 1000, 64, 64, 27, false}, true);
  // Batches of 16 consecutive input rows (in place for cin 32 and 64,
  // gathered for 40), up to the last input row, and their tails.
  for (int64_t cin : {32, 40, 64}) {
    cases += run_case(gen, {200, 200, cin, 48, 27, cin == 64, true}, true);
  }
  cases += run_case(gen, {800, 300, 32, 96, 8, true}, true);
  // Offsets with more edges than one slab of the weight gradient.
  cases += run_case(gen, {3000, 3000, 20, 24, 1, false}, true);
  std::printf("amx bf16: %d cases, seed %u, %s\n", cases, seed, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
