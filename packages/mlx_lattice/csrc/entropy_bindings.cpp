// Python bindings of the entropy coders (thin; documented in
// mlx_lattice.coding, which checks shapes and dtypes and calls these). Plain
// NumPy buffers and bytes in and out: coding is not differentiable, so there
// is no MLX primitive. The GIL is released while a stream is coded.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "cpu/entropy.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace ent = mlx_lattice::entropy;

namespace {

using Symbols = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Probs = nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Freqs = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Cdfs = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Coords = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

ent::Coder coder_of(const std::string& name) {
  if (name == "rans") return ent::Coder::kRans;
  if (name == "range") return ent::Coder::kRange;
  throw std::invalid_argument("method must be 'rans' or 'range', got '" + name + "'.");
}

template <typename T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T>&& v, std::initializer_list<size_t> shape) {
  auto* held = new std::vector<T>(std::move(v));
  nb::capsule owner(held, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(held->data(), shape, owner);
}

nb::bytes to_bytes(const std::vector<uint8_t>& v) {
  return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

const uint8_t* bytes_data(const nb::bytes& b) {
  return reinterpret_cast<const uint8_t*>(b.c_str());
}

}  // namespace

namespace mlx_lattice {

void bind_entropy(nb::module_& m) {
  m.def(
      "entropy_quantize_probabilities",
      [](Probs probs, int bits) {
        std::vector<uint32_t> f;
        {
          nb::gil_scoped_release unlocked;
          f = ent::quantize_probabilities(probs.data(), static_cast<int64_t>(probs.shape(0)), bits);
        }
        const size_t n = f.size();
        return to_numpy(std::move(f), {n});
      },
      "probs"_a, "bits"_a,
      "Integer frequencies summing to 2^bits (nonzero probabilities get >= 1).");

  m.def(
      "entropy_encode_table",
      [](const std::string& method, Symbols symbols, Freqs freqs, int bits) {
        const ent::Coder coder = coder_of(method);
        std::vector<uint8_t> out;
        {
          nb::gil_scoped_release unlocked;
          out = ent::encode_table(coder, symbols.data(), static_cast<int64_t>(symbols.shape(0)),
                                  freqs.data(), static_cast<int64_t>(freqs.shape(0)), bits);
        }
        return to_bytes(out);
      },
      "method"_a, "symbols"_a, "freqs"_a, "bits"_a,
      "rANS or range stream of int64 symbols under one frequency table.");

  m.def(
      "entropy_decode_table",
      [](const std::string& method, nb::bytes data, Freqs freqs, int bits, int64_t n) {
        const ent::Coder coder = coder_of(method);
        std::vector<int32_t> out;
        {
          nb::gil_scoped_release unlocked;
          out = ent::decode_table(coder, bytes_data(data), data.size(), freqs.data(),
                                  static_cast<int64_t>(freqs.shape(0)), bits, n);
        }
        const size_t size = out.size();
        return to_numpy(std::move(out), {size});
      },
      "method"_a, "data"_a, "freqs"_a, "bits"_a, "n"_a,
      "The n int32 symbols of a stream of entropy_encode_table.");

  m.def(
      "entropy_encode_cdfs",
      [](const std::string& method, Symbols symbols, Cdfs cdfs, std::optional<Symbols> indexes,
         int bits) {
        const ent::Coder coder = coder_of(method);
        std::vector<uint8_t> out;
        {
          nb::gil_scoped_release unlocked;
          out = ent::encode_cdfs(coder, symbols.data(), static_cast<int64_t>(symbols.shape(0)),
                                 cdfs.data(), static_cast<int64_t>(cdfs.shape(0)),
                                 static_cast<int64_t>(cdfs.shape(1)),
                                 indexes ? indexes->data() : nullptr, bits);
        }
        return to_bytes(out);
      },
      "method"_a, "symbols"_a, "cdfs"_a, "indexes"_a.none(), "bits"_a,
      "rANS or range stream of int64 symbols, each under its own CDF row.");

  m.def(
      "entropy_decode_cdfs",
      [](const std::string& method, nb::bytes data, Cdfs cdfs, std::optional<Symbols> indexes,
         int64_t n, int bits) {
        const ent::Coder coder = coder_of(method);
        std::vector<int32_t> out;
        {
          nb::gil_scoped_release unlocked;
          out = ent::decode_cdfs(coder, bytes_data(data), data.size(), cdfs.data(),
                                 static_cast<int64_t>(cdfs.shape(0)),
                                 static_cast<int64_t>(cdfs.shape(1)),
                                 indexes ? indexes->data() : nullptr, n, bits);
        }
        const size_t size = out.size();
        return to_numpy(std::move(out), {size});
      },
      "method"_a, "data"_a, "cdfs"_a, "indexes"_a.none(), "n"_a, "bits"_a,
      "The n int32 symbols of a stream of entropy_encode_cdfs.");

  m.def(
      "entropy_encode_occupancy",
      [](Coords coords) {
        std::vector<uint8_t> out;
        {
          nb::gil_scoped_release unlocked;
          out = ent::encode_occupancy(coords.data(), static_cast<int64_t>(coords.shape(0)),
                                      static_cast<int>(coords.shape(1)));
        }
        return to_bytes(out);
      },
      "coords"_a, "Octree occupancy stream of an (N, 3) or (N, 4) int32 voxel set.");

  m.def(
      "entropy_decode_occupancy",
      [](nb::bytes data) {
        ent::DecodedCoords d;
        {
          nb::gil_scoped_release unlocked;
          d = ent::decode_occupancy(bytes_data(data), data.size());
        }
        const size_t rows = d.coords.size() / static_cast<size_t>(d.dims);
        const size_t dims = static_cast<size_t>(d.dims);
        return to_numpy(std::move(d.coords), {rows, dims});
      },
      "data"_a, "The sorted unique voxel set of an occupancy stream.");
}

}  // namespace mlx_lattice
