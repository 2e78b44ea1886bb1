// The coders under every entropy stream (entropy.cpp: one table and CDF
// rows; entropy_occupancy.cpp: octree occupancy), with the argument checks
// they share.
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
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "entropy.h"

namespace mlx_lattice::entropy::detail {

[[noreturn]] inline void fail(const std::string& msg) { throw std::invalid_argument(msg); }

[[noreturn]] inline void corrupt(const char* what) {
  fail(std::string("data: corrupt stream (") + what + ").");
}

inline void check_bits(int bits) {
  if (bits < 1 || bits > kMaxPrecision) {
    fail("precision must be in [1, " + std::to_string(kMaxPrecision) + "] bits, got " +
         std::to_string(bits) + ".");
  }
}

inline void check_count(int64_t n) {
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

}  // namespace mlx_lattice::entropy::detail
