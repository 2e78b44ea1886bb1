// Python bindings of the geometry ops (thin; documented in mlx_lattice.geometry
// and mlx_lattice.coords, which validate and call these).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <string>

#include "cpu/geometry_kernels.h"
#include "geometry_primitives.h"

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
    throw std::invalid_argument(std::string(b) + " must have one entry per row of " + a + " (" +
                                std::to_string(na) + "), got " + std::to_string(nb_) + ".");
  }
}

Dict neighbors_dict(const geo::Neighbors& nbrs) {
  std::vector<float> d(nbrs.dist2.size());
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<float>(nbrs.dist2[i]);
  return {{"offsets", ints(nbrs.offsets)},
          {"rows", ints(nbrs.rows)},
          {"dist2", to_mx(d, {static_cast<int>(d.size())}, mx::float32)}};
}

}  // namespace

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
        return Dict{{"rows", to_mx(pvm.rows, {p, 8}, mx::int32)},
                    {"weights", to_mx(pvm.weights, {p, 8}, mx::float32)},
                    {"nearest", ints(pvm.nearest)},
                    {"voxel_offsets", ints(pvm.offsets)},
                    {"voxel_entries", ints(pvm.entries)}};
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
        nb::kw_only(), "stream"_a = nb::none(), release(),
        "Interpolate (N, C) voxel features at points; vjp/jvp in voxel_features.");

  m.def(
      "geometry_knn",
      [](Points query, Ints qbatch, Points support, Ints sbatch, int64_t k) {
        same_length("query", query.shape(0), "query_batch", qbatch.shape(0));
        same_length("support", support.shape(0), "support_batch", sbatch.shape(0));
        return neighbors_dict(geo::knn(query.data(), qbatch.data(), query.shape(0), support.data(),
                                       sbatch.data(), support.shape(0), k));
      },
      "query"_a, "query_batch"_a, "support"_a, "support_batch"_a, "k"_a, release(),
      "Exact k nearest support points per query (same batch), by (distance, row).");

  m.def(
      "geometry_radius",
      [](Points query, Ints qbatch, Points support, Ints sbatch, double r, int64_t max_neighbors) {
        same_length("query", query.shape(0), "query_batch", qbatch.shape(0));
        same_length("support", support.shape(0), "support_batch", sbatch.shape(0));
        return neighbors_dict(geo::radius_search(query.data(), qbatch.data(), query.shape(0),
                                                 support.data(), sbatch.data(), support.shape(0), r,
                                                 max_neighbors));
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
      "coords_morton",
      [](Coords coords) {
        auto codes = geo::morton_codes(coords.data(), coords.shape(0));
        return to_mx(codes, {static_cast<int>(codes.size())}, mx::int64);
      },
      "coords"_a, release(), "Morton codes of (x, y, z) biased by 2^20 (21 bits per axis).");
}
