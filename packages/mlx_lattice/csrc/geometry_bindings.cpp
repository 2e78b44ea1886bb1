// Python bindings of the geometry ops (thin; documented in mlx_lattice.geometry
// and mlx_lattice.coords, which validate and call these). bind_ops calls
// bind_geometry, so the product and the harness modules both have them.
#include <nanobind/nanobind.h>
#include "cpu/input_error.h"
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>

#include "bindings.h"
#include "cpu/geometry_detail.h"
#include "cpu/geometry_kernels.h"
#include "cpu/group_by.h"
#include "cpu/parallel.h"
#include "ops.h"
#include "primitives.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace ml = mlx_lattice;
namespace geo = mlx_lattice::geometry;
namespace mx = mlx::core;

namespace {

using Points = nb::ndarray<const double, nb::shape<-1, 3>, nb::c_contig, nb::device::cpu>;
using Ints = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Coords = nb::ndarray<const int32_t, nb::shape<-1, 4>, nb::c_contig, nb::device::cpu>;
using Dict = std::map<std::string, mx::array>;

template <typename T>
mx::array to_mx(const std::vector<T>& v, mx::Shape shape, mx::Dtype dtype) {
  return mx::array(v.data(), std::move(shape), dtype);
}

mx::array ints(const std::vector<int32_t>& v) { return to_mx(v, {static_cast<int>(v.size())}, mx::int32); }

mx::array coords4(const std::vector<int32_t>& v) {
  return to_mx(v, {static_cast<int>(v.size() / 4), 4}, mx::int32);
}

void same_length(const char* a, int64_t na, const char* b, int64_t nb_) {
  if (na != nb_) {
    throw ::mlx_lattice::InputError(std::string(b) + " must have one entry per row of " + a + " (" +
                                std::to_string(na) + "), got " + std::to_string(nb_) + ".");
  }
}

// An MLX array owning the vector's buffer (no copy of the edge lists).
template <typename T>
mx::array owned(std::vector<T>&& v, mx::Shape shape, mx::Dtype dtype) {
  if (v.empty()) return to_mx(v, std::move(shape), dtype);
  auto* held = new std::vector<T>(std::move(v));
  return mx::array(static_cast<void*>(held->data()), std::move(shape), dtype,
                   [held](void*) { delete held; });
}

mx::array owned_ints(std::vector<int32_t>&& v) {
  const int n = static_cast<int>(v.size());
  return owned(std::move(v), {n}, mx::int32);
}

// Neighbour lists (edges grouped by query: offsets, support rows, squared
// distances) as a relation's arrays: rank = kernel id, plus the input and
// kernel groupings (stable counting sorts).
Dict edges_dict(std::vector<int32_t>&& offsets, std::vector<int32_t>&& in_rows,
                std::vector<float>&& dist2, int64_t n_support, int64_t n_kernels) {
  const int64_t n_edges = static_cast<int64_t>(in_rows.size());
  const int64_t n_queries = static_cast<int64_t>(offsets.size()) - 1;
  std::vector<int32_t> out_rows(n_edges), ranks(n_edges), edge_ids(n_edges);
  constexpr int64_t kChunk = 4096;  // queries per task
  ml::parallel_for((n_queries + kChunk - 1) / kChunk, [&](int64_t t) {
    const int64_t end = std::min(n_queries, (t + 1) * kChunk);
    for (int64_t q = t * kChunk; q < end; ++q) {
      for (int32_t e = offsets[q]; e < offsets[q + 1]; ++e) {
        out_rows[e] = static_cast<int32_t>(q);
        ranks[e] = e - offsets[q];
        edge_ids[e] = e;
      }
    }
  });
  std::vector<int32_t> in_offsets, in_edge_ids, k_offsets, k_edge_ids;
  ml::kernels::group_by(in_rows.data(), n_edges, n_support, in_offsets, in_edge_ids);
  ml::kernels::group_by(ranks.data(), n_edges, n_kernels, k_offsets, k_edge_ids);
  std::vector<int32_t> counts(n_kernels);
  for (int64_t k = 0; k < n_kernels; ++k) counts[k] = k_offsets[k + 1] - k_offsets[k];
  const int n = static_cast<int>(n_edges);
  return {{"output_row_offsets", owned_ints(std::move(offsets))},
          {"in_rows", owned_ints(std::move(in_rows))},
          {"out_rows", owned_ints(std::move(out_rows))},
          {"kernel_ids", owned_ints(std::move(ranks))},
          {"output_edge_ids", owned_ints(std::move(edge_ids))},
          {"input_row_offsets", owned_ints(std::move(in_offsets))},
          {"input_edge_ids", owned_ints(std::move(in_edge_ids))},
          {"kernel_row_offsets", owned_ints(std::move(k_offsets))},
          {"kernel_edge_ids", owned_ints(std::move(k_edge_ids))},
          {"counts", owned_ints(std::move(counts))},
          {"dist2", owned(std::move(dist2), {n}, mx::float32)}};
}

Dict neighbors_dict(geo::Neighbors&& nbrs, int64_t n_support, int64_t n_kernels) {
  std::vector<float> d(nbrs.dist2.begin(), nbrs.dist2.end());
  return edges_dict(std::move(nbrs.offsets), std::move(nbrs.rows), std::move(d), n_support,
                    n_kernels);
}

// The kNN table (rows / dist2, Q x kt, -1 past the found) as a relation.
Dict table_dict(const mx::array& rows, const mx::array& dist2, int64_t n_support,
                int64_t n_kernels) {
  const int64_t nq = rows.shape(0), kt = rows.shape(1);
  const int32_t* r = rows.data<int32_t>();
  const float* d = dist2.data<float>();
  std::vector<int32_t> offsets(nq + 1, 0);
  for (int64_t q = 0; q < nq; ++q) {
    int64_t n = 0;
    while (n < kt && r[q * kt + n] >= 0) ++n;
    offsets[q + 1] = offsets[q] + static_cast<int32_t>(n);
  }
  std::vector<int32_t> in_rows(offsets[nq]);
  std::vector<float> dd(offsets[nq]);
  constexpr int64_t kChunk = 4096;  // queries per task
  ml::parallel_for((nq + kChunk - 1) / kChunk, [&](int64_t t) {
    const int64_t end = std::min(nq, (t + 1) * kChunk);
    for (int64_t q = t * kChunk; q < end; ++q) {
      std::copy(r + q * kt, r + q * kt + (offsets[q + 1] - offsets[q]),
                in_rows.begin() + offsets[q]);
      std::copy(d + q * kt, d + q * kt + (offsets[q + 1] - offsets[q]), dd.begin() + offsets[q]);
    }
  });
  return edges_dict(std::move(offsets), std::move(in_rows), std::move(dd), n_support, n_kernels);
}

// The grid the Metal kNN kernel searches: cells of about k support points
// (bounding-box estimate), grown until batches x cells fit in int32 keys.
ml::KnnGrid knn_grid(const double* pts, const int32_t* batch, int64_t n, int64_t k) {
  ml::KnnGrid g;
  if (n == 0) return g;
  double lo[3], hi[3];
  int32_t top = 0;
  for (int a = 0; a < 3; ++a) lo[a] = hi[a] = pts[a];
  for (int64_t i = 0; i < n; ++i) {
    top = std::max(top, batch[i]);
    for (int a = 0; a < 3; ++a) {
      lo[a] = std::min(lo[a], pts[3 * i + a]);
      hi[a] = std::max(hi[a], pts[3 * i + a]);
    }
  }
  g.n_batches = top + 1;
  double extent = 0.0;
  for (int a = 0; a < 3; ++a) extent = std::max(extent, hi[a] - lo[a]);
  double cell = 1.0;
  if (extent > 0) {
    double vol = 1.0;
    for (int a = 0; a < 3; ++a) vol *= std::max(hi[a] - lo[a], extent * 1e-3);
    cell = std::max(std::cbrt(vol * static_cast<double>(std::max<int64_t>(k, 2)) /
                              static_cast<double>(n)),
                    extent * 1e-6);
  }
  constexpr double kMaxKeys = 1 << 30;
  if (g.n_batches >= kMaxKeys) {
    throw ::mlx_lattice::InputError("support_batch values up to " + std::to_string(top) +
                                " exceed the GPU kNN grid's int32 cell keys.");
  }
  for (;;) {
    double cells = static_cast<double>(g.n_batches);
    for (int a = 0; a < 3; ++a) cells *= std::floor((hi[a] - lo[a]) / cell) + 1.0;
    if (cells < kMaxKeys) break;
    cell *= 2.0;  // ends: one cell per axis leaves n_batches < kMaxKeys keys
  }
  g.cell = static_cast<float>(cell);
  for (int a = 0; a < 3; ++a) {
    g.origin[a] = static_cast<float>(lo[a]);
    g.dims[a] = static_cast<int32_t>(std::floor((hi[a] - lo[a]) / cell)) + 1;
  }
  return g;
}

// Points as an MLX array: float64 for the CPU kernels, float32 where the
// Metal bodies evaluate (GPUs have no float64).
mx::array points_array(const double* pts, int64_t n, bool metal) {
  const mx::Shape shape = {static_cast<int>(n), 3};
  if (!metal) return mx::array(pts, shape, mx::float64);
  std::vector<float> f(pts, pts + 3 * n);
  return mx::array(f.data(), shape, mx::float32);
}

}  // namespace

namespace mlx_lattice {

void bind_geometry(nb::module_& m) {
  using release = nb::call_guard<nb::gil_scoped_release>;

  m.def(
      "geometry_quantize_points",
      [](Points points, Ints batch, std::array<double, 3> size, std::array<double, 3> origin) {
        same_length("points", points.shape(0), "batch", batch.shape(0));
        auto q = geo::quantize_points(points.data(), batch.data(), points.shape(0), size.data(),
                                      origin.data());
        const auto& u = q.voxels;
        std::vector<int32_t> counts(u.offsets.size() ? u.offsets.size() - 1 : 0);
        for (size_t v = 0; v < counts.size(); ++v) counts[v] = u.offsets[v + 1] - u.offsets[v];
        return Dict{{"coords", coords4(u.coords)},
                    {"point_to_voxel", ints(u.inverse)},
                    {"counts", ints(counts)},
                    {"voxel_offsets", ints(u.offsets)},
                    {"voxel_points", ints(u.members)}};
      },
      "points"_a, "batch"_a, "voxel_size"_a, "origin"_a, release(),
      "Voxels of float64 points (sorted by batch, x, y, z) with the point->voxel map.");

  m.def(
      "geometry_point_voxel_map",
      [](Points points, Ints batch, Coords coords, std::array<double, 3> size,
         std::array<double, 3> origin) {
        same_length("points", points.shape(0), "batch", batch.shape(0));
        auto pvm = geo::point_voxel_map(points.data(), batch.data(), points.shape(0),
                                        coords.data(), coords.shape(0), size.data(), origin.data());
        const int p = static_cast<int>(points.shape(0));
        return Dict{{"rows", owned(std::move(pvm.rows), {p, 8}, mx::int32)},
                    {"weights", owned(std::move(pvm.weights), {p, 8}, mx::float32)},
                    {"nearest", owned_ints(std::move(pvm.nearest))},
                    {"voxel_offsets", owned_ints(std::move(pvm.offsets))},
                    {"voxel_entries", owned_ints(std::move(pvm.entries))}};
      },
      "points"_a, "batch"_a, "coords"_a, "voxel_size"_a, "origin"_a, release(),
      "The 8 voxels around each point (rows, -1 = missing) and renormalised trilinear weights.");

  m.def("geometry_voxelize", &ml::geometry_voxelize, "feats"_a, "voxel_offsets"_a,
        "voxel_points"_a, "point_to_voxel"_a, "reduce"_a, nb::kw_only(), "stream"_a = nb::none(),
        release(),
        "Reduce (P, C) point features onto voxels ('sum', 'mean', 'max', 'first'); "
        "differentiable in feats.");

  m.def("geometry_devoxelize", &ml::geometry_devoxelize, "voxel_features"_a, "rows"_a,
        "weights"_a, "nearest"_a, "voxel_offsets"_a, "voxel_entries"_a, "nearest_mode"_a,
        nb::kw_only(), "out_dtype"_a = "", "stream"_a = nb::none(), release(),
        "Interpolate (N, C) voxel features at points; vjp/jvp in voxel_features. "
        "out_dtype: 'float32', 'float16', 'bfloat16' or '' (the features' dtype).");

  m.def(
      "geometry_knn",
      [](Points query, Ints qbatch, Points support, Ints sbatch, int64_t k) {
        same_length("query", query.shape(0), "query_batch", qbatch.shape(0));
        same_length("support", support.shape(0), "support_batch", sbatch.shape(0));
        if (k < 1) throw ::mlx_lattice::InputError("k must be >= 1.");
        const int64_t nq = query.shape(0), ns = support.shape(0);
        geo::detail::check_finite(query.data(), nq, "query");
        geo::detail::check_batch(qbatch.data(), nq, "query_batch");
        geo::detail::check_finite(support.data(), ns, "support");
        geo::detail::check_batch(sbatch.data(), ns, "support_batch");
        // The search is the GeometryKnn primitive on the default stream (its
        // Metal kernel on GPUs); columns past the support are always empty.
        const auto s = mx::default_stream(mx::default_device());
        const bool metal = ml::uses_metal_bodies(s);
        const int64_t kt = std::max<int64_t>(1, std::min(k, ns));
        if (metal && kt > ml::kKnnMaxKGpu) {
          throw ::mlx_lattice::InputError("k must be <= " + std::to_string(ml::kKnnMaxKGpu) +
                                      " for the GPU kNN kernel, got " + std::to_string(k) +
                                      "; run it on a CPU stream.");
        }
        const auto grid = metal ? knn_grid(support.data(), sbatch.data(), ns, kt) : ml::KnnGrid{};
        auto table = ml::make_knn(
            static_cast<int>(kt), grid, points_array(query.data(), nq, metal),
            mx::array(qbatch.data(), {static_cast<int>(nq)}, mx::int32),
            points_array(support.data(), ns, metal),
            mx::array(sbatch.data(), {static_cast<int>(ns)}, mx::int32), s);
        mx::eval(table);
        return table_dict(table[0], table[1], ns, k);
      },
      "query"_a, "query_batch"_a, "support"_a, "support_batch"_a, "k"_a, release(),
      "Exact k nearest support points per query (same batch), by (distance, row).");

  m.def(
      "geometry_radius",
      [](Points query, Ints qbatch, Points support, Ints sbatch, double r, int64_t max_neighbors) {
        same_length("query", query.shape(0), "query_batch", qbatch.shape(0));
        same_length("support", support.shape(0), "support_batch", sbatch.shape(0));
        const int64_t nq = query.shape(0), ns = support.shape(0);
        const auto s = mx::default_stream(mx::default_device());
        if (ml::uses_metal_bodies(s) && max_neighbors >= 1 && max_neighbors <= ml::kKnnMaxKGpu &&
            r > 0 && std::isfinite(r)) {
          // The nearest max_neighbors within r: the kNN primitive bounded by
          // the radius (its Metal kernel). Without a cap (or a larger one) the
          // search stays on the CPU kernels.
          geo::detail::check_finite(query.data(), nq, "query");
          geo::detail::check_batch(qbatch.data(), nq, "query_batch");
          geo::detail::check_finite(support.data(), ns, "support");
          geo::detail::check_batch(sbatch.data(), ns, "support_batch");
          const int64_t kt = std::max<int64_t>(1, std::min(max_neighbors, ns));
          auto table = ml::make_knn(
              static_cast<int>(kt), knn_grid(support.data(), sbatch.data(), ns, kt),
              points_array(query.data(), nq, true),
              mx::array(qbatch.data(), {static_cast<int>(nq)}, mx::int32),
              points_array(support.data(), ns, true),
              mx::array(sbatch.data(), {static_cast<int>(ns)}, mx::int32), s, r);
          mx::eval(table);
          return table_dict(table[0], table[1], ns, max_neighbors);
        }
        if (ml::uses_metal_bodies(s) && r > 0 && std::isfinite(r)) {
          // Without a cap (or one above the kNN kernel's 64): two passes of
          // the radius kernel. Stage one evaluates the counts and their
          // prefix sum (on the stream) and reads the total back; stage two
          // fills each query's sorted range. A cap keeps each range's head.
          geo::detail::check_finite(query.data(), nq, "query");
          geo::detail::check_batch(qbatch.data(), nq, "query_batch");
          geo::detail::check_finite(support.data(), ns, "support");
          geo::detail::check_batch(sbatch.data(), ns, "support_batch");
          const auto grid = knn_grid(support.data(), sbatch.data(), ns, 16);
          const auto q = points_array(query.data(), nq, true);
          const auto sp = points_array(support.data(), ns, true);
          const mx::array qb(qbatch.data(), {static_cast<int>(nq)}, mx::int32);
          const mx::array sb(sbatch.data(), {static_cast<int>(ns)}, mx::int32);
          auto counts = ml::make_radius(grid, r, q, qb, sp, sb, std::nullopt, 0, s)[0];
          auto sums = mx::concatenate(
              {mx::zeros({1}, mx::int64, s), mx::cumsum(mx::astype(counts, mx::int64, s), 0,
                                                        false, true, s)},
              0, s);
          mx::eval(sums);
          const int64_t* sum = sums.data<int64_t>();
          if (sum[nq] > std::numeric_limits<int32_t>::max()) {
            throw ::mlx_lattice::InputError("radius search: more than 2^31 - 1 neighbour pairs.");
          }
          std::vector<int32_t> offsets(nq + 1, 0), rows;
          std::vector<float> dist2;
          int64_t widest = 1;
          if (sum[nq] > 0) {
            auto found = ml::make_radius(grid, r, q, qb, sp, sb, mx::astype(sums, mx::int32, s),
                                         static_cast<int>(sum[nq]), s);
            mx::eval(found);
            const int32_t* fr = found[0].data<int32_t>();
            const float* fd = found[1].data<float>();
            for (int64_t i = 0; i < nq; ++i) {
              int64_t n = sum[i + 1] - sum[i];
              if (max_neighbors > 0) n = std::min(n, max_neighbors);
              widest = std::max(widest, n);
              offsets[i + 1] = offsets[i] + static_cast<int32_t>(n);
              rows.insert(rows.end(), fr + sum[i], fr + sum[i] + n);
              dist2.insert(dist2.end(), fd + sum[i], fd + sum[i] + n);
            }
          }
          return edges_dict(std::move(offsets), std::move(rows), std::move(dist2), ns,
                            max_neighbors > 0 ? max_neighbors : widest);
        }
        auto nbrs = geo::radius_search(query.data(), qbatch.data(), query.shape(0), support.data(),
                                       sbatch.data(), support.shape(0), r, max_neighbors);
        int64_t widest = 1;
        for (size_t q = 0; q + 1 < nbrs.offsets.size(); ++q) {
          widest = std::max<int64_t>(widest, nbrs.offsets[q + 1] - nbrs.offsets[q]);
        }
        return neighbors_dict(std::move(nbrs), support.shape(0),
                              max_neighbors > 0 ? max_neighbors : widest);
      },
      "query"_a, "query_batch"_a, "support"_a, "support_batch"_a, "r"_a, "max_neighbors"_a,
      release(), "Support points within distance r of each query (same batch), nearest first.");

  m.def(
      "coords_unique",
      [](Coords keys) {
        auto u = geo::unique_rows(keys.data(), keys.shape(0));
        return Dict{{"coords", coords4(u.coords)},
                    {"inverse", ints(u.inverse)},
                    {"offsets", ints(u.offsets)},
                    {"members", ints(u.members)}};
      },
      "keys"_a, release(), "Sorted unique rows with the inverse map and rows grouped per unique row.");

  m.def(
      "coords_sort",
      [](Coords keys) { return ints(geo::sort_rows(keys.data(), keys.shape(0))); }, "keys"_a,
      release(), "Stable lexicographic order of (batch, x, y, z) rows.");

  m.def(
      "coords_lookup",
      [](Coords coords, Coords queries) {
        return ints(geo::lookup(coords.data(), coords.shape(0), queries.data(), queries.shape(0),
                                "coords"));
      },
      "coords"_a, "queries"_a, release(), "Row of each query in coords, or -1 (exact).");

  m.def(
      "coords_merge",
      [](Coords a, Coords b, bool intersection) {
        auto mg = geo::merge_sets(a.data(), a.shape(0), b.data(), b.shape(0), intersection);
        return Dict{{"coords", coords4(mg.coords)},
                    {"a_rows", ints(mg.a_rows)},
                    {"b_rows", ints(mg.b_rows)}};
      },
      "a"_a, "b"_a, "intersection"_a, release(),
      "Sorted union (or intersection) of two sets with the row of each in a and b (-1 if absent).");

  m.def(
      "geometry_uses_metal",
      [] { return ml::uses_metal_bodies(mx::default_stream(mx::default_device())); },
      "Whether the geometry ops take their Metal kernels (the default stream is a GPU one, or "
      "this is the test-only harness extension).");

  m.def(
      "coords_hash",
      [](const mx::array& coords, const mx::array& queries) {
        for (const auto& [a, name] : {std::pair{&coords, "coords"}, std::pair{&queries, "queries"}}) {
          if (a->ndim() != 2 || a->shape(1) != 4 || a->dtype() != mx::int32) {
            throw ::mlx_lattice::InputError(std::string(name) + " must be an (N, 4) int32 array.");
          }
        }
        const auto s = mx::default_stream(mx::default_device());
        auto out = ml::make_coord_hash(coords, queries, s);
        return Dict{{"first", out[0]}, {"rows", out[1]}};
      },
      "coords"_a, "queries"_a,
      "GeometryHash on the default stream (lazy): first (smallest row with each row's "
      "coordinates) and rows (that row for each query, or -1).");

  m.def(
      "coords_morton",
      [](Coords coords) {
        geo::check_morton_range(coords.data(), coords.shape(0));
        const auto s = mx::default_stream(mx::default_device());
        return ml::make_morton(
            mx::array(coords.data(), {static_cast<int>(coords.shape(0)), 4}, mx::int32), s);
      },
      "coords"_a, release(), "Morton codes of (x, y, z) biased by 2^20 (21 bits per axis).");
}

}  // namespace mlx_lattice
