// The AMX-INT8 driver (cpu/amx_int8.h) and the tile model
// (cpu/amx_tile_model.h), with no MLX:
// - the model's instructions against direct sums, and its configuration
//   limits;
// - the int8 convolution through the AMX driver on the model (both
//   epilogues) and, where this host has AMX (CPUID, XCR0, permission), on
//   the hardware, bit for bit against the documented math computed here
//   directly, next to every int8 path the dispatch offers; tile-edge shapes:
//   channels not multiples of 16/32/64, output rows not multiples of 16, one
//   row, no rows, rows without edges, 8-bit and 4-bit codes, dynamic and
//   static activation scales, a non-finite row, every kernel size 1..7
//   (K = size^3) with the relation's at-most-one-edge-per-offset rule,
//   input rows at random and in grid-like runs (16 consecutive rows of one
//   offset are read in place);
// - a repeated offset raises InputError on every driver;
// - the drivers' buffers start on a cache line (line_vector.h).
// Prints which tile kind ran ("model" always, "hardware" where available).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "amx_int8.h"
#include "amx_model_drivers.h"
#include "amx_tile_model.h"
#include "gemm_int8.h"
#include "input_error.h"
#include "isa.h"
#include "line_vector.h"
#include "output_window.h"
#include "parallel.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace {

using namespace mlx_lattice;
using namespace mlx_lattice::kernels;

int failures = 0;
unsigned seed = 20261204u;

void fail(const std::string& what) {
  ++failures;
  std::fprintf(stderr, "FAIL (seed %u) %s\n", seed, what.c_str());
}

using amx_model::int8_rows_scalar;
#if defined(__x86_64__)
using amx_model::int8_rows_avx512;
#endif

// ---- the model's instructions ----

void test_model_ops(std::mt19937& gen) {
  using M = amx::TileModel;
  std::uniform_int_distribution<int> byte(0, 255);
  for (int trial = 0; trial < 40; ++trial) {
    const int m = 1 + gen() % 16, kq = 1 + gen() % 16, n = 1 + gen() % 16;
    amx::TileConfig cfg;
    cfg.set(0, m, 4 * n);
    cfg.set(1, m, 4 * kq);
    cfg.set(2, kq, 4 * n);
    M::configure(cfg);
    std::vector<uint8_t> a(m * 64), b(kq * 64);
    std::vector<int32_t> c0(m * 16);
    for (auto& v : a) v = static_cast<uint8_t>(byte(gen));
    for (auto& v : b) v = static_cast<uint8_t>(byte(gen));
    for (auto& v : c0) v = static_cast<int32_t>(gen());
    for (int op = 0; op < 3; ++op) {
      M::load<0>(c0.data(), 64);
      M::load<1>(a.data(), 64);
      M::load<2>(b.data(), 64);
      if (op == 0) M::dpbssd<0, 1, 2>();
      if (op == 1) M::dpbsud<0, 1, 2>();
      if (op == 2) M::dpbusd<0, 1, 2>();
      std::vector<int32_t> c(m * 16, 0);
      M::store<0>(c.data(), 64);
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          int64_t want = c0[i * 16 + j];
          for (int k = 0; k < 4 * kq; ++k) {
            const int av = op == 2 ? a[i * 64 + k] : static_cast<int8_t>(a[i * 64 + k]);
            const int bv = op == 1 ? b[(k / 4) * 64 + 4 * j + k % 4]
                                   : static_cast<int8_t>(b[(k / 4) * 64 + 4 * j + k % 4]);
            want += av * bv;
          }
          if (c[i * 16 + j] != static_cast<int32_t>(static_cast<uint32_t>(want))) {
            fail("model int8 dot op " + std::to_string(op));
          }
        }
      }
    }
    // TDPBF16PS: the documented order (k ascending, even then odd), one
    // rounding per addition; and within 2 kq u sum|products| of the exact
    // sum (2 kq additions of exact bf16 products, u = 2^-24).
    std::vector<uint16_t> ah(m * 32), bh(kq * 32);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    auto to_bf16 = [](float f) {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      return static_cast<uint16_t>(u >> 16);
    };
    auto from_bf16 = [](uint16_t h) {
      const uint32_t u = static_cast<uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    };
    for (auto& v : ah) v = to_bf16(nd(gen));
    for (auto& v : bh) v = to_bf16(nd(gen));
    M::zero<0>();
    M::load<1>(ah.data(), 64);
    M::load<2>(bh.data(), 64);
    M::dpbf16ps<0, 1, 2>();
    std::vector<float> cf(m * 16);
    M::store<0>(cf.data(), 64);
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j < n; ++j) {
        float chain = 0.0f;
        double exact = 0.0, mag = 0.0;
        for (int k = 0; k < kq; ++k) {
          for (int e = 0; e < 2; ++e) {
            const float p = from_bf16(ah[i * 32 + 2 * k + e]) * from_bf16(bh[k * 32 + 2 * j + e]);
            chain = chain + p;
            exact += p;
            mag += std::fabs(p);
          }
        }
        if (std::memcmp(&chain, &cf[i * 16 + j], 4) != 0) fail("model bf16 order");
        if (std::fabs(cf[i * 16 + j] - exact) > 2 * kq * 0x1p-24 * mag + 1e-30) {
          fail("model bf16 bound");
        }
      }
    }
    M::release();
  }
  // Limits: each raises std::logic_error.
  auto expect_throw = [](const char* what, auto&& f) {
    try {
      f();
      fail(std::string("no error: ") + what);
    } catch (const std::logic_error&) {
    }
  };
  expect_throw("17 rows", [] {
    amx::TileConfig c;
    c.set(0, 17, 64);
    M::configure(c);
  });
  expect_throw("65 bytes", [] {
    amx::TileConfig c;
    c.set(0, 16, 65);
    M::configure(c);
  });
  expect_throw("palette 0", [] {
    amx::TileConfig c;
    c.palette = 0;
    M::configure(c);
  });
  expect_throw("tile 8", [] {
    amx::TileConfig c;
    c.set(8, 1, 4);
    M::configure(c);
  });
  expect_throw("unconfigured use", [] { M::zero<0>(); });
  expect_throw("shape mismatch", [] {
    amx::TileConfig c;
    c.set(0, 16, 64);
    c.set(1, 16, 64);
    c.set(2, 8, 64);  // K = 16 dwords needs 16 rows of B
    M::configure(c);
    try {
      M::dpbssd<0, 1, 2>();
    } catch (...) {
      M::release();
      throw;
    }
  });
}

#if defined(MLX_LATTICE_AMX)
// The hardware's int8 ops against the model's, bit for bit.
__attribute__((target("amx-tile,amx-int8,amx-bf16"))) void test_hw_ops(std::mt19937& gen) {
  using H = amx::TileHw;
  using M = amx::TileModel;
  amx::TileConfig cfg;
  cfg.set(0, 16, 64);
  cfg.set(1, 16, 64);
  cfg.set(2, 16, 64);
  std::vector<uint8_t> a(1024), b(1024);
  for (auto& v : a) v = static_cast<uint8_t>(gen());
  for (auto& v : b) v = static_cast<uint8_t>(gen());
  std::vector<int32_t> ch(256), cm(256);
  H::configure(cfg);
  H::zero<0>();
  H::load<1>(a.data(), 64);
  H::load<2>(b.data(), 64);
  H::dpbsud<0, 1, 2>();
  H::store<0>(ch.data(), 64);
  H::release();
  M::configure(cfg);
  M::load<1>(a.data(), 64);
  M::load<2>(b.data(), 64);
  M::dpbsud<0, 1, 2>();
  M::store<0>(cm.data(), 64);
  M::release();
  if (ch != cm) fail("hardware TDPBSUD differs from the model");
}
#endif

// ---- the convolution ----

struct Problem {
  int64_t n_in, n_out, cin, cout, n_kernels, group, bits;
  float act_scale;
  bool nan_row;
  // Grid-like input rows: output row o reads row (o + k - K / 2) mod n_in
  // through offset k (most offsets present), so an offset's edges run over
  // consecutive input rows, as on a sorted voxel grid.
  bool runs = false;
  // Extreme operands: each input row all +1 or all -1 (activations +-127)
  // and each weight row's codes all 0 or all the largest: the largest sums
  // of any pair or chunk, which an int16 step must hold without clipping.
  bool extreme = false;
};

// The documented math (gemm_int8.h), directly: quantize_rows_int8's rows,
// then per output row, offsets ascending, groups ascending.
void reference(const Problem& p, const std::vector<float>& f, const std::vector<uint8_t>& packed,
               int64_t row_bytes, const std::vector<float>& sc, const std::vector<float>& bi,
               int64_t storage_in, const std::vector<int32_t>& offsets,
               const std::vector<int32_t>& a_index, const std::vector<int32_t>& kid,
               std::vector<float>& out) {
  const int64_t groups = storage_in / p.group;
  std::vector<int8_t> q(std::max<int64_t>(1, p.n_in * storage_in));
  std::vector<float> sa(std::max<int64_t>(1, p.n_in));
  std::vector<int32_t> gsum(std::max<int64_t>(1, p.n_in * groups));
  quantize_rows_int8(f.data(), p.n_in, p.cin, storage_in, p.group, q.data(), sa.data(),
                     gsum.data(), p.act_scale);
  out.assign(p.n_out * p.cout, 0.0f);
  for (int64_t o = 0; o < p.n_out; ++o) {
    for (int64_t k = 0; k < p.n_kernels; ++k) {
      for (int64_t j = offsets[o]; j < offsets[o + 1]; ++j) {
        if (kid[j] != k) continue;
        const int64_t i = a_index[j];
        for (int64_t g = 0; g < groups; ++g) {
          for (int64_t x = 0; x < p.cout; ++x) {
            const int64_t row = k * p.cout + x;
            int32_t acc = 0;
            for (int64_t c = g * p.group; c < (g + 1) * p.group && c < p.cin; ++c) {
              acc += static_cast<int32_t>(
                         unpack_code(packed.data() + row * row_bytes, row_bytes, c, p.bits)) *
                     q[i * storage_in + c];
            }
            float s = sc[row * groups + g], b = bi[row * groups + g];
            if (p.act_scale > 0.0f) {
              s = s * p.act_scale;
              b = b * p.act_scale;
            }
            volatile float t = static_cast<float>(acc) * s;
            volatile float u = static_cast<float>(gsum[i * groups + g]) * b;
            float v = t + u;
            if (!(p.act_scale > 0.0f) || sa[i] != 1.0f) v = v * sa[i];
            out[o * p.cout + x] = out[o * p.cout + x] + v;
          }
        }
      }
    }
  }
}

int run_case(std::mt19937& gen, const Problem& p, bool verbose) {
  const int64_t storage_in = (p.cin + p.group - 1) / p.group * p.group;
  const int64_t groups = storage_in / p.group;
  const int64_t row_bytes = storage_in * p.bits / 8;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> f(std::max<int64_t>(1, p.n_in * p.cin));
  for (auto& v : f) v = nd(gen);
  if (p.extreme) {  // each row all +1 or all -1: its codes all +127 or all -127
    for (int64_t i = 0; i < p.n_in; ++i) {
      std::fill_n(f.begin() + i * p.cin, p.cin, (gen() % 2) ? 1.0f : -1.0f);
    }
  }
  if (p.nan_row && p.n_in > 0) f[(p.n_in / 2) * p.cin] = NAN;
  std::vector<uint8_t> packed(std::max<int64_t>(1, p.n_kernels * p.cout * row_bytes));
  for (auto& v : packed) v = static_cast<uint8_t>(gen());
  if (p.extreme) {  // each weight row's codes all 0 or all the largest
    for (int64_t row = 0; row < p.n_kernels * p.cout; ++row) {
      std::fill_n(packed.begin() + row * row_bytes, row_bytes, (gen() % 2) ? 0xff : 0x00);
    }
  }
  std::vector<float> sc(std::max<int64_t>(1, p.n_kernels * p.cout * groups)), bi(sc.size());
  for (auto& v : sc) v = 0.01f + 0.02f * std::fabs(nd(gen));
  for (auto& v : bi) v = -0.1f * std::fabs(nd(gen));
  // The relation: each output row gets a random subset of offsets (at most
  // one edge per offset), each with a random input row; some rows none.
  std::vector<int32_t> offsets{0}, a_index, kid;
  for (int64_t o = 0; o < p.n_out; ++o) {
    const int64_t density = gen() % 4;  // 0: no edges; else ~ density / 4
    for (int64_t k = 0; k < p.n_kernels; ++k) {
      if (p.runs && p.n_in > 0) {
        if (gen() % 16 == 0) continue;
        const int64_t i = o + k - p.n_kernels / 2;
        a_index.push_back(static_cast<int32_t>(((i % p.n_in) + p.n_in) % p.n_in));
        kid.push_back(static_cast<int32_t>(k));
      } else if (p.n_in > 0 && density > 0 && static_cast<int64_t>(gen() % 4) < density) {
        a_index.push_back(static_cast<int32_t>(gen() % p.n_in));
        kid.push_back(static_cast<int32_t>(k));
      }
    }
    offsets.push_back(static_cast<int32_t>(a_index.size()));
  }
  // Shuffle edges inside each row (CSR order need not be offset order).
  for (int64_t o = 0; o < p.n_out; ++o) {
    for (int64_t j = offsets[o + 1] - 1; j > offsets[o]; --j) {
      const int64_t r = offsets[o] + gen() % (j - offsets[o] + 1);
      std::swap(a_index[j], a_index[r]);
      std::swap(kid[j], kid[r]);
    }
  }
  if (a_index.empty()) {
    a_index.push_back(0);
    kid.push_back(0);
  }
  Csr csr;
  csr.offsets = offsets.data();
  csr.groups = p.n_out;
  std::vector<float> want;
  reference(p, f, packed, row_bytes, sc, bi, storage_in, offsets, a_index, kid, want);
  const std::string name = "n_in " + std::to_string(p.n_in) + " n_out " +
                           std::to_string(p.n_out) + " cin " + std::to_string(p.cin) + " cout " +
                           std::to_string(p.cout) + " K " + std::to_string(p.n_kernels) +
                           " group " + std::to_string(p.group) + " bits " +
                           std::to_string(p.bits) + (p.act_scale > 0 ? " static" : " dynamic") +
                           (p.nan_row ? " nan-row" : "") + (p.runs ? " runs" : "") +
                           (p.extreme ? " extreme" : "");
  auto compare = [&](const char* path, const std::vector<float>& got) {
    if (p.n_out * p.cout > 0 &&
        std::memcmp(got.data(), want.data(), sizeof(float) * p.n_out * p.cout) != 0) {
      int64_t at = 0;
      while (std::memcmp(&got[at], &want[at], 4) == 0) ++at;
      fail(std::string(path) + " differs at " + std::to_string(at) + " (" +
           std::to_string(got[at]) + " vs " + std::to_string(want[at]) + "): " + name);
    }
  };
  std::vector<float> got(std::max<int64_t>(1, p.n_out * p.cout));
  auto run_rows = [&](Int8RowsFn fn) {
    std::fill(got.begin(), got.end(), 12345.0f);
    int8_conv_rows(fn, f.data(), p.n_in, p.cin, packed.data(), row_bytes, sc.data(), bi.data(),
                   p.n_kernels, p.cout, storage_in, p.group, static_cast<int>(p.bits),
                   p.act_scale, csr, a_index.data(), kid.data(), got.data());
  };
  run_rows(int8_rows_scalar);
  compare("model/scalar-epilogue", got);
#if defined(__x86_64__)
  if (isa::isa_supported(isa::Isa::kAvx512)) {
    run_rows(int8_rows_avx512);
    compare("model/avx512-epilogue", got);
  }
#endif
  if (kAmxInt8RowsHw && isa::isa_supported(isa::Isa::kAmxInt8)) {
    run_rows(kAmxInt8RowsHw);
    compare("hardware", got);
  }
  // Every path the dispatch offers, forced in turn.
  for (isa::Isa level : {isa::Isa::kAmxInt8, isa::Isa::kAvx512Vnni, isa::Isa::kAvxVnni,
                         isa::Isa::kAvx2, isa::Isa::kNeonI8mm, isa::Isa::kNeonDot,
                         isa::Isa::kScalar}) {
    if (level != isa::Isa::kScalar && !isa::isa_supported(level)) continue;
    isa::set_isa_ceiling(level);
    std::fill(got.begin(), got.end(), 12345.0f);
    int8_conv(f.data(), p.n_in, p.cin, packed.data(), row_bytes, sc.data(), bi.data(),
              p.n_kernels, p.cout, storage_in, p.group, static_cast<int>(p.bits), p.act_scale,
              csr, a_index.data(), nullptr, kid.data(), got.data());
    compare(int8_isa(), got);
    // The level forced is the one that ran (each has its table entry).
    if (std::strcmp(int8_isa(), isa::isa_name(level)) != 0) {
      fail(std::string("forced ") + isa::isa_name(level) + ", ran " + int8_isa() + ": " + name);
    }
  }
  isa::reset_isa_ceiling();
  if (verbose) std::printf("  ok: %s\n", name.c_str());
  return 1;
}

// The drivers' buffers (line_vector.h): LineVector storage starts on a
// cache line at every size and after growing; line_aligned returns an
// operand on a line as it is, and copies one off a line only when it is
// read often enough.
void test_line_vectors() {
  for (size_t n : {size_t{1}, size_t{63}, size_t{4096}, size_t{300000}}) {
    LineVector<int8_t> bytes(n);
    LineVector<float> floats(n);
    LineVector<uint16_t> halves(n);
    if (!on_line(bytes.data()) || !on_line(floats.data()) || !on_line(halves.data())) {
      fail("LineVector of " + std::to_string(n) + " values off a line");
    }
    floats.resize(3 * n + 1);
    if (!on_line(floats.data())) fail("LineVector grown to " + std::to_string(3 * n + 1));
  }
  LineVector<float> source(1000);
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<float>(i) * 0.5f;
  LineVector<float> copy;
  if (line_aligned(source.data(), 999, copy, 100.0) != source.data() || !copy.empty()) {
    fail("line_aligned copied an operand on a line");
  }
  const float* off = source.data() + 1;
  if (line_aligned(off, 999, copy, 2.0) != off) fail("line_aligned copied for two reads");
  const float* moved = line_aligned(off, 999, copy, 100.0);
  if (moved != copy.data() || !on_line(moved) || std::memcmp(moved, off, 999 * sizeof(float))) {
    fail("line_aligned's copy");
  }
}

void test_repeated_offset() {
  // Output row 0 with two edges of offset 1; and 20 rows with an edge of
  // offset 0 each, row 7 with two more of offset 1 (its window's bucket of
  // offset 1 does not overflow: the driver must see the row repeat).
  std::vector<std::vector<int32_t>> offsets{{0, 2}, {0}}, a_index{{0, 1}, {}}, kid{{1, 1}, {}};
  for (int32_t o = 0; o < 20; ++o) {
    a_index[1].push_back(o % 2);
    kid[1].push_back(0);
    if (o == 7) {
      a_index[1].insert(a_index[1].end(), {0, 1});
      kid[1].insert(kid[1].end(), {1, 1});
    }
    offsets[1].push_back(static_cast<int32_t>(a_index[1].size()));
  }
  std::vector<float> f(2 * 4, 1.0f), sc(2 * 4, 1.0f), bi(2 * 4, 0.0f), out(20 * 4);
  std::vector<uint8_t> packed(2 * 4 * 4, 1);
  std::vector<Int8RowsFn> fns{int8_rows_scalar};
  if (kAmxInt8RowsHw && isa::isa_supported(isa::Isa::kAmxInt8)) fns.push_back(kAmxInt8RowsHw);
  for (size_t c = 0; c < offsets.size(); ++c) {
    Csr csr;
    csr.offsets = offsets[c].data();
    csr.groups = static_cast<int64_t>(offsets[c].size()) - 1;
    for (Int8RowsFn fn : fns) {
      try {
        int8_conv_rows(fn, f.data(), 2, 4, packed.data(), 4, sc.data(), bi.data(), 2, 4, 4, 4, 8,
                       0.0f, csr, a_index[c].data(), kid[c].data(), out.data());
        fail("repeated offset: no error (case " + std::to_string(c) + ")");
      } catch (const InputError&) {
      }
      // The thread's tiles were released: a new configuration works.
      if (amx::TileModel::configured()) fail("model tiles left configured after an error");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) seed = static_cast<unsigned>(std::strtoul(argv[1], nullptr, 10));
  std::mt19937 gen(seed);
  const bool hw = kAmxInt8RowsHw && isa::isa_supported(isa::Isa::kAmxInt8);
  std::printf("tile kinds: model%s (amx-int8 %s on this host)\n", hw ? " + hardware" : "",
              hw ? "usable" : "not usable: CPUID, XCR0 or permission missing");
  test_model_ops(gen);
#if defined(MLX_LATTICE_AMX)
  if (hw) test_hw_ops(gen);
#endif
  test_repeated_offset();
  test_line_vectors();
  int cases = 0;
  // Tile edges: channels, rows, groups and codes.
  const int64_t cins[] = {1, 4, 15, 16, 17, 33, 64, 70, 130};
  const int64_t couts[] = {1, 15, 16, 17, 48, 64, 65, 129};
  const int64_t nouts[] = {0, 1, 15, 16, 17, 40};
  for (int64_t cin : cins) {
    for (int64_t cout : couts) {
      const int64_t n_out = nouts[gen() % 6];
      const int64_t group = (gen() % 2) ? 32 : (cin <= 64 ? 64 : 128);
      const int64_t bits = (gen() % 2) ? 8 : 4;
      const float act = (gen() % 2) ? 0.05f : 0.0f;
      cases += run_case(gen, {30, n_out, cin, cout, 27, group, bits, act, gen() % 3 == 0}, false);
    }
  }
  // Every kernel size the relations allow (1..7, K = size^3), both scales.
  for (int64_t size = 1; size <= 7; ++size) {
    for (float act : {0.0f, 0.03f}) {
      cases += run_case(gen, {50, 33, 40, 70, size * size * size, 32, 8, act, size == 3}, true);
    }
  }
  // Odd groups (chunk widths 4, 8, 16, 96 = 64 + 32... as 32 x 3), empty
  // inputs, and more threads.
  for (int64_t group : {4, 8, 16, 96}) {
    for (int64_t bits : {8, 4}) {
      cases += run_case(gen, {20, 19, 96, 40, 8, group, bits, 0.0f, false}, true);
    }
  }
  // Extreme operands, both code widths, groups of 8 to 128 quads.
  for (int64_t bits : {8, 4}) {
    for (int64_t group : {32, 128, 512}) {
      cases += run_case(gen, {40, 40, 512, 24, 27, group, bits, 0.0f, false, false, true}, true);
    }
  }
  cases += run_case(gen, {0, 5, 16, 16, 27, 32, 8, 0.0f, false}, true);
  // Offsets whose edges read 16 consecutive input rows (loaded in place),
  // up to the last input row, beside gathered batches and tails.
  for (int64_t cin : {16, 64, 70}) {
    for (float act : {0.0f, 0.04f}) {
      cases += run_case(gen, {200, 200, cin, 48, 27, cin == 70 ? 32 : 16, 8, act, cin == 64, true},
                        true);
    }
  }
  set_num_threads(3);
  cases += run_case(gen, {300, 1000, 64, 64, 27, 64, 8, 0.0f, true}, true);
  cases += run_case(gen, {300, 1000, 64, 64, 27, 32, 4, 0.02f, false}, true);
  // Windows summed in the thread's buffer and streamed out
  // (output_window.h): told of a 4 KiB L2, these outputs are large enough;
  // 17 and 33 columns leave rows that start and end inside 16- and 64-byte
  // blocks. 80 columns (320-byte rows) are summed in place.
  isa::set_l2_cache_bytes(4096);
  for (int64_t cout : {16, 17, 33, 64, 80}) {
    const bool streamed = stream_output(1000 * cout * 4, cout * 4);
    if (streamed != (cout <= 64)) fail("stream_output for " + std::to_string(cout) + " columns");
    cases += run_case(gen, {300, 1000, 64, cout, 27, 32, 8, cout == 33 ? 0.03f : 0.0f, false},
                      true);
  }
  isa::set_l2_cache_bytes(-1);
  std::printf("amx int8: %d cases, seed %u, %s\n", cases, seed, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
