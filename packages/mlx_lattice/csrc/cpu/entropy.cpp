// Entropy coders (entropy.h): frequency tables and the coding of symbols
// under one table or under CDF rows. The rANS and range coders and their
// stream formats are in entropy_coders.h; the occupancy coder is in
// entropy_occupancy.cpp.
#include "entropy.h"

#include <algorithm>
#include <cmath>
#include <queue>
#include <string>
#include <vector>

#include "entropy_coders.h"

namespace mlx_lattice::entropy {

using namespace detail;

namespace {

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

}  // namespace mlx_lattice::entropy
