// The octree occupancy coder of voxel sets (entropy.h), on the range coder
// of entropy_coders.h.
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
#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "entropy.h"
#include "entropy_coders.h"

namespace mlx_lattice::entropy {

using namespace detail;

namespace {

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
