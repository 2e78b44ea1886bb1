"""The native layer's plumbing: one relation object across the boundary, its
validation memo under in-place updates, and the MLX transforms (vmap,
compile) of every primitive, against independent references."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from mlx_lattice._native import ext
from mlx_lattice.core import QuantizedWeight, build_kernel_relation, ops


def f32(a):
    return np.array(a.astype(mx.float32))


def rand(rng, shape, dtype=mx.float32, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def numpy_conv(f, w, rel):
    """out[o] += f[in] @ w[k] over the edges, in float64."""
    out = np.zeros((rel.n_out_capacity, w.shape[2]))
    for i, o, k in zip(
        np.array(rel.edges.in_rows),
        np.array(rel.edges.out_rows),
        np.array(rel.edges.kernel_ids),
        strict=True,
    ):
        out[o] += np.asarray(f, np.float64)[i] @ np.asarray(w, np.float64)[k]
    return out


@pytest.fixture
def setup(rng, ref):
    rel = build_kernel_relation(ref.random_coords(rng, 80, 5))
    return rel, rand(rng, (rel.n_in, 4)), rand(rng, (27, 4, 3))


def test_relation_crosses_as_one_object(setup):
    rel, f, w = setup
    out = ext.sparse_conv_features(f, w, rel)
    np.testing.assert_allclose(np.array(out), numpy_conv(f, w, rel), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match=r"'edges\.in_rows' attribute"):
        ext.sparse_conv_features(f, w, object())
    numpy_edges = dataclasses.replace(
        rel, edges=dataclasses.replace(rel.edges, in_rows=np.array(rel.edges.in_rows))
    )
    with pytest.raises(TypeError, match=r"relation.edges.in_rows must be an mlx.core.array"):
        ext.sparse_conv_features(f, w, numpy_edges)


def test_validation_memo_sees_in_place_updates(setup):
    rel, f, w = setup
    expected = numpy_conv(f, w, rel)
    np.testing.assert_allclose(np.array(ext.sparse_conv_features(f, w, rel)), expected, rtol=1e-5)
    # Without the builder's handle the same relation is validated, same result.
    plain = dataclasses.replace(rel, _native=None)
    np.testing.assert_allclose(np.array(ext.sparse_conv_features(f, w, plain)), expected, rtol=1e-5)
    original = int(np.array(rel.edges.in_rows)[0])
    rel.edges.in_rows[0] = 10_000  # in place: same Python object, new value
    with pytest.raises(ValueError, match=r"in_rows\[0\] = 10000 is out of range"):
        ext.sparse_conv_features(f, w, rel)
    rel.edges.in_rows[0] = original
    np.testing.assert_allclose(np.array(ext.sparse_conv_features(f, w, rel)), expected, rtol=1e-5)
    # A valid in-place change of a grouping is checked again too.
    rel.kernel_csr.edge_ids[0] = rel.kernel_csr.edge_ids[1]
    with pytest.raises(ValueError, match="kernel_edge_ids must be a permutation"):
        ext.sparse_conv_features(f, w, rel)


def stacked(fn, *batched):
    """The loop that vmap must equal: fn on each slice, stacked."""
    return mx.stack([fn(*parts) for parts in zip(*batched, strict=True)])


def test_vmap_of_every_primitive_matches_a_loop(rng, ref):
    coords = ref.random_coords(rng, 120, 6)
    rel = build_kernel_relation(coords)
    fs = rand(rng, (3, rel.n_in, 32))
    ws = rand(rng, (3, 27, 32, 32), scale=0.1)
    cases = {
        "conv, batched features": (
            lambda f: ext.sparse_conv_features(f, ws[0], rel),
            (fs,),
        ),
        "conv, batched weights": (
            lambda w: ext.sparse_conv_features(fs[0], w, rel),
            (ws,),
        ),
        "sorted, both batched": (
            lambda f, w: ops.sparse_conv_features_sorted_from_relation(f, w, rel),
            (fs, ws),
        ),
        "quantized, batched features": (
            lambda f: ops.sparse_quantized_conv_features_from_relation(
                f, QuantizedWeight.from_float(ws[0], bits=8, group_size=32), rel
            ),
            (fs,),
        ),
        "denominator, batched weights": (
            lambda w: ext.sparse_conv_normalization_denominator(w, rel),
            (ws,),
        ),
        "pool, batched features": (
            lambda f: ops.sparse_pool_features_from_relation(
                f, rel, input_exclusive=False, mode="max"
            ),
            (fs,),
        ),
    }
    for name, (fn, batched) in cases.items():
        got = mx.vmap(fn)(*batched)
        np.testing.assert_array_equal(f32(got), f32(stacked(fn, *batched)), err_msg=name)
    # vmap inside grad: the gradient of a vmapped conv is the sum of the
    # per-slice gradients.
    probe = rand(rng, (3, rel.n_out_capacity, 32))
    g = mx.grad(
        lambda w: (mx.vmap(lambda f: ext.sparse_conv_features(f, w, rel))(fs) * probe).sum()
    )(ws[0])
    g_ref = sum(
        mx.grad(lambda w, i=i: (ext.sparse_conv_features(fs[i], w, rel) * probe[i]).sum())(ws[0])
        for i in range(3)
    )
    np.testing.assert_allclose(f32(g), f32(g_ref), rtol=1e-4, atol=1e-4)


def test_vmap_over_an_empty_axis(setup):
    rel, f, w = setup
    out = mx.vmap(lambda a: ext.sparse_conv_features(a, w, rel))(mx.zeros((0, *f.shape)))
    assert out.shape == (0, rel.n_out_capacity, 3)  # empty: the shape is all there is


def test_compile_matches_eager(setup):
    rel, f, w = setup

    def fn(a, b):
        return ext.sparse_conv_features(a, b, rel) * 2.0

    np.testing.assert_array_equal(np.array(mx.compile(fn)(f, w)), np.array(fn(f, w)))
    np.testing.assert_allclose(np.array(fn(f, w)), 2 * numpy_conv(f, w, rel), rtol=1e-5, atol=1e-5)


def test_array_value_handle_tracks_in_place_updates(rng):
    a = rand(rng, (4,))
    handle = ext.array_value(a)
    assert ext.same_value(handle, a)
    before = np.array(a)
    a[0] = 5.0
    assert not ext.same_value(handle, a)
    np.testing.assert_array_equal(np.array(handle), before)  # the old value stays alive


def test_native_bad_input_is_the_library_error():
    """std::invalid_argument from the extension arrives as MlxLatticeError
    (still a ValueError), and every Python-side error class shares it."""
    import mlx_lattice
    from mlx_lattice._native import ext
    from mlx_lattice.coords import CoordinateError
    from mlx_lattice.core.dataflow import DataflowError
    from mlx_lattice.distributed import DistributedUsageError
    from mlx_lattice.geometry import GeometryError

    with pytest.raises(mlx_lattice.MlxLatticeError, match="nbytes must be >= 0") as info:
        ext.set_weight_cache_budget(-1)
    assert isinstance(info.value, ValueError)
    for cls in (mlx_lattice.SparseTensorError, CoordinateError, DataflowError,
                DistributedUsageError, GeometryError, mlx_lattice.MlxLatticeTypeError):
        assert issubclass(cls, mlx_lattice.MlxLatticeError)
    assert issubclass(mlx_lattice.MlxLatticeTypeError, TypeError)


def test_mlx_own_errors_stay_mlx_errors():
    """The translator is shared by every nanobind extension: found by fuzzing,
    it turned MLX's own std::invalid_argument (here a bad broadcast) into
    MlxLatticeError; only mlx_lattice's InputError is translated."""
    import mlx_lattice

    with pytest.raises(ValueError, match="Cannot broadcast") as info:
        mx.broadcast_to(mx.zeros((1, 1, 0)), (27, 0, 1))
    assert not isinstance(info.value, mlx_lattice.MlxLatticeError)
