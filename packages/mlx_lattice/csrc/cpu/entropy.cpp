// Entropy coders (entropy.h).
//
// rANS: 32-bit state x in [2^23, 2^31), byte-wise renormalisation. Symbols
// are encoded last to first; the stream is the final state (4 bytes, little
// endian) followed by the renormalisation bytes in the order the decoder
// reads them. Decoding ends with the initial state 2^23 and every byte read.
//
// Range coder: 64-bit low, 32-bit range kept >= 2^24, carries propagated
// through a cached byte (the LZMA scheme). The stream starts with the
// always-zero cache byte and ends with the 5 flush bytes; the decoder reads
// exactly every byte.
//
// Occupancy stream (little endian): "MLOC", version 1 (u8), dims (u8),
// batch count (u32); per batch: batch id (i32), voxel count (u32), origin
// x, y, z (i32 each), depth (u8); then one range-coded payload. Per batch
// and octree level (root first), each node's occupancy byte (bit
// 4 * bx + 2 * by + bz set when that child is occupied; nodes in Morton
// order, x most significant) is coded bit by bit (child 7 first) under
// adaptive binary probabilities chosen by the bits already coded and by how
// many of the node's 6 face neighbours are occupied nodes of the same level
// (both sides know them); every probability restarts at 1/2 on each level.
#include "entropy.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <queue>
#include <stdexcept>
#include <string>

namespace mlx_lattice::entropy {

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

[[noreturn]] void corrupt(const char* what) {
  fail(std::string("data: corrupt stream (") + what + ").");
}

void check_bits(int bits) {
  if (bits < 1 || bits > kMaxPrecision) {
    fail("precision must be in [1, " + std::to_string(kMaxPrecision) + "] bits, got " +
         std::to_string(bits) + ".");
  }
}

void check_count(int64_t n) {
  if (n < 0 || n > std::numeric_limits<int32_t>::max()) {
    fail("n must be in [0, 2^31 - 1], got " + std::to_string(n) + ".");
  }
}

// ---- rANS ---------------------------------------------------------------------------------

constexpr uint32_t kRansLow = 1u << 23;

class RansEncoder {
 public:
  void put(uint32_t start, uint32_t freq, int bits) {
    const uint32_t x_max = ((kRansLow >> bits) << 8) * freq;
    while (x_ >= x_max) {
      reversed_.push_back(static_cast<uint8_t>(x_ & 0xff));
      x_ >>= 8;
    }
    x_ = ((x_ / freq) << bits) + (x_ % freq) + start;
  }
  std::vector<uint8_t> finish() {
    std::vector<uint8_t> out;
    out.reserve(reversed_.size() + 4);
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(x_ >> (8 * i)));
    out.insert(out.end(), reversed_.rbegin(), reversed_.rend());
    return out;
  }

 private:
  uint32_t x_ = kRansLow;
  std::vector<uint8_t> reversed_;
};

class RansDecoder {
 public:
  RansDecoder(const uint8_t* data, size_t size) : p_(data), end_(data + size) {
    if (size < 4) corrupt("shorter than the 4-byte rANS state");
    x_ = static_cast<uint32_t>(p_[0]) | (static_cast<uint32_t>(p_[1]) << 8) |
         (static_cast<uint32_t>(p_[2]) << 16) | (static_cast<uint32_t>(p_[3]) << 24);
    p_ += 4;
    if (x_ < kRansLow || x_ >= (kRansLow << 8)) corrupt("rANS state out of range");
  }
  uint32_t slot(int bits) const { return x_ & ((1u << bits) - 1); }
  void advance(uint32_t start, uint32_t freq, int bits) {
    x_ = freq * (x_ >> bits) + (x_ & ((1u << bits) - 1)) - start;
    while (x_ < kRansLow) {
      if (p_ == end_) corrupt("truncated");
      x_ = (x_ << 8) | *p_++;
    }
  }
  void finish() const {
    if (p_ != end_) corrupt("bytes left after the last symbol");
    if (x_ != kRansLow) corrupt("final rANS state mismatch");
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
  uint32_t x_ = 0;
};

// ---- range coder --------------------------------------------------------------------------

constexpr uint32_t kRangeTop = 1u << 24;

class RangeEncoder {
 public:
  // bits <= 16 and range >= 2^24, so range >> bits >= 2^8.
  void put_shift(uint32_t start, uint32_t freq, int bits) {
    const uint32_t r = range_ >> bits;
    low_ += static_cast<uint64_t>(r) * start;
    range_ = r * freq;
    normalize();
  }
  std::vector<uint8_t> finish() {
    for (int i = 0; i < 5; ++i) shift_low();
    return std::move(out_);
  }

 private:
  void normalize() {
    while (range_ < kRangeTop) {
      range_ <<= 8;
      shift_low();
    }
  }
  void shift_low() {
    if (static_cast<uint32_t>(low_) < 0xFF000000u || (low_ >> 32) != 0) {
      const auto carry = static_cast<uint8_t>(low_ >> 32);
      uint8_t byte = cache_;
      do {
        out_.push_back(static_cast<uint8_t>(byte + carry));
        byte = 0xFF;
      } while (--pending_ != 0);
      cache_ = static_cast<uint8_t>(low_ >> 24);
    }
    ++pending_;
    low_ = (low_ & 0x00FFFFFFu) << 8;
  }

  uint64_t low_ = 0;
  uint32_t range_ = 0xFFFFFFFFu;
  uint8_t cache_ = 0;
  uint64_t pending_ = 1;
  std::vector<uint8_t> out_;
};

class RangeDecoder {
 public:
  RangeDecoder(const uint8_t* data, size_t size) : p_(data), end_(data + size) {
    if (size < 5) corrupt("shorter than the 5-byte range coder head");
    if (p_[0] != 0) corrupt("range coder head byte is not 0");
    for (int i = 1; i < 5; ++i) code_ = (code_ << 8) | p_[i];
    p_ += 5;
  }
  // The target in [0, 2^bits) of the next symbol; raises when the stream
  // points past the table.
  uint32_t target_shift(int bits) {
    r_ = range_ >> bits;
    return check(code_ / r_, 1u << bits);
  }
  // start <= target < start + freq holds for the symbol looked up, so code
  // stays below range.
  void advance(uint32_t start, uint32_t freq) {
    code_ -= r_ * start;
    range_ = r_ * freq;
    while (range_ < kRangeTop) {
      if (p_ == end_) corrupt("truncated");
      code_ = (code_ << 8) | *p_++;
      range_ <<= 8;
    }
  }
  void finish() const {
    if (p_ != end_) corrupt("bytes left after the last symbol");
  }

 private:
  static uint32_t check(uint32_t v, uint32_t total) {
    if (v >= total) corrupt("range coder target outside the table");
    return v;
  }

  const uint8_t* p_;
  const uint8_t* end_;
  uint32_t code_ = 0;
  uint32_t range_ = 0xFFFFFFFFu;
  uint32_t r_ = 1;
};

// ---- generic drivers ----------------------------------------------------------------------

struct Interval {
  uint32_t start;
  uint32_t freq;
};

struct Decoded {
  int32_t symbol;
  Interval interval;
};

// interval(i) gives symbol i's (validated) interval out of 2^bits.
template <typename IntervalOf>
std::vector<uint8_t> encode_symbols(Coder coder, int64_t n, int bits, IntervalOf interval) {
  if (coder == Coder::kRans) {
    RansEncoder enc;
    for (int64_t i = n - 1; i >= 0; --i) {
      const Interval iv = interval(i);
      enc.put(iv.start, iv.freq, bits);
    }
    return enc.finish();
  }
  RangeEncoder enc;
  for (int64_t i = 0; i < n; ++i) {
    const Interval iv = interval(i);
    enc.put_shift(iv.start, iv.freq, bits);
  }
  return enc.finish();
}

// lookup(i, target) gives the symbol whose interval holds target < 2^bits.
template <typename Lookup>
std::vector<int32_t> decode_symbols(Coder coder, const uint8_t* data, size_t size, int64_t n,
                                    int bits, Lookup lookup) {
  std::vector<int32_t> out(static_cast<size_t>(n));
  if (coder == Coder::kRans) {
    RansDecoder dec(data, size);
    for (int64_t i = 0; i < n; ++i) {
      const Decoded d = lookup(i, dec.slot(bits));
      dec.advance(d.interval.start, d.interval.freq, bits);
      out[i] = d.symbol;
    }
    dec.finish();
    return out;
  }
  RangeDecoder dec(data, size);
  for (int64_t i = 0; i < n; ++i) {
    const Decoded d = lookup(i, dec.target_shift(bits));
    dec.advance(d.interval.start, d.interval.freq);
    out[i] = d.symbol;
  }
  dec.finish();
  return out;
}

// ---- one table ----------------------------------------------------------------------------

std::vector<uint32_t> table_cdf(const uint32_t* freqs, int64_t n_symbols, int bits) {
  check_bits(bits);
  if (n_symbols < 1 || n_symbols > (int64_t{1} << 31)) {
    fail("probs must have between 1 and 2^31 entries, got " + std::to_string(n_symbols) + ".");
  }
  std::vector<uint32_t> cdf(static_cast<size_t>(n_symbols) + 1, 0);
  uint64_t total = 0;
  for (int64_t s = 0; s < n_symbols; ++s) {
    total += freqs[s];
    if (total > (uint64_t{1} << bits)) {
      fail("probs: the frequencies must sum to 2^" + std::to_string(bits) + ", exceeded at entry " +
           std::to_string(s) + ".");
    }
    cdf[s + 1] = static_cast<uint32_t>(total);
  }
  if (total != (uint64_t{1} << bits)) {
    fail("probs: the frequencies must sum to 2^" + std::to_string(bits) + ", got " +
         std::to_string(total) + ".");
  }
  return cdf;
}

void check_symbols(const int64_t* symbols, int64_t n, int64_t n_symbols) {
  for (int64_t i = 0; i < n; ++i) {
    if (symbols[i] < 0 || symbols[i] >= n_symbols) {
      fail("symbols[" + std::to_string(i) + "] = " + std::to_string(symbols[i]) +
           " is outside the alphabet [0, " + std::to_string(n_symbols) + ").");
    }
  }
}

[[noreturn]] void zero_probability(int64_t i, int64_t symbol, const std::string& table) {
  fail("symbols[" + std::to_string(i) + "] = " + std::to_string(symbol) +
       " has zero probability in " + table + ".");
}

// ---- CDF rows -----------------------------------------------------------------------------

void check_cdfs(const int32_t* cdfs, int64_t n_rows, int64_t width, int bits) {
  check_bits(bits);
  if (width < 2) fail("cdfs must have at least 2 columns, got " + std::to_string(width) + ".");
  const int64_t top = int64_t{1} << bits;
  for (int64_t r = 0; r < n_rows; ++r) {
    const int32_t* row = cdfs + r * width;
    const std::string at = "cdfs[" + std::to_string(r) + ", ";
    if (row[0] != 0) fail(at + "0] must be 0, got " + std::to_string(row[0]) + ".");
    if (row[width - 1] != top) {
      fail(at + std::to_string(width - 1) + "] must be 2^" + std::to_string(bits) + " = " +
           std::to_string(top) + ", got " + std::to_string(row[width - 1]) + ".");
    }
    for (int64_t j = 1; j < width; ++j) {
      if (row[j] < row[j - 1]) {
        fail(at + std::to_string(j) + "] = " + std::to_string(row[j]) + " is below cdfs[" +
             std::to_string(r) + ", " + std::to_string(j - 1) + "] = " +
             std::to_string(row[j - 1]) + " (a CDF never decreases).");
      }
    }
  }
}

void check_indexes(const int64_t* indexes, int64_t n, int64_t n_rows) {
  for (int64_t i = 0; i < n; ++i) {
    if (indexes[i] < 0 || indexes[i] >= n_rows) {
      fail("indexes[" + std::to_string(i) + "] = " + std::to_string(indexes[i]) +
           " is outside [0, " + std::to_string(n_rows) + ").");
    }
  }
}

// ---- occupancy ----------------------------------------------------------------------------

// Adaptive binary probabilities of the occupancy bits: one per neighbour
// count (0..6) and position in the byte's binary tree (1..255: the bits
// coded so far, led by a 1), each P(bit = 1) out of 2^12, moved 1/32 of the
// way to every coded bit.
class OccupancyModel {
 public:
  static constexpr int kBits = 12;
  static constexpr uint32_t kOne = 1u << kBits;

  void reset() { p1_.fill(kOne / 2); }
  void encode(RangeEncoder& enc, int context, uint32_t symbol) {
    uint32_t node = 1;
    for (int b = 7; b >= 0; --b) {
      const uint32_t bit = (symbol >> b) & 1u;
      uint16_t& p1 = p1_[context * 256 + node];
      if (bit) {
        enc.put_shift(kOne - p1, p1, kBits);
      } else {
        enc.put_shift(0, kOne - p1, kBits);
      }
      update(p1, bit);
      node = 2 * node + bit;
    }
  }
  uint32_t decode(RangeDecoder& dec, int context) {
    uint32_t node = 1;
    for (int b = 7; b >= 0; --b) {
      uint16_t& p1 = p1_[context * 256 + node];
      const uint32_t bit = dec.target_shift(kBits) >= kOne - p1 ? 1u : 0u;
      if (bit) {
        dec.advance(kOne - p1, p1);
      } else {
        dec.advance(0, kOne - p1);
      }
      update(p1, bit);
      node = 2 * node + bit;
    }
    return node - 256;
  }

 private:
  // p1 stays in [31, 4065]: both intervals keep a nonzero width.
  static void update(uint16_t& p1, uint32_t bit) {
    if (bit) {
      p1 = static_cast<uint16_t>(p1 + ((kOne - p1) >> 5));
    } else {
      p1 = static_cast<uint16_t>(p1 - (p1 >> 5));
    }
  }
  std::array<uint16_t, 7 * 256> p1_{};
};

using Point = std::array<uint32_t, 3>;

// Morton order with x the most significant axis at every level.
bool morton_less(const Point& a, const Point& b) {
  int axis = 0;
  uint32_t top = a[0] ^ b[0];
  for (int d = 1; d < 3; ++d) {
    const uint32_t diff = a[d] ^ b[d];
    if (top < diff && top < (top ^ diff)) {
      axis = d;
      top = diff;
    }
  }
  return a[axis] < b[axis];
}

// Occupied face neighbours (0..6) of node among the Morton-sorted nodes of
// its level: the context of its occupancy byte. Level < 32, so node + 1
// never wraps.
int face_neighbours(const std::vector<Point>& nodes, const Point& node) {
  int count = 0;
  for (int d = 0; d < 3; ++d) {
    for (int step : {-1, 1}) {
      if (step < 0 && node[d] == 0) continue;
      Point q = node;
      q[d] += static_cast<uint32_t>(step);
      count += std::binary_search(nodes.begin(), nodes.end(), q, morton_less);
    }
  }
  return count;
}

uint32_t child_index(const Point& p, int shift) {
  return (((p[0] >> shift) & 1u) << 2) | (((p[1] >> shift) & 1u) << 1) | ((p[2] >> shift) & 1u);
}

bool same_node(const Point& a, const Point& b, int drop) {
  for (int d = 0; d < 3; ++d) {
    if ((uint64_t{a[d]} >> drop) != (uint64_t{b[d]} >> drop)) return false;
  }
  return true;
}

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

uint32_t get_u32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

constexpr uint8_t kMagic[4] = {'M', 'L', 'O', 'C'};
constexpr size_t kHeadSize = 10;
constexpr size_t kBatchHeadSize = 21;

struct BatchHead {
  int32_t batch;
  uint32_t count;
  std::array<int32_t, 3> origin;
  int depth;
};

}  // namespace

// ---- public API ---------------------------------------------------------------------------

std::vector<uint32_t> quantize_probabilities(const double* probs, int64_t n, int bits) {
  check_bits(bits);
  const uint32_t top = 1u << bits;
  if (n < 1) fail("probs must have at least one entry.");
  double sum = 0;
  int64_t nonzero = 0;
  for (int64_t s = 0; s < n; ++s) {
    if (!std::isfinite(probs[s]) || probs[s] < 0) {
      fail("probs[" + std::to_string(s) + "] = " + std::to_string(probs[s]) +
           " is not a finite non-negative number.");
    }
    sum += probs[s];
    nonzero += probs[s] > 0;
  }
  if (!(sum > 0) || !std::isfinite(sum)) fail("probs must have a finite positive sum.");
  if (nonzero > top) {
    fail("probs has " + std::to_string(nonzero) + " nonzero entries, more than the 2^" +
         std::to_string(bits) + " frequencies of the coder's precision.");
  }
  std::vector<uint32_t> freq(static_cast<size_t>(n), 0);
  int64_t total = 0;
  for (int64_t s = 0; s < n; ++s) {
    if (probs[s] > 0) {
      const double scaled = std::min(probs[s] / sum * top, static_cast<double>(top));
      freq[s] = std::max<uint32_t>(1, static_cast<uint32_t>(std::llround(scaled)));
      total += freq[s];
    }
  }
  // Move the remaining budget one unit at a time where the expected code
  // length p * log2(f) changes least (removing) or gains most (adding).
  struct Item {
    double key;
    int64_t s;
  };
  auto key = [&](int64_t s, bool add) {
    const double f = freq[s];
    return probs[s] * (add ? std::log2((f + 1) / f) : std::log2(f / (f - 1)));
  };
  if (total != top) {
    const bool add = total < top;
    // Best first: the largest gain (adding) or the smallest loss (removing),
    // then the lowest index.
    auto worse = [add](const Item& a, const Item& b) {
      if (a.key != b.key) return add ? a.key < b.key : a.key > b.key;
      return a.s > b.s;
    };
    std::priority_queue<Item, std::vector<Item>, decltype(worse)> heap(worse);
    for (int64_t s = 0; s < n; ++s) {
      if (probs[s] > 0 && (add || freq[s] > 1)) heap.push({key(s, add), s});
    }
    while (total != top) {
      const Item it = heap.top();
      heap.pop();
      freq[it.s] += add ? 1 : -1;
      total += add ? 1 : -1;
      if (add || freq[it.s] > 1) heap.push({key(it.s, add), it.s});
    }
  }
  return freq;
}

std::vector<uint8_t> encode_table(Coder coder, const int64_t* symbols, int64_t n,
                                  const uint32_t* freqs, int64_t n_symbols, int bits) {
  check_count(n);
  const std::vector<uint32_t> cdf = table_cdf(freqs, n_symbols, bits);
  check_symbols(symbols, n, n_symbols);
  for (int64_t i = 0; i < n; ++i) {
    if (freqs[symbols[i]] == 0) zero_probability(i, symbols[i], "probs");
  }
  return encode_symbols(coder, n, bits, [&](int64_t i) {
    const int64_t s = symbols[i];
    return Interval{cdf[s], freqs[s]};
  });
}

std::vector<int32_t> decode_table(Coder coder, const uint8_t* data, size_t size,
                                  const uint32_t* freqs, int64_t n_symbols, int bits, int64_t n) {
  check_count(n);
  const std::vector<uint32_t> cdf = table_cdf(freqs, n_symbols, bits);
  // Every slot of [0, 2^bits) belongs to exactly one symbol of nonzero frequency.
  std::vector<int32_t> slot_symbol(size_t{1} << bits);
  for (int64_t s = 0; s < n_symbols; ++s) {
    std::fill(slot_symbol.begin() + cdf[s], slot_symbol.begin() + cdf[s + 1],
              static_cast<int32_t>(s));
  }
  return decode_symbols(coder, data, size, n, bits, [&](int64_t, uint32_t slot) {
    const int32_t s = slot_symbol[slot];
    return Decoded{s, {cdf[s], freqs[s]}};
  });
}

namespace {

// The CDF table and the row each of n symbols is coded under: row indexes[i],
// or row i without indexes (then one row per symbol).
void check_cdf_rows(const int32_t* cdfs, int64_t n_rows, int64_t width, const int64_t* indexes,
                    int64_t n, int bits) {
  check_cdfs(cdfs, n_rows, width, bits);
  if (indexes) {
    check_indexes(indexes, n, n_rows);
  } else if (n_rows != n) {
    fail("cdfs must have one row per symbol (" + std::to_string(n) + ") without indexes, got " +
         std::to_string(n_rows) + ".");
  }
}

}  // namespace

std::vector<uint8_t> encode_cdfs(Coder coder, const int64_t* symbols, int64_t n,
                                 const int32_t* cdfs, int64_t n_rows, int64_t width,
                                 const int64_t* indexes, int bits) {
  check_count(n);
  check_cdf_rows(cdfs, n_rows, width, indexes, n, bits);
  check_symbols(symbols, n, width - 1);
  auto row_of = [&](int64_t i) { return cdfs + (indexes ? indexes[i] : i) * width; };
  for (int64_t i = 0; i < n; ++i) {
    const int32_t* row = row_of(i);
    if (row[symbols[i] + 1] == row[symbols[i]]) {
      zero_probability(i, symbols[i],
                       "cdfs row " + std::to_string(indexes ? indexes[i] : i));
    }
  }
  return encode_symbols(coder, n, bits, [&](int64_t i) {
    const int32_t* row = row_of(i);
    const int64_t s = symbols[i];
    return Interval{static_cast<uint32_t>(row[s]), static_cast<uint32_t>(row[s + 1] - row[s])};
  });
}

std::vector<int32_t> decode_cdfs(Coder coder, const uint8_t* data, size_t size,
                                 const int32_t* cdfs, int64_t n_rows, int64_t width,
                                 const int64_t* indexes, int64_t n, int bits) {
  check_count(n);
  check_cdf_rows(cdfs, n_rows, width, indexes, n, bits);
  return decode_symbols(coder, data, size, n, bits, [&](int64_t i, uint32_t target) {
    const int32_t* row = cdfs + (indexes ? indexes[i] : i) * width;
    // row[0] = 0 <= target < row[width - 1], so s is in [0, width - 2] and
    // row[s] <= target < row[s + 1].
    const auto s = std::upper_bound(row, row + width, static_cast<int32_t>(target)) - row - 1;
    return Decoded{static_cast<int32_t>(s),
                   {static_cast<uint32_t>(row[s]), static_cast<uint32_t>(row[s + 1] - row[s])}};
  });
}

std::vector<uint8_t> encode_occupancy(const int32_t* coords, int64_t n, int dims) {
  if (dims != 3 && dims != 4) fail("coords must have 3 or 4 columns, got " + std::to_string(dims) + ".");
  if (n < 0 || n > std::numeric_limits<int32_t>::max()) fail("coords has too many rows.");
  std::vector<std::array<int32_t, 4>> rows(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t* c = coords + i * dims;
    rows[i] = dims == 4 ? std::array<int32_t, 4>{c[0], c[1], c[2], c[3]}
                        : std::array<int32_t, 4>{0, c[0], c[1], c[2]};
  }
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());

  std::vector<std::pair<size_t, size_t>> groups;  // rows of each batch
  for (size_t i = 0; i < rows.size(); ++i) {
    if (i == 0 || rows[i][0] != rows[i - 1][0]) groups.push_back({i, i});
    groups.back().second = i + 1;
  }
  std::vector<uint8_t> out(kMagic, kMagic + 4);
  out.push_back(1);
  out.push_back(static_cast<uint8_t>(dims));
  put_u32(out, static_cast<uint32_t>(groups.size()));

  RangeEncoder enc;
  OccupancyModel model;
  std::vector<Point> pts, nodes;
  std::vector<uint32_t> symbols;
  for (const auto& [a, b] : groups) {
    std::array<int32_t, 3> origin = {rows[a][1], rows[a][2], rows[a][3]};
    for (size_t i = a; i < b; ++i) {
      for (int d = 0; d < 3; ++d) origin[d] = std::min(origin[d], rows[i][d + 1]);
    }
    pts.clear();
    uint32_t spread = 0;
    for (size_t i = a; i < b; ++i) {
      Point p;
      for (int d = 0; d < 3; ++d) {
        p[d] = static_cast<uint32_t>(int64_t{rows[i][d + 1]} - origin[d]);
        spread |= p[d];
      }
      pts.push_back(p);
    }
    int depth = 0;
    while (depth < 32 && (uint64_t{spread} >> depth) != 0) ++depth;
    put_u32(out, static_cast<uint32_t>(rows[a][0]));
    put_u32(out, static_cast<uint32_t>(b - a));
    for (int d = 0; d < 3; ++d) put_u32(out, static_cast<uint32_t>(origin[d]));
    out.push_back(static_cast<uint8_t>(depth));

    std::sort(pts.begin(), pts.end(), morton_less);
    for (int level = 0; level < depth; ++level) {
      const int shift = depth - 1 - level;
      nodes.clear();
      symbols.clear();
      for (size_t i = 0; i < pts.size(); ++i) {
        if (i == 0 || !same_node(pts[i], pts[i - 1], shift + 1)) {
          Point node;
          for (int d = 0; d < 3; ++d) node[d] = static_cast<uint32_t>(uint64_t{pts[i][d]} >> (shift + 1));
          nodes.push_back(node);
          symbols.push_back(0);
        }
        symbols.back() |= 1u << child_index(pts[i], shift);
      }
      model.reset();
      for (size_t j = 0; j < nodes.size(); ++j) {
        model.encode(enc, face_neighbours(nodes, nodes[j]), symbols[j]);
      }
    }
  }
  if (!groups.empty()) {  // an empty set is its header alone
    const std::vector<uint8_t> payload = enc.finish();
    out.insert(out.end(), payload.begin(), payload.end());
  }
  return out;
}

DecodedCoords decode_occupancy(const uint8_t* data, size_t size) {
  if (size < kHeadSize) corrupt("shorter than the occupancy header");
  if (std::memcmp(data, kMagic, 4) != 0) corrupt("not an occupancy stream");
  if (data[4] != 1) corrupt("unknown occupancy stream version");
  DecodedCoords result;
  result.dims = data[5];
  if (result.dims != 3 && result.dims != 4) corrupt("dims must be 3 or 4");
  const uint32_t n_batches = get_u32(data + 6);
  if (n_batches > (size - kHeadSize) / kBatchHeadSize) corrupt("truncated header");
  if (result.dims == 3 && n_batches > 1) corrupt("3-column stream with several batches");
  std::vector<BatchHead> heads(n_batches);
  const uint8_t* p = data + kHeadSize;
  for (uint32_t b = 0; b < n_batches; ++b, p += kBatchHeadSize) {
    BatchHead& h = heads[b];
    h.batch = static_cast<int32_t>(get_u32(p));
    h.count = get_u32(p + 4);
    for (int d = 0; d < 3; ++d) h.origin[d] = static_cast<int32_t>(get_u32(p + 8 + 4 * d));
    h.depth = p[20];
    if (h.count == 0 || h.depth > 32) corrupt("bad batch header");
    if (b > 0 && h.batch <= heads[b - 1].batch) corrupt("batches out of order");
    if (result.dims == 3 && h.batch != 0) corrupt("3-column stream with a batch id");
  }
  if (n_batches == 0) {
    if (p != data + size) corrupt("bytes after an empty header");
    return result;
  }
  RangeDecoder dec(p, static_cast<size_t>(data + size - p));
  OccupancyModel model;
  std::vector<Point> nodes, next;
  for (const BatchHead& h : heads) {
    nodes.assign(1, Point{0, 0, 0});
    for (int level = 0; level < h.depth; ++level) {
      model.reset();
      next.clear();
      for (const Point& node : nodes) {
        const uint32_t symbol = model.decode(dec, face_neighbours(nodes, node));
        if (symbol == 0) corrupt("empty octree node");
        for (uint32_t c = 0; c < 8; ++c) {
          if (!(symbol & (1u << c))) continue;
          if (next.size() >= h.count) corrupt("more octree nodes than voxels");
          next.push_back({2 * node[0] + ((c >> 2) & 1u), 2 * node[1] + ((c >> 1) & 1u),
                          2 * node[2] + (c & 1u)});
        }
      }
      nodes.swap(next);
    }
    if (nodes.size() != h.count) corrupt("voxel count mismatch");
    const size_t first = result.coords.size() / result.dims;
    for (const Point& q : nodes) {
      if (result.dims == 4) result.coords.push_back(h.batch);
      for (int d = 0; d < 3; ++d) {
        const int64_t v = int64_t{h.origin[d]} + q[d];
        if (v > std::numeric_limits<int32_t>::max()) corrupt("coordinate out of int32 range");
        result.coords.push_back(static_cast<int32_t>(v));
      }
    }
    // Morton order to (x, y, z) order within the batch.
    const size_t dims = static_cast<size_t>(result.dims);
    std::vector<std::array<int32_t, 3>> xyz(nodes.size());
    for (size_t i = 0; i < nodes.size(); ++i) {
      for (int d = 0; d < 3; ++d) xyz[i][d] = result.coords[(first + i) * dims + (dims - 3) + d];
    }
    std::sort(xyz.begin(), xyz.end());
    for (size_t i = 0; i < nodes.size(); ++i) {
      for (int d = 0; d < 3; ++d) result.coords[(first + i) * dims + (dims - 3) + d] = xyz[i][d];
    }
  }
  dec.finish();
  return result;
}

}  // namespace mlx_lattice::entropy
