// Entropy coding: rANS and range coding of integer symbols, and an octree
// occupancy coder of voxel sets built on the range coder.
//
// Plain C++ over pointers (no MLX include), single-threaded (a stream is
// sequential). Probabilities are integer frequencies summing to 2^bits
// (bits <= 16). Errors are std::invalid_argument with a message naming the
// argument; every symbol, table entry and stream byte is validated before it
// indexes memory, so malformed tables or streams raise instead of reading
// out of bounds. Stream formats are documented in entropy_coders.h
// (rANS, range) and entropy_occupancy.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mlx_lattice::entropy {

// The coders' probability precision: frequencies sum to 2^kMaxPrecision at most.
inline constexpr int kMaxPrecision = 16;

enum class Coder { kRans, kRange };

// Integer frequencies summing to 2^bits from n non-negative probabilities
// (any positive total; normalised here). Every symbol with a nonzero
// probability gets frequency >= 1, zero probabilities get 0; the rest of the
// budget goes where it costs the fewest bits (greedy on the cross-entropy,
// ties to the lower index).
std::vector<uint32_t> quantize_probabilities(const double* probs, int64_t n, int bits);

// One table for every symbol: freqs (n_symbols entries, summing to 2^bits).
std::vector<uint8_t> encode_table(Coder coder, const int64_t* symbols, int64_t n,
                                  const uint32_t* freqs, int64_t n_symbols, int bits);
std::vector<int32_t> decode_table(Coder coder, const uint8_t* data, size_t size,
                                  const uint32_t* freqs, int64_t n_symbols, int bits, int64_t n);

// One CDF row per symbol: cdfs is n_rows x width int32 (width = alphabet size
// + 1, cdf[0] = 0, nondecreasing, cdf[width - 1] = 2^bits); symbol i uses row
// indexes[i] (or row i when indexes is null, then n_rows == n).
std::vector<uint8_t> encode_cdfs(Coder coder, const int64_t* symbols, int64_t n,
                                 const int32_t* cdfs, int64_t n_rows, int64_t width,
                                 const int64_t* indexes, int bits);
std::vector<int32_t> decode_cdfs(Coder coder, const uint8_t* data, size_t size,
                                 const int32_t* cdfs, int64_t n_rows, int64_t width,
                                 const int64_t* indexes, int64_t n, int bits);

// Octree occupancy stream of n rows of dims (3: x, y, z; 4: batch, x, y, z)
// int32 coordinates; duplicates are coded once.
std::vector<uint8_t> encode_occupancy(const int32_t* coords, int64_t n, int dims);

struct DecodedCoords {
  int dims = 3;
  std::vector<int32_t> coords;  // rows of dims, sorted lexicographically, unique
};
DecodedCoords decode_occupancy(const uint8_t* data, size_t size);

}  // namespace mlx_lattice::entropy
