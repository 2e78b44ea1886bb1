#include "gemm_int8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLX_LATTICE_X86 1
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "amx_int8.h"
#include "avx2_lanes.h"
#include "isa.h"
#include "line_vector.h"
#include "output_window.h"
#include "parallel.h"
#include "quantized_weight.h"
#include "tiles.h"

// GCC 12 reports _mm512_cvtepi32_ps's own undefined pass-through operand as
// "maybe uninitialized"; it is not read.
#if defined(__GNUC__) && !defined(__clang__)  // clang has no such group (macOS check)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// Keeps a product rounded on its own: the compiler may not fuse it with the
// following add into an FMA (every path must round exactly as the scalar
// one, and as the documented math).
#define MLX_LATTICE_ROUNDED(v) asm("" : "+v"(v))

// The scalar path needs the same where the target has a scalar FMA that GCC
// contracts into by default in C++ (AArch64: found by the emulated tests,
// where block_scalar differed from the documented math and the NEON paths).
#if defined(__aarch64__)
#define MLX_LATTICE_SCALAR_ROUNDED(v) asm("" : "+w"(v))
#else
#define MLX_LATTICE_SCALAR_ROUNDED(v) static_cast<void>(v)
#endif

namespace mlx_lattice::kernels {

namespace {

constexpr int kRows = 6;  // rows per register block

// Codes of at most this many bits are "narrow" for the AVX2 kernel (summed
// in int16 as they are); wider ones are packed centered for it.
constexpr int kNarrowBits = 4;

}  // namespace

// The weight in the micro-kernels' layout: codes[k][quad j][cout_pad][4]
// (4 consecutive input channels of one column per 32-bit lane), scales and
// biases [k][group][cout_pad]; padded columns are zero.
struct PackedInt8Weight {
  LineVector<uint8_t> codes;
  LineVector<float> scales;
  LineVector<float> biases;
  int64_t quads = 0;  // storage_in / 4
  int64_t groups = 0;
  int64_t cout_pad = 0;
  int bits = 8;  // codes lie in 0 .. 2^bits - 1
  // The AVX2 kernel's form of codes wider than 4 bits (filled only for
  // it): c ^ 0x80 (c - 128 as a signed byte) and its magnitude |c - 128|.
  LineVector<int8_t> centered;
  LineVector<uint8_t> magnitude;
};

namespace {

using PackedWeight = PackedInt8Weight;

// One block of kRows rows over every column. Rows: a[r] (int8, quads * 4),
// sa[r], gsum[r] (groups). c[r] (cout floats) accumulates.
struct Block {
  int rows = kRows;  // real rows; the others are padding (zero rows, a sink)
  const int8_t* a[kRows];
  float sa[kRows];
  const int32_t* gsum[kRows];
  float* c[kRows];
  bool nonneg = false;  // every code of the real rows is >= 0 (offset_avx2)
};

// The edges of one offset k inside one tile: edge i reads quantized input
// row rows[i] and accumulates into tile-local output row outs[i].
struct OffsetJob {
  const int32_t* rows;
  const int32_t* outs;
  int64_t count;
  const int8_t* q;  // quantized rows (stride int8 each)
  const float* scale;
  const int32_t* gsum;  // per-row group sums (groups each)
  int64_t stride;
  int64_t groups;
  float* tile_out;  // the tile's first output row (cout floats each)
  bool static_scale;  // rows' scales are 1 (or NaN): "* sa" may be left out
  bool all_unit;      // static and no row non-finite: every scale is 1
  const uint8_t* nonneg = nullptr;  // per row: no code < 0 (AVX2 path only)
};

// One call per tile and offset: every ISA path runs its 6-row blocks inside
// (no call through a pointer per block).
using OffsetFn = void (*)(const OffsetJob& job, const PackedWeight& w, int64_t k, int64_t cout);

// Row i of the job into slot r of a block; its scale too unless SkipScale
// (every row's scale is 1 and the kernel leaves "* sa" out).
template <bool SkipScale = false>
inline void fill_row(Block& blk, int r, const OffsetJob& job, int64_t i, int64_t cout) {
  const int64_t row = job.rows[i];
  blk.a[r] = job.q + row * job.stride;
  if constexpr (!SkipScale) blk.sa[r] = job.scale[row];
  blk.gsum[r] = job.gsum + row * job.groups;
  blk.c[r] = job.tile_out + static_cast<int64_t>(job.outs[i]) * cout;
}

// Requests the quantized rows of the block of `rows` edges after the one at
// `i` (gathered from anywhere in the quantized features) behind this
// block's arithmetic.
inline void prefetch_next(const OffsetJob& job, int64_t i, int64_t rows = kRows) {
  const int64_t end = std::min<int64_t>(job.count, i + 2 * rows);
  for (int64_t n = i + rows; n < end; ++n) {
    prefetch_lines(job.q + job.rows[n] * job.stride, job.stride);
  }
}

// The blocks of one job for a micro-kernel that always computes kRows rows:
// a last partial block is padded with a zero row (sa 0, sums 0) adding
// into a sink.
template <void (*Kernel)(const Block&, const PackedWeight&, int64_t, int64_t)>
void padded_blocks(const OffsetJob& job, const PackedWeight& w, int64_t k, int64_t cout) {
  thread_local LineVector<int8_t> zero_row_tls;
  thread_local std::vector<int32_t> zero_sums_tls;
  thread_local LineVector<float> sink_tls;
  auto& zero_row = this_thread(zero_row_tls);
  auto& zero_sums = this_thread(zero_sums_tls);
  auto& sink = this_thread(sink_tls);
  if (static_cast<int64_t>(zero_row.size()) < job.stride) zero_row.assign(job.stride, 0);
  if (static_cast<int64_t>(zero_sums.size()) < job.groups) zero_sums.assign(job.groups, 0);
  if (static_cast<int64_t>(sink.size()) < cout) sink.assign(cout, 0.0f);
  Block blk{};
  for (int64_t i = 0; i < job.count; i += kRows) {
    prefetch_next(job, i);
    blk.rows = static_cast<int>(std::min<int64_t>(kRows, job.count - i));
    for (int r = 0; r < kRows; ++r) {
      if (r < blk.rows) {
        fill_row(blk, r, job, i + r, cout);
      } else {
        blk.a[r] = zero_row.data();
        blk.sa[r] = 0.0f;
        blk.gsum[r] = zero_sums.data();
        blk.c[r] = sink.data();
      }
    }
    Kernel(blk, w, k, cout);
  }
}

int32_t load_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void block_scalar(const Block& blk, const PackedWeight& w, int64_t k, int64_t cout) {
  const int64_t qpg = w.quads / w.groups;
  const uint8_t* codes = w.codes.data() + k * w.quads * w.cout_pad * 4;
  for (int r = 0; r < kRows; ++r) {
    for (int64_t g = 0; g < w.groups; ++g) {
      const float* s = w.scales.data() + (k * w.groups + g) * w.cout_pad;
      const float* b = w.biases.data() + (k * w.groups + g) * w.cout_pad;
      const float asum = static_cast<float>(blk.gsum[r][g]);
      for (int64_t x = 0; x < cout; ++x) {
        int32_t acc = 0;
        for (int64_t j = g * qpg; j < (g + 1) * qpg; ++j) {
          const uint8_t* q = codes + (j * w.cout_pad + x) * 4;
          const int8_t* a = blk.a[r] + 4 * j;
          acc += q[0] * a[0] + q[1] * a[1] + q[2] * a[2] + q[3] * a[3];
        }
        float t = static_cast<float>(acc) * s[x];
        float u = asum * b[x];
        MLX_LATTICE_SCALAR_ROUNDED(t);
        MLX_LATTICE_SCALAR_ROUNDED(u);
        t = t + u;
        float v = t * blk.sa[r];
        MLX_LATTICE_SCALAR_ROUNDED(v);
        blk.c[r][x] = blk.c[r][x] + v;
      }
    }
  }
}

#include "gemm_int8_x86.inc"  // AVX512-VNNI, AVX-VNNI and AVX2 blocks

#include "gemm_int8_neon.inc"  // AArch64 SDOT/USDOT blocks

// The int8 micro-kernels, best first (cpu/isa.h); the last is scalar. An
// entry runs either per offset (offset) or per block of output rows (rows:
// the AMX output-stationary driver).
struct Int8Entry {
  isa::Isa isa;
  OffsetFn offset;
  Int8RowsFn rows = nullptr;
  bool centered = false;  // reads PackedWeight::centered and ::magnitude
};

const Int8Entry kInt8Table[] = {
#ifdef MLX_LATTICE_X86
    {isa::Isa::kAmxInt8, nullptr, kAmxInt8RowsHw},
    {isa::Isa::kAvx512Vnni, offset_avx512_vnni},
    {isa::Isa::kAvxVnni, padded_blocks<block_avx_vnni>},
    {isa::Isa::kAvx2, offset_avx2, nullptr, true},
#endif
#if defined(__aarch64__)
    {isa::Isa::kNeonI8mm, padded_blocks<block_neon_int8<true>>},
    {isa::Isa::kNeonDot, padded_blocks<block_neon_int8<false>>},
#endif
    {isa::Isa::kScalar, padded_blocks<block_scalar>},
};

#ifdef MLX_LATTICE_X86
// The AVX512-VNNI entry, where AMX is picked but cannot or should not run.
const Int8Entry& avx512_vnni_entry() { return kInt8Table[1]; }
#endif

// Picked per call: set_isa_ceiling() takes effect at once. The AMX entry
// is usable only where its driver was built.
const Int8Entry& selected() {
  const Int8Entry& entry = isa::pick(kInt8Table);
#ifdef MLX_LATTICE_X86
  if (entry.offset == nullptr && entry.rows == nullptr) return avx512_vnni_entry();
#endif
  return entry;
}

// The entry for a convolution of cin -> cout channels: selected(), except
// that where that is AMX and both are at most kVnniChannels, the
// AVX512-VNNI path runs instead (same bits). Two A tile chunks of 16 rows
// and two C tiles per batch leave the tile unit mostly idle behind the
// gather and the epilogue: on the Intel AMX host w8a8 at C32 (groups of
// 32) took 4.6-4.8 ms on VNNI against 5.4-5.5 ms on AMX, while at C64 and
// C128 AMX was faster (benchmarks/LOG.md, "Output windows").
const Int8Entry& selected_for(int64_t cin, int64_t cout) {
  const Int8Entry& entry = selected();
#ifdef MLX_LATTICE_X86
  constexpr int64_t kVnniChannels = 32;
  if (entry.isa == isa::Isa::kAmxInt8 && cin <= kVnniChannels && cout <= kVnniChannels &&
      isa::isa_usable(isa::Isa::kAvx512Vnni)) {
    return avx512_vnni_entry();
  }
#else
  static_cast<void>(cin);
  static_cast<void>(cout);
#endif
  return entry;
}

// Unpacks the codes of the affine layout into the micro-kernel layout.
// act_scale > 0 (static): the scales and biases are premultiplied by it.
// centered: codes wider than 4 bits also as c ^ 0x80 and |c - 128|.
void pack_weight(const uint8_t* packed, int64_t row_bytes, const float* scales,
                 const float* biases, int64_t n_kernels, int64_t cout, int64_t cin,
                 int64_t storage_in, int64_t group, int bits, float act_scale, bool centered,
                 PackedWeight& w) {
  w.quads = storage_in / 4;
  w.groups = storage_in / group;
  w.cout_pad = ceil_div(cout, 16) * 16;
  w.bits = bits;
  w.codes.assign(n_kernels * w.quads * w.cout_pad * 4, 0);
  w.scales.assign(n_kernels * w.groups * w.cout_pad, 0.0f);
  w.biases.assign(n_kernels * w.groups * w.cout_pad, 0.0f);
  const bool center = centered && bits > kNarrowBits;
  const int64_t slab = w.quads * w.cout_pad * 4;  // one offset's codes
  if (center) {
    w.centered.resize(n_kernels * slab);
    w.magnitude.resize(n_kernels * slab);
  }
  parallel_for(n_kernels, [&](int64_t k) {
    for (int64_t o = 0; o < cout; ++o) {
      const int64_t row = k * cout + o;
      const uint8_t* p = packed + row * row_bytes;
      // Channels past cin stay 0 (their activations are 0 too). Whole
      // quads of 8- and 4-bit codes are one 4- or 2-byte read each (code c
      // at bit c * bits, little-endian: unpack_code's values); the rest
      // code by code.
      uint8_t* dst = w.codes.data() + (k * w.quads * w.cout_pad + o) * 4;
      const int64_t step = w.cout_pad * 4;  // from one quad to the next
      int64_t c = 0;
      if (bits == 8) {
        for (; c + 4 <= cin; c += 4) std::memcpy(dst + (c / 4) * step, p + c, 4);
      } else if (bits == 4) {
        for (; c + 4 <= cin; c += 4) {
          const uint8_t lo = p[c / 2], hi = p[c / 2 + 1];
          uint8_t* q = dst + (c / 4) * step;
          q[0] = lo & 15u;
          q[1] = lo >> 4;
          q[2] = hi & 15u;
          q[3] = hi >> 4;
        }
      }
      for (; c < cin; ++c) {
        dst[(c / 4) * step + c % 4] = static_cast<uint8_t>(unpack_code(p, row_bytes, c, bits));
      }
      for (int64_t g = 0; g < w.groups; ++g) {
        float s = scales[row * w.groups + g];
        float b = biases[row * w.groups + g];
        if (act_scale > 0.0f) {
          s = s * act_scale;
          b = b * act_scale;
        }
        w.scales[(k * w.groups + g) * w.cout_pad + o] = s;
        w.biases[(k * w.groups + g) * w.cout_pad + o] = b;
      }
    }
    if (center) {
      for (int64_t i = k * slab; i < (k + 1) * slab; ++i) {
        const int v = static_cast<int>(w.codes[i]) - 128;
        w.centered[i] = static_cast<int8_t>(v);
        w.magnitude[i] = static_cast<uint8_t>(v < 0 ? -v : v);
      }
    }
  });
}

// Output rows per tile of the integer driver (about 56 edges per offset
// and tile on the built-in scan: fewer partial 6-row blocks than
// kTileRows' 28, and a tile's outputs, 64 KB at C64, still stay in L2).
// With 2 MiB of L2 (every AMX host) the tile's float32 rows fill an eighth
// of it (l2_tile_rows; C64: 1024 rows, w8a8 about 6% faster than 256 on the
// Intel AMX host).
constexpr int64_t kInt8TileRows = 256;

// Per-thread scratch of the tile loop, reused across calls. A tile's edges
// grouped by offset into fixed buckets of `cap` slots (slot k * cap + i):
// an output row has at most one edge per offset, so offset k has at most
// one edge per row of the tile.
struct Scratch {
  std::vector<int32_t> rows;   // input row of each slot
  std::vector<int32_t> outs;   // tile-local output row of each slot
  std::vector<int32_t> count;  // edges per offset
  LineVector<float> window;   // the tile's sums where the output is streamed
};

thread_local Scratch scratch;

// The quantized activations and packed weight of one call.
struct Buffers {
  LineVector<int8_t> q;
  LineVector<float> scale;
  LineVector<int32_t> gsum;
  LineVector<uint8_t> nonneg;
  PackedWeight weight;
};

// feats: float32 rows (quantized here), or codes: int8 rows at act_scale.
// ep: the fused epilogue (int8_conv_fused), or null for float32 sums in out.
void run_int8_conv(OffsetFn run_offset, Int8RowsFn run_rows, bool centered, const float* feats,
                   const int8_t* codes, int64_t n_in, int64_t cin, const uint8_t* packed,
                   int64_t row_bytes, const float* scales, const float* biases, int64_t n_kernels,
                   int64_t cout, int64_t storage_in, int64_t group, int bits, float act_scale,
                   const Csr& csr, const int32_t* a_index, const int32_t* kernel_ids,
                   const Int8Epilogue* ep, const PackedWeight* packed_weight, void* out_data) {
  // Reused per evaluating thread (fresh multi-megabyte buffers per call cost
  // more in page faults than the quantization itself).
  // (A reference: the worker threads below must see this thread's buffers,
  // not their own thread_local instances.)
  thread_local Buffers buffers;
  Buffers& buf = this_thread(buffers);
  float* const out = static_cast<float*>(out_data);  // the float32 sums (no epilogue)
  const int64_t groups = storage_in / group;
  buf.q.resize(n_in * storage_in);
  buf.scale.resize(n_in);
  buf.gsum.resize(n_in * groups);
  // Static scale: every finite row's scale is 1 here (the kernels' "* sa" is
  // then exact and left out), S is folded into the weight's scales and biases.
  const bool static_scale = act_scale > 0.0f;
  const bool mark = centered && bits > kNarrowBits;  // the AVX2 kernel's wide codes
  if (mark) buf.nonneg.resize(n_in);
  uint8_t* const nonneg = mark ? buf.nonneg.data() : nullptr;
  if (codes != nullptr) {
    load_rows_int8(codes, n_in, cin, storage_in, group, buf.q.data(), buf.scale.data(),
                   buf.gsum.data(), nonneg);
  } else {
    quantize_rows_int8(feats, n_in, cin, storage_in, group, buf.q.data(), buf.scale.data(),
                       buf.gsum.data(), act_scale, nonneg);
  }
  // Static and every row finite (the usual case): the kernels need no
  // row's scale at all.
  const bool all_unit =
      static_scale && std::all_of(buf.scale.begin(), buf.scale.begin() + n_in,
                                  [](float v) { return v == 1.0f; });
  // A given packed weight serves when it is packed for this kernel (the
  // ISA cap may have changed since it was packed); otherwise pack it here.
  const bool fits = packed_weight != nullptr &&
                    packed_weight->centered.empty() == !(centered && bits > kNarrowBits);
  if (!fits) {
    pack_weight(packed, row_bytes, scales, biases, n_kernels, cout, cin, storage_in, group, bits,
                act_scale, centered, buf.weight);
  }
  const PackedWeight& w = fits ? *packed_weight : buf.weight;
  // A float32 output with an epilogue is summed and finished in place, as
  // the plain sums are (int8_epilogue_rows then copies nothing).
  const bool f32_in_place =
      ep == nullptr || (ep->out_scale == 0.0f && ep->out_format == FloatFormat::kF32);
  const int64_t tile_rows = l2_tile_rows(cout * 4, kInt8TileRows, csr.groups, 8);
  if (run_rows) {
    const amx_int8::Rows rows_view{buf.q.data(), buf.scale.data(), buf.gsum.data(), storage_in,
                                   static_scale};
    const amx_int8::Weights w_view{w.codes.data(), w.scales.data(), w.biases.data(), w.quads,
                                   w.groups, w.cout_pad, n_kernels, cout};
    // With an epilogue the driver's float32 sums go to a per-thread buffer
    // of the whole output first (the drivers address the output by row).
    thread_local LineVector<float> sums_tls;
    float* sums = out;
    if (!f32_in_place) {
      auto& sums_buf = this_thread(sums_tls);
      sums = window_buffer(sums_buf, csr.groups * cout);
    }
    parallel_for_windows(csr.groups, tile_rows, [&](int64_t g0, int64_t g1) {
      run_rows(rows_view, w_view, group, csr, a_index, kernel_ids, g0, g1, sums);
      if (ep != nullptr) {
        int8_epilogue_rows(sums + g0 * cout, g0, g1, cout, *ep, f32_in_place ? nullptr : out_data);
      }
    });
    return;
  }
  const bool stream = stream_output(csr.groups * cout * int64_t{4}, cout * int64_t{4});
  parallel_for_windows(csr.groups, tile_rows, [&](int64_t g0, int64_t g1) {
    auto& s = this_thread(scratch);
    const int64_t cap = g1 - g0;
    s.count.resize(n_kernels);
    fit_buckets(n_kernels * cap, s.rows, s.outs);
    // Pointers captured by value: the library builds with
    // -fno-strict-aliasing, so captured references would be reloaded after
    // every store.
    int32_t* rows = s.rows.data();
    int32_t* outs = s.outs.data();
    bucket_tile_edges(csr, g0, g1, kernel_ids, n_kernels, s.count.data(),
                      [rows, outs, cap, a_index](int32_t k, int32_t n, int32_t local, int32_t e) {
                        rows[k * cap + n] = a_index[e];
                        outs[k * cap + n] = local;
                      });
    // Zeroed here rather than skipped on each row's first contribution:
    // writing the tile at once is cheaper than the kernels' scattered
    // first stores missing the cache. Summed in place, or in the thread's
    // buffer and streamed out (output_window.h).
    float* tile =
        stream || !f32_in_place ? window_buffer(s.window, cap * cout) : out + g0 * cout;
    std::memset(tile, 0, sizeof(float) * cap * cout);
    OffsetJob job{nullptr,         nullptr,    0,      buf.q.data(), buf.scale.data(),
                  buf.gsum.data(), storage_in, groups, tile,         static_scale,
                  all_unit,        nonneg};
    for (int64_t k = 0; k < n_kernels; ++k) {
      job.rows = s.rows.data() + k * cap;
      job.outs = s.outs.data() + k * cap;
      job.count = s.count[k];
      if (job.count > 0) run_offset(job, w, k, cout);
    }
    if (ep != nullptr) int8_epilogue_rows(tile, g0, g1, cout, *ep, f32_in_place ? nullptr : out_data);
    if (stream && f32_in_place) stream_rows(out + g0 * cout, tile, sizeof(float) * cap * cout);
  });
}

}  // namespace

std::shared_ptr<const PackedInt8Weight> pack_int8_weight(
    const uint8_t* packed, int64_t row_bytes, const float* scales, const float* biases,
    int64_t n_kernels, int64_t cout, int64_t cin, int64_t storage_in, int64_t group, int bits,
    float in_scale) {
  auto w = std::make_shared<PackedInt8Weight>();
  pack_weight(packed, row_bytes, scales, biases, n_kernels, cout, cin, storage_in, group, bits,
              in_scale, selected_for(cin, cout).centered, *w);
  return w;
}

size_t packed_int8_weight_bytes(const PackedInt8Weight& w) {
  return w.codes.size() + w.centered.size() + w.magnitude.size() +
         sizeof(float) * (w.scales.size() + w.biases.size());
}

bool int8_weight_centered(int64_t cin, int64_t cout, int bits) {
  return selected_for(cin, cout).centered && bits > kNarrowBits;
}

void int8_conv(const float* feats, int64_t n_in, int64_t cin, const uint8_t* packed,
               int64_t row_bytes, const float* scales, const float* biases, int64_t n_kernels,
               int64_t cout, int64_t storage_in, int64_t group, int bits, float act_scale,
               const Csr& csr, const int32_t* a_index, const int32_t* c_index,
               const int32_t* kernel_ids, float* out) {
  // An edge's output row is its CSR group (c_index repeats it; unread).
  static_cast<void>(c_index);
  const Int8Entry& entry = selected_for(cin, cout);
  run_int8_conv(entry.offset, entry.rows, entry.centered, feats, nullptr, n_in, cin, packed,
                row_bytes, scales, biases, n_kernels, cout, storage_in, group, bits, act_scale,
                csr, a_index, kernel_ids, nullptr, nullptr, out);
}

void int8_conv_fused(const float* feats, const int8_t* codes, int64_t n_in, int64_t cin,
                     const uint8_t* packed, int64_t row_bytes, const float* scales,
                     const float* biases, int64_t n_kernels, int64_t cout, int64_t storage_in,
                     int64_t group, int bits, float in_scale, const Csr& csr,
                     const int32_t* a_index, const int32_t* kernel_ids, const Int8Epilogue& ep,
                     void* out, const PackedInt8Weight* weight) {
  const Int8Entry& entry = selected_for(cin, cout);
  run_int8_conv(entry.offset, entry.rows, entry.centered, feats, codes, n_in, cin, packed,
                row_bytes, scales, biases, n_kernels, cout, storage_in, group, bits, in_scale,
                csr, a_index, kernel_ids, &ep, weight, out);
}

void int8_conv_rows(Int8RowsFn rows, const float* feats, int64_t n_in, int64_t cin,
                    const uint8_t* packed, int64_t row_bytes, const float* scales,
                    const float* biases, int64_t n_kernels, int64_t cout, int64_t storage_in,
                    int64_t group, int bits, float act_scale, const Csr& csr,
                    const int32_t* a_index, const int32_t* kernel_ids, float* out) {
  run_int8_conv(nullptr, rows, false, feats, nullptr, n_in, cin, packed, row_bytes, scales,
                biases, n_kernels, cout, storage_in, group, bits, act_scale, csr, a_index,
                kernel_ids, nullptr, nullptr, out);
}

void int8_conv_rows_fused(Int8RowsFn rows, const float* feats, const int8_t* codes, int64_t n_in,
                          int64_t cin, const uint8_t* packed, int64_t row_bytes,
                          const float* scales, const float* biases, int64_t n_kernels,
                          int64_t cout, int64_t storage_in, int64_t group, int bits,
                          float in_scale, const Csr& csr, const int32_t* a_index,
                          const int32_t* kernel_ids, const Int8Epilogue& ep, void* out) {
  run_int8_conv(nullptr, rows, false, feats, codes, n_in, cin, packed, row_bytes, scales, biases,
                n_kernels, cout, storage_in, group, bits, in_scale, csr, a_index, kernel_ids,
                &ep, nullptr, out);
}

const char* int8_isa() { return isa::isa_name(selected().isa); }

}  // namespace mlx_lattice::kernels
