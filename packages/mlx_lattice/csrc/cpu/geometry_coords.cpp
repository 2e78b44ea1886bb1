// Geometry kernels on coordinate sets: sorting, unique rows, the exact hash
// index, lookups, merges (union / intersection) and Morton codes.
#include <algorithm>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "geometry_detail.h"
#include "geometry_kernels.h"
#include "parallel.h"

namespace mlx_lattice::geometry {

using detail::fail;
using detail::same_row;

namespace {

std::string row_str(const int32_t* c) {
  std::ostringstream s;
  s << "(" << c[0] << ", " << c[1] << ", " << c[2] << ", " << c[3] << ")";
  return s.str();
}

inline uint64_t hash_row(const int32_t* c) {
  uint64_t h = static_cast<uint64_t>(static_cast<uint32_t>(c[0])) * 0x9e3779b97f4a7c15ULL;
  h ^= static_cast<uint64_t>(static_cast<uint32_t>(c[1])) * 0xc2b2ae3d27d4eb4fULL;
  h ^= static_cast<uint64_t>(static_cast<uint32_t>(c[2])) * 0x165667b19e3779f9ULL;
  h ^= static_cast<uint64_t>(static_cast<uint32_t>(c[3])) * 0x27d4eb2f165667c5ULL;
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 29;
  return h;
}

inline bool less_row(const int32_t* a, const int32_t* b) {
  for (int i = 0; i < 4; ++i) {
    if (a[i] != b[i]) return a[i] < b[i];
  }
  return false;
}

// LSD radix sort of (key, index) pairs on the low `bits` bits of key; stable,
// so equal keys keep index order.
void radix_sort(std::vector<uint64_t>& keys, std::vector<int32_t>& idx, int bits) {
  const size_t n = keys.size();
  std::vector<uint64_t> k2(n);
  std::vector<int32_t> i2(n);
  constexpr int kDigit = 11;
  constexpr size_t kBuckets = size_t{1} << kDigit;
  std::vector<size_t> count(kBuckets);
  for (int shift = 0; shift < bits; shift += kDigit) {
    std::fill(count.begin(), count.end(), 0);
    for (size_t i = 0; i < n; ++i) ++count[(keys[i] >> shift) & (kBuckets - 1)];
    size_t sum = 0;
    for (auto& c : count) {
      size_t t = c;
      c = sum;
      sum += t;
    }
    for (size_t i = 0; i < n; ++i) {
      size_t d = count[(keys[i] >> shift) & (kBuckets - 1)]++;
      k2[d] = keys[i];
      i2[d] = idx[i];
    }
    keys.swap(k2);
    idx.swap(i2);
  }
}

}  // namespace

std::vector<int32_t> sort_rows(const int32_t* keys, int64_t n) {
  std::vector<int32_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = static_cast<int32_t>(i);
  if (n <= 1) return order;
  // Pack the rows into one 64-bit key (column spans, batch most significant)
  // when they fit: then a radix sort is exact and fast.
  int64_t lo[4], hi[4];
  for (int a = 0; a < 4; ++a) lo[a] = hi[a] = keys[a];
  for (int64_t i = 1; i < n; ++i) {
    for (int a = 0; a < 4; ++a) {
      lo[a] = std::min<int64_t>(lo[a], keys[4 * i + a]);
      hi[a] = std::max<int64_t>(hi[a], keys[4 * i + a]);
    }
  }
  int width[4], total = 0;
  for (int a = 0; a < 4; ++a) {
    uint64_t span = static_cast<uint64_t>(hi[a] - lo[a]);
    width[a] = 0;
    while (width[a] < 64 && (span >> width[a]) != 0) ++width[a];
    total += width[a];
  }
  if (total <= 64) {
    std::vector<uint64_t> packed(n);
    for (int64_t i = 0; i < n; ++i) {
      uint64_t key = 0;
      for (int a = 0; a < 4; ++a) {
        const uint64_t v = static_cast<uint64_t>(keys[4 * i + a] - lo[a]);
        key = width[a] == 64 ? v : (key << width[a]) | v;
      }
      packed[i] = key;
    }
    radix_sort(packed, order, total);
    return order;
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t x, int32_t y) { return less_row(keys + 4 * x, keys + 4 * y); });
  return order;
}

UniqueRows unique_rows(const int32_t* keys, int64_t n) {
  if (n > std::numeric_limits<int32_t>::max()) fail("too many rows (more than 2^31 - 1).");
  UniqueRows u;
  u.members = sort_rows(keys, n);
  u.inverse.assign(n, 0);
  u.offsets.push_back(0);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t* c = keys + 4 * static_cast<int64_t>(u.members[i]);
    if (i == 0 || !same_row(c, keys + 4 * static_cast<int64_t>(u.members[i - 1]))) {
      if (i) u.offsets.push_back(static_cast<int32_t>(i));
      u.coords.insert(u.coords.end(), c, c + 4);
    }
    u.inverse[u.members[i]] = static_cast<int32_t>(u.offsets.size() - 1);
  }
  if (n) u.offsets.push_back(static_cast<int32_t>(n));
  return u;
}

CoordIndex::CoordIndex(const int32_t* coords, int64_t n, const std::string& name)
    : coords_(coords) {
  if (n > std::numeric_limits<int32_t>::max() / 2) fail(name + " has too many rows.");
  uint64_t cap = 16;
  while (cap < static_cast<uint64_t>(2 * n)) cap <<= 1;
  mask_ = cap - 1;
  slots_.assign(cap, -1);
  for (int64_t r = 0; r < n; ++r) {
    const int32_t* c = coords + 4 * r;
    for (uint64_t i = hash_row(c) & mask_;; i = (i + 1) & mask_) {
      const int32_t s = slots_[i];
      if (s < 0) {
        slots_[i] = static_cast<int32_t>(r);
        break;
      }
      if (same_row(coords + 4 * static_cast<int64_t>(s), c)) {
        std::ostringstream msg;
        msg << name << " has duplicate coordinate " << row_str(c) << " at rows " << s << " and "
            << r << ".";
        fail(msg.str());
      }
    }
  }
}

int32_t CoordIndex::find(const int32_t* c) const {
  for (uint64_t i = hash_row(c) & mask_;; i = (i + 1) & mask_) {
    const int32_t s = slots_[i];
    if (s < 0) return -1;
    if (same_row(coords_ + 4 * static_cast<int64_t>(s), c)) return s;
  }
}

std::vector<int32_t> lookup(const int32_t* coords, int64_t n, const int32_t* queries, int64_t q,
                            const std::string& name) {
  CoordIndex index(coords, n, name);
  std::vector<int32_t> out(q);
  parallel_for((q + 4095) / 4096, [&](int64_t t) {
    const int64_t end = std::min(q, (t + 1) * 4096);
    for (int64_t i = t * 4096; i < end; ++i) out[i] = index.find(queries + 4 * i);
  });
  return out;
}

Merged merge_sets(const int32_t* a, int64_t na, const int32_t* b, int64_t nb, bool intersection) {
  // Duplicate checks name the operand; the sorted walk then merges.
  CoordIndex check_a(a, na, "a");
  CoordIndex check_b(b, nb, "b");
  const auto oa = sort_rows(a, na);
  const auto ob = sort_rows(b, nb);
  Merged m;
  int64_t i = 0, j = 0;
  while (i < na || j < nb) {
    const int32_t* ca = i < na ? a + 4 * static_cast<int64_t>(oa[i]) : nullptr;
    const int32_t* cb = j < nb ? b + 4 * static_cast<int64_t>(ob[j]) : nullptr;
    int32_t ra = -1, rb = -1;
    const int32_t* c;
    if (ca && cb && same_row(ca, cb)) {
      ra = oa[i++];
      rb = ob[j++];
      c = ca;
    } else if (ca && (!cb || less_row(ca, cb))) {
      ra = oa[i++];
      c = ca;
    } else {
      rb = ob[j++];
      c = cb;
    }
    if (intersection && (ra < 0 || rb < 0)) continue;
    m.coords.insert(m.coords.end(), c, c + 4);
    m.a_rows.push_back(ra);
    m.b_rows.push_back(rb);
  }
  return m;
}

void check_morton_range(const int32_t* coords, int64_t n) {
  constexpr int64_t kBias = int64_t{1} << 20;
  for (int64_t r = 0; r < n; ++r) {
    for (int a = 0; a < 3; ++a) {
      const int64_t x = static_cast<int64_t>(coords[4 * r + a + 1]) + kBias;
      if (x < 0 || x >= 2 * kBias) {
        std::ostringstream msg;
        msg << "coords row " << r << " " << row_str(coords + 4 * r)
            << " is outside the Morton range [-2^20, 2^20) per axis.";
        fail(msg.str());
      }
    }
  }
}

std::vector<int64_t> morton_codes(const int32_t* coords, int64_t n) {
  constexpr int64_t kBias = int64_t{1} << 20;
  check_morton_range(coords, n);
  std::vector<int64_t> out(n);
  for (int64_t r = 0; r < n; ++r) {
    uint64_t v[3];
    for (int a = 0; a < 3; ++a) {
      v[a] = static_cast<uint64_t>(static_cast<int64_t>(coords[4 * r + a + 1]) + kBias);
    }
    uint64_t code = 0;
    for (int bit = 0; bit < 21; ++bit) {
      code |= ((v[0] >> bit) & 1) << (3 * bit + 2);
      code |= ((v[1] >> bit) & 1) << (3 * bit + 1);
      code |= ((v[2] >> bit) & 1) << (3 * bit);
    }
    out[r] = static_cast<int64_t>(code);
  }
  return out;
}

}  // namespace mlx_lattice::geometry
