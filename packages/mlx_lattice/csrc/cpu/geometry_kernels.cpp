#include "geometry_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "../parallel.h"

namespace mlx_lattice::geometry {

namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

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

inline bool same_row(const int32_t* a, const int32_t* b) { return std::memcmp(a, b, 16) == 0; }

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

std::vector<int64_t> morton_codes(const int32_t* coords, int64_t n) {
  constexpr int64_t kBias = int64_t{1} << 20;
  std::vector<int64_t> out(n);
  for (int64_t r = 0; r < n; ++r) {
    uint64_t v[3];
    for (int a = 0; a < 3; ++a) {
      const int64_t x = static_cast<int64_t>(coords[4 * r + a + 1]) + kBias;
      if (x < 0 || x >= 2 * kBias) {
        std::ostringstream msg;
        msg << "coords row " << r << " " << row_str(coords + 4 * r)
            << " is outside the Morton range [-2^20, 2^20) per axis.";
        fail(msg.str());
      }
      v[a] = static_cast<uint64_t>(x);
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

// ---- points <-> voxels --------------------------------------------------------------------

namespace {

void check_batch(const int32_t* batch, int64_t n, const char* name) {
  for (int64_t i = 0; i < n; ++i) {
    if (batch[i] < 0) {
      std::ostringstream msg;
      msg << name << "[" << i << "] = " << batch[i] << " is negative.";
      fail(msg.str());
    }
  }
}

void check_finite(const double* points, int64_t n, const char* name) {
  for (int64_t i = 0; i < 3 * n; ++i) {
    if (!std::isfinite(points[i])) {
      std::ostringstream msg;
      msg << name << " must be finite; row " << i / 3 << " has " << points[i] << ".";
      fail(msg.str());
    }
  }
}

inline bool fits_int32(double v) { return v >= -2147483648.0 && v <= 2147483647.0; }

}  // namespace

Quantized quantize_points(const double* points, const int32_t* batch, int64_t n,
                          const double size[3], const double origin[3]) {
  for (int a = 0; a < 3; ++a) {
    if (!(size[a] > 0) || !std::isfinite(size[a])) fail("voxel_size must be positive and finite.");
    if (!std::isfinite(origin[a])) fail("origin must be finite.");
  }
  check_finite(points, n, "points");
  check_batch(batch, n, "batch");
  std::vector<int32_t> keys(4 * n);
  for (int64_t i = 0; i < n; ++i) {
    keys[4 * i] = batch[i];
    for (int a = 0; a < 3; ++a) {
      const double g = std::floor((points[3 * i + a] - origin[a]) / size[a]);
      if (!fits_int32(g)) {
        std::ostringstream msg;
        msg << "points row " << i << " falls in voxel index " << g
            << ", outside the int32 coordinate range.";
        fail(msg.str());
      }
      keys[4 * i + a + 1] = static_cast<int32_t>(g);
    }
  }
  return {unique_rows(keys.data(), n)};
}

PointVoxel point_voxel_map(const double* points, const int32_t* batch, int64_t n,
                           const int32_t* coords, int64_t n_voxels, const double size[3],
                           const double origin[3]) {
  for (int a = 0; a < 3; ++a) {
    if (!(size[a] > 0) || !std::isfinite(size[a])) fail("voxel_size must be positive and finite.");
    if (!std::isfinite(origin[a])) fail("origin must be finite.");
  }
  check_finite(points, n, "points");
  check_batch(batch, n, "batch");
  if (n > std::numeric_limits<int32_t>::max() / 8) fail("points has too many rows.");
  CoordIndex index(coords, n_voxels, "coords");
  PointVoxel m;
  m.rows.assign(8 * n, -1);
  m.weights.assign(8 * n, 0.0f);
  m.nearest.assign(n, -1);
  // Voxel index bounds are checked up front so the parallel part cannot throw.
  for (int64_t p = 0; p < n; ++p) {
    for (int a = 0; a < 3; ++a) {
      const double u = (points[3 * p + a] - origin[a]) / size[a] - 0.5;
      const double f = std::floor(u);
      if (!fits_int32(f) || !fits_int32(f + 1)) {
        std::ostringstream msg;
        msg << "points row " << p << " is outside the int32 voxel coordinate range.";
        fail(msg.str());
      }
    }
  }
  parallel_for((n + 2047) / 2048, [&](int64_t t) {
    const int64_t end = std::min(n, (t + 1) * 2048);
    for (int64_t p = t * 2048; p < end; ++p) {
      int32_t base[3];
      double frac[3];
      for (int a = 0; a < 3; ++a) {
        const double u = (points[3 * p + a] - origin[a]) / size[a] - 0.5;
        const double f = std::floor(u);
        base[a] = static_cast<int32_t>(f);
        frac[a] = u - f;
      }
      double w[8], total = 0.0;
      int32_t rows[8];
      for (int c = 0; c < 8; ++c) {
        const int d[3] = {(c >> 2) & 1, (c >> 1) & 1, c & 1};
        const int32_t key[4] = {batch[p], base[0] + d[0], base[1] + d[1], base[2] + d[2]};
        rows[c] = index.find(key);
        double wc = 1.0;
        for (int a = 0; a < 3; ++a) wc *= d[a] ? frac[a] : 1.0 - frac[a];
        w[c] = rows[c] >= 0 ? wc : 0.0;
        total += w[c];
      }
      int best = -1;
      for (int c = 0; c < 8; ++c) {
        m.rows[8 * p + c] = rows[c];
        if (total > 0) m.weights[8 * p + c] = static_cast<float>(w[c] / total);
        if (rows[c] >= 0 && (best < 0 || w[c] > w[best])) best = c;
      }
      m.nearest[p] = best < 0 ? -1 : rows[best];
    }
  });
  // Entries grouped by voxel, ascending (counting sort).
  m.offsets.assign(n_voxels + 1, 0);
  for (int64_t e = 0; e < 8 * n; ++e) {
    if (m.rows[e] >= 0) ++m.offsets[m.rows[e] + 1];
  }
  for (int64_t v = 0; v < n_voxels; ++v) m.offsets[v + 1] += m.offsets[v];
  m.entries.assign(m.offsets[n_voxels], 0);
  std::vector<int32_t> cursor(m.offsets.begin(), m.offsets.end() - 1);
  for (int64_t e = 0; e < 8 * n; ++e) {
    if (m.rows[e] >= 0) m.entries[cursor[m.rows[e]]++] = static_cast<int32_t>(e);
  }
  return m;
}

void voxel_reduce(const float* feats, int64_t channels, const int32_t* offsets,
                  const int32_t* members, int64_t n_voxels, Reduce mode, float* out,
                  int32_t* arg) {
  parallel_for((n_voxels + 511) / 512, [&](int64_t t) {
    const int64_t end = std::min(n_voxels, (t + 1) * 512);
    for (int64_t v = t * 512; v < end; ++v) {
      float* o = out + v * channels;
      int32_t* a = arg ? arg + v * channels : nullptr;
      const int32_t b = offsets[v], e = offsets[v + 1];
      if (b == e) {  // an empty voxel reduces to 0
        std::fill(o, o + channels, 0.0f);
        if (a) std::fill(a, a + channels, -1);
        continue;
      }
      if (mode == Reduce::kFirst || mode == Reduce::kMax) {
        const int32_t p0 = members[b];
        std::copy(feats + p0 * channels, feats + (p0 + 1) * channels, o);
        if (a) std::fill(a, a + channels, p0);
        if (mode == Reduce::kMax) {
          for (int32_t i = b + 1; i < e; ++i) {
            const float* f = feats + static_cast<int64_t>(members[i]) * channels;
            for (int64_t c = 0; c < channels; ++c) {
              if (f[c] > o[c] || (std::isnan(f[c]) && !std::isnan(o[c]))) {
                o[c] = f[c];
                if (a) a[c] = members[i];
              }
            }
          }
        }
        continue;
      }
      std::fill(o, o + channels, 0.0f);
      for (int32_t i = b; i < e; ++i) {
        const float* f = feats + static_cast<int64_t>(members[i]) * channels;
        for (int64_t c = 0; c < channels; ++c) o[c] += f[c];
      }
      if (mode == Reduce::kMean) {
        const float inv = 1.0f / static_cast<float>(e - b);
        for (int64_t c = 0; c < channels; ++c) o[c] *= inv;
      }
    }
  });
}

void devoxelize(const float* vf, int64_t channels, const int32_t* rows, const float* weights,
                const int32_t* nearest, int64_t n_points, bool nearest_mode, float* out) {
  parallel_for((n_points + 1023) / 1024, [&](int64_t t) {
    const int64_t end = std::min(n_points, (t + 1) * 1024);
    for (int64_t p = t * 1024; p < end; ++p) {
      float* o = out + p * channels;
      if (nearest_mode) {
        const int32_t r = nearest[p];
        if (r < 0) {
          std::fill(o, o + channels, 0.0f);
        } else {
          std::copy(vf + r * channels, vf + (r + 1) * channels, o);
        }
        continue;
      }
      std::fill(o, o + channels, 0.0f);
      for (int c = 0; c < 8; ++c) {
        const int32_t r = rows[8 * p + c];
        if (r < 0) continue;
        const float w = weights[8 * p + c];
        const float* f = vf + static_cast<int64_t>(r) * channels;
        for (int64_t k = 0; k < channels; ++k) o[k] += w * f[k];
      }
    }
  });
}

void devoxelize_transpose(const float* g, int64_t channels, const int32_t* rows,
                          const float* weights, const int32_t* nearest, const int32_t* offsets,
                          const int32_t* entries, int64_t n_voxels, bool nearest_mode,
                          float* out) {
  parallel_for((n_voxels + 1023) / 1024, [&](int64_t t) {
    const int64_t end = std::min(n_voxels, (t + 1) * 1024);
    for (int64_t v = t * 1024; v < end; ++v) {
      float* o = out + v * channels;
      std::fill(o, o + channels, 0.0f);
      for (int32_t i = offsets[v]; i < offsets[v + 1]; ++i) {
        const int64_t e = entries[i];
        const int64_t p = e / 8;
        float w;
        if (nearest_mode) {
          if (nearest[p] != v) continue;
          w = 1.0f;
        } else {
          w = weights[e];
        }
        (void)rows;
        const float* gp = g + p * channels;
        for (int64_t k = 0; k < channels; ++k) o[k] += w * gp[k];
      }
    }
  });
}

// ---- neighbours ---------------------------------------------------------------------------

namespace {

// Support points bucketed in a hashed uniform grid (per batch).
class Grid {
 public:
  Grid(const double* pts, const int32_t* batch, int64_t n, double cell)
      : pts_(pts), inv_(1.0 / cell), cell_(cell) {
    std::vector<int32_t> keys(4 * n);
    for (int64_t i = 0; i < n; ++i) {
      keys[4 * i] = batch[i];
      for (int a = 0; a < 3; ++a) keys[4 * i + a + 1] = cell_of(pts[3 * i + a]);
    }
    cells_ = unique_rows(keys.data(), n);
    index_ = std::make_unique<CoordIndex>(cells_.coords.data(),
                                          static_cast<int64_t>(cells_.offsets.size()) - 1, "cells");
    // Cell bounds per batch, so a ring search knows when it has seen everything.
    for (size_t c = 0; c + 1 < cells_.offsets.size(); ++c) {
      const int32_t* k = cells_.coords.data() + 4 * c;
      auto& b = bounds_[k[0]];
      if (!b.set) {
        for (int a = 0; a < 3; ++a) b.lo[a] = b.hi[a] = k[a + 1];
        b.set = true;
      }
      for (int a = 0; a < 3; ++a) {
        b.lo[a] = std::min(b.lo[a], k[a + 1]);
        b.hi[a] = std::max(b.hi[a], k[a + 1]);
      }
    }
  }

  int32_t cell_of(double x) const {
    const double c = std::floor(x * inv_);
    return static_cast<int32_t>(std::clamp(c, -1.0e9, 1.0e9));
  }

  // Calls fn(support_row) for every point of cell key (batch, cx, cy, cz).
  template <typename F>
  void visit(const int32_t key[4], F&& fn) const {
    const int32_t c = index_->find(key);
    if (c < 0) return;
    for (int32_t i = cells_.offsets[c]; i < cells_.offsets[c + 1]; ++i) fn(cells_.members[i]);
  }

  struct Bounds {
    bool set = false;
    int32_t lo[3] = {0, 0, 0}, hi[3] = {0, 0, 0};
  };
  const Bounds* bounds(int32_t batch) const {
    auto it = bounds_.find(batch);
    return it == bounds_.end() ? nullptr : &it->second;
  }
  double cell() const { return cell_; }
  const double* pts() const { return pts_; }

 private:
  const double* pts_;
  double inv_, cell_;
  UniqueRows cells_;
  std::unique_ptr<CoordIndex> index_;
  std::map<int32_t, Bounds> bounds_;
};

inline double dist2(const double* q, const double* s) {
  const double dx = q[0] - s[0], dy = q[1] - s[1], dz = q[2] - s[2];
  return dx * dx + dy * dy + dz * dz;
}

struct Cand {
  double d2;
  int32_t row;
  bool operator<(const Cand& o) const { return d2 < o.d2 || (d2 == o.d2 && row < o.row); }
};

void check_points(const double* pts, const int32_t* batch, int64_t n, const char* name,
                  const char* batch_name) {
  check_finite(pts, n, name);
  check_batch(batch, n, batch_name);
}

// A cell size giving a few points per occupied cell: the bounding-box
// estimate, halved while occupied cells hold many more points than wanted.
double pick_cell(const double* pts, const int32_t* batch, int64_t n, double per_cell) {
  double lo[3], hi[3];
  for (int a = 0; a < 3; ++a) lo[a] = hi[a] = n ? pts[a] : 0.0;
  for (int64_t i = 0; i < n; ++i) {
    for (int a = 0; a < 3; ++a) {
      lo[a] = std::min(lo[a], pts[3 * i + a]);
      hi[a] = std::max(hi[a], pts[3 * i + a]);
    }
  }
  double extent = 0;
  for (int a = 0; a < 3; ++a) extent = std::max(extent, hi[a] - lo[a]);
  if (!(extent > 0)) return 1.0;
  double vol = 1.0;
  for (int a = 0; a < 3; ++a) vol *= std::max(hi[a] - lo[a], extent * 1e-3);
  double cell = std::cbrt(vol * per_cell / std::max<int64_t>(n, 1));
  // Refine on a sample: points often lie on surfaces, far denser than the box.
  const int64_t step = std::max<int64_t>(1, n / 4096);
  for (int iter = 0; iter < 12; ++iter) {
    std::vector<int32_t> keys;
    for (int64_t i = 0; i < n; i += step) {
      keys.push_back(batch[i]);
      for (int a = 0; a < 3; ++a) {
        keys.push_back(static_cast<int32_t>(std::clamp(std::floor(pts[3 * i + a] / cell), -1e9, 1e9)));
      }
    }
    const int64_t m = static_cast<int64_t>(keys.size() / 4);
    const auto u = unique_rows(keys.data(), m);
    const double occupied = static_cast<double>(u.offsets.size() - 1);
    // Points per occupied cell at full density.
    const double density = static_cast<double>(n) / std::max(1.0, occupied * static_cast<double>(step));
    const double sampled = static_cast<double>(m) / std::max(1.0, occupied);
    const double per = std::max(density, sampled);
    if (per <= 2.0 * per_cell) break;
    cell *= 0.7;
  }
  return cell;
}

}  // namespace

Neighbors knn(const double* query, const int32_t* qbatch, int64_t nq, const double* support,
              const int32_t* sbatch, int64_t ns, int64_t k) {
  if (k < 1) fail("k must be >= 1.");
  check_points(query, qbatch, nq, "query", "query_batch");
  check_points(support, sbatch, ns, "support", "support_batch");
  Neighbors out;
  out.offsets.assign(nq + 1, 0);
  if (ns == 0 || nq == 0) return out;
  const Grid grid(support, sbatch, ns, pick_cell(support, sbatch, ns, std::max<double>(2.0, k / 2.0)));
  std::vector<std::vector<Cand>> found(nq);
  parallel_for((nq + 255) / 256, [&](int64_t t) {
    const int64_t end = std::min(nq, (t + 1) * 256);
    std::vector<Cand> heap;
    for (int64_t q = t * 256; q < end; ++q) {
      heap.clear();
      const double* qp = query + 3 * q;
      const auto* bounds = grid.bounds(qbatch[q]);
      if (!bounds) continue;
      int32_t home[3];
      for (int a = 0; a < 3; ++a) home[a] = grid.cell_of(qp[a]);
      const auto consider = [&](int32_t row) {
        const Cand c{dist2(qp, support + 3 * static_cast<int64_t>(row)), row};
        if (static_cast<int64_t>(heap.size()) < k) {
          heap.push_back(c);
          std::push_heap(heap.begin(), heap.end());
        } else if (c < heap.front()) {
          std::pop_heap(heap.begin(), heap.end());
          heap.back() = c;
          std::push_heap(heap.begin(), heap.end());
        }
      };
      for (int64_t ring = 0;; ++ring) {
        // Visit the cells at Chebyshev distance `ring` from home.
        bool covered = true;  // the ring box contains every occupied cell of this batch
        int64_t lo[3], hi[3];
        for (int a = 0; a < 3; ++a) {
          lo[a] = std::max<int64_t>(home[a] - ring, bounds->lo[a]);
          hi[a] = std::min<int64_t>(home[a] + ring, bounds->hi[a]);
          covered = covered && home[a] - ring <= bounds->lo[a] && home[a] + ring >= bounds->hi[a];
        }
        for (int64_t x = lo[0]; x <= hi[0]; ++x) {
          const bool xe = x == home[0] - ring || x == home[0] + ring;
          for (int64_t y = lo[1]; y <= hi[1]; ++y) {
            const bool ye = xe || y == home[1] - ring || y == home[1] + ring;
            if (ye) {
              for (int64_t z = lo[2]; z <= hi[2]; ++z) {
                const int32_t key[4] = {qbatch[q], static_cast<int32_t>(x), static_cast<int32_t>(y),
                                        static_cast<int32_t>(z)};
                grid.visit(key, consider);
              }
            } else {
              for (int64_t z : {home[2] - ring, home[2] + ring}) {
                if (z < lo[2] || z > hi[2] || (ring == 0 && z != home[2])) continue;
                const int32_t key[4] = {qbatch[q], static_cast<int32_t>(x), static_cast<int32_t>(y),
                                        static_cast<int32_t>(z)};
                grid.visit(key, consider);
                if (ring == 0) break;
              }
            }
          }
        }
        if (covered) break;
        if (static_cast<int64_t>(heap.size()) == k) {
          // Every unseen point lies outside the ring box: farther than its margin.
          double margin = std::numeric_limits<double>::infinity();
          for (int a = 0; a < 3; ++a) {
            const double lo_edge = static_cast<double>(home[a] - ring) * grid.cell();
            const double hi_edge = static_cast<double>(home[a] + ring + 1) * grid.cell();
            margin = std::min({margin, qp[a] - lo_edge, hi_edge - qp[a]});
          }
          margin -= grid.cell() * 1e-9;  // cell assignment rounds; stay conservative
          if (margin > 0 && heap.front().d2 < margin * margin) break;
        }
      }
      std::sort_heap(heap.begin(), heap.end());
      found[q] = heap;
    }
  });
  for (int64_t q = 0; q < nq; ++q) out.offsets[q + 1] = out.offsets[q] + static_cast<int32_t>(found[q].size());
  out.rows.resize(out.offsets[nq]);
  out.dist2.resize(out.offsets[nq]);
  for (int64_t q = 0; q < nq; ++q) {
    for (size_t i = 0; i < found[q].size(); ++i) {
      out.rows[out.offsets[q] + i] = found[q][i].row;
      out.dist2[out.offsets[q] + i] = found[q][i].d2;
    }
  }
  return out;
}

Neighbors radius_search(const double* query, const int32_t* qbatch, int64_t nq,
                        const double* support, const int32_t* sbatch, int64_t ns, double r,
                        int64_t max_neighbors) {
  if (!(r > 0) || !std::isfinite(r)) fail("r must be positive and finite.");
  check_points(query, qbatch, nq, "query", "query_batch");
  check_points(support, sbatch, ns, "support", "support_batch");
  Neighbors out;
  out.offsets.assign(nq + 1, 0);
  if (ns == 0 || nq == 0) return out;
  // Cells no smaller than r (so 27 cells cover the ball) unless r is huge
  // compared to the spacing of the points.
  const double cell = std::max(r, pick_cell(support, sbatch, ns, 4.0));
  const Grid grid(support, sbatch, ns, cell);
  const double r2 = r * r;
  std::vector<std::vector<Cand>> found(nq);
  parallel_for((nq + 255) / 256, [&](int64_t t) {
    const int64_t end = std::min(nq, (t + 1) * 256);
    for (int64_t q = t * 256; q < end; ++q) {
      auto& hits = found[q];
      const double* qp = query + 3 * q;
      int32_t lo[3], hi[3];
      for (int a = 0; a < 3; ++a) {
        lo[a] = grid.cell_of(qp[a] - r);
        hi[a] = grid.cell_of(qp[a] + r);
      }
      for (int64_t x = lo[0]; x <= hi[0]; ++x) {
        for (int64_t y = lo[1]; y <= hi[1]; ++y) {
          for (int64_t z = lo[2]; z <= hi[2]; ++z) {
            const int32_t key[4] = {qbatch[q], static_cast<int32_t>(x), static_cast<int32_t>(y),
                                    static_cast<int32_t>(z)};
            grid.visit(key, [&](int32_t row) {
              const double d = dist2(qp, support + 3 * static_cast<int64_t>(row));
              if (d <= r2) hits.push_back({d, row});
            });
          }
        }
      }
      std::sort(hits.begin(), hits.end());
      if (max_neighbors > 0 && static_cast<int64_t>(hits.size()) > max_neighbors) {
        hits.resize(max_neighbors);
      }
    }
  });
  int64_t total = 0;
  for (int64_t q = 0; q < nq; ++q) {
    total += static_cast<int64_t>(found[q].size());
    if (total > std::numeric_limits<int32_t>::max()) fail("radius search found more than 2^31 - 1 pairs.");
    out.offsets[q + 1] = static_cast<int32_t>(total);
  }
  out.rows.resize(total);
  out.dist2.resize(total);
  for (int64_t q = 0; q < nq; ++q) {
    for (size_t i = 0; i < found[q].size(); ++i) {
      out.rows[out.offsets[q] + i] = found[q][i].row;
      out.dist2[out.offsets[q] + i] = found[q][i].d2;
    }
  }
  return out;
}

}  // namespace mlx_lattice::geometry
