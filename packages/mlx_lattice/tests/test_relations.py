"""Kernel relations against brute-force neighbourhoods."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lattice import MlxLatticeError
from mlx_lattice._native import ext
from mlx_lattice.core import build_kernel_relation, check_coordinates, kernel_offsets
from mlx_lattice.core.relations import SORTED_TILE_ROWS


def edge_set(rel):
    return set(
        zip(
            rel.edges.in_rows.tolist(),
            rel.edges.out_rows.tolist(),
            rel.edges.kernel_ids.tolist(),
            strict=True,
        )
    )


def check_groupings(rel):
    """CSR views are consistent with the edge list, in canonical order."""
    in_rows = np.array(rel.edges.in_rows)
    out_rows = np.array(rel.edges.out_rows)
    kid = np.array(rel.edges.kernel_ids)
    n_out, n_k = rel.n_out_capacity, rel.n_kernels
    # Grouped by output, offsets strictly ascending within an output.
    assert np.all(np.diff(out_rows) >= 0)
    same = np.diff(out_rows) == 0
    assert np.all(np.diff(kid)[same] > 0)
    np.testing.assert_array_equal(
        np.array(rel.output_csr.row_offsets), np.searchsorted(out_rows, np.arange(n_out + 1))
    )
    np.testing.assert_array_equal(np.array(rel.output_csr.edge_ids), np.arange(len(out_rows)))
    np.testing.assert_array_equal(np.array(rel.counts), np.bincount(kid, minlength=n_k))
    for csr, keys, groups in ((rel.input_csr, in_rows, rel.n_in), (rel.kernel_csr, kid, n_k)):
        ids = np.array(csr.edge_ids)
        np.testing.assert_array_equal(ids, np.argsort(keys, kind="stable"))
        np.testing.assert_array_equal(
            np.array(csr.row_offsets), np.searchsorted(keys[ids], np.arange(groups + 1))
        )
    assert rel.in_edge_ids is rel.input_csr.edge_ids
    assert rel.kernel_edge_ids is rel.kernel_csr.edge_ids


@pytest.mark.parametrize(
    ("kernel_size", "dilation", "tensor_stride"),
    [
        (3, 1, 1),
        (1, 1, 1),
        (2, 1, 1),
        (5, 1, 1),
        ((3, 1, 5), 1, 1),
        (3, 2, 1),
        ((2, 4, 3), (1, 2, 1), 2),
        (7, 1, 1),
    ],
)
def test_submanifold_matches_brute_force(rng, ref, kernel_size, dilation, tensor_stride):
    ts = (tensor_stride,) * 3 if isinstance(tensor_stride, int) else tensor_stride
    coords = ref.random_coords(rng, 300, 9, batches=2, step=ts[0])
    rel = build_kernel_relation(
        coords, kernel_size=kernel_size, dilation=dilation, tensor_stride=tensor_stride
    )
    ks = (kernel_size,) * 3 if isinstance(kernel_size, int) else kernel_size
    dil = (dilation,) * 3 if isinstance(dilation, int) else dilation
    offsets = ref.offsets(ks, dil, ts)
    np.testing.assert_array_equal(kernel_offsets(kernel_size, dilation, tensor_stride), offsets)
    assert rel.contract.kind == "submanifold"
    assert rel.n_kernels == len(offsets)
    assert rel.n_out_capacity == len(coords)
    np.testing.assert_array_equal(np.array(rel.out_coords), coords)
    assert edge_set(rel) == ref.brute_force_edges(coords, coords, offsets)
    check_groupings(rel)


def test_given_outputs_far_outside_sorted_inputs(ref):
    """Outputs far outside ascending inputs whose keys span 2^60 cells are
    searched by key (SortedRows) without overflowing a key: the edges are
    the brute-force set."""
    coords = np.array([[0, 0, 0, 0], [0, 0, 1 << 30, 1 << 30]], np.int32)
    outs = np.array(
        [[0, 0, 0, 1], [0, (1 << 31) - 2, 0, 0], [0, -(1 << 31) + 1, 5, 5], [1, 0, 0, 0]],
        np.int32,
    )
    rel = build_kernel_relation(coords, outs, kernel_size=3, kind="forward")
    want = ref.brute_force_edges(coords, outs, ref.offsets((3, 3, 3), (1, 1, 1), (1, 1, 1)))
    assert len(want) == 1
    assert edge_set(rel) == want
    check_groupings(rel)


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize(
    ("kernel_size", "stride"), [(2, 2), (3, 2), (3, 1), ((3, 2, 1), (2, 2, 1)), (5, 2), (4, 3)]
)
def test_forward_computes_strided_outputs(rng, ref, kernel_size, stride, ordered):
    """Computed outputs and edges against brute force; ``ordered`` inputs
    (ascending by batch, x, y, z) are searched by key (SortedRows), the
    others in the coordinate hash."""
    coords = ref.random_coords(rng, 400, 10, batches=2)
    if ordered:
        coords = np.unique(coords, axis=0)
    rel = build_kernel_relation(coords, kernel_size=kernel_size, stride=stride, kind="forward")
    st = np.broadcast_to(np.array(stride), (3,))
    expected = np.concatenate([coords[:, :1], (coords[:, 1:] // st) * st], axis=1)
    # The floored inputs, unique and ascending by (batch, x, y, z); with
    # stride 1, the inputs in their order.
    want = expected if np.all(st == 1) else np.unique(expected, axis=0)
    np.testing.assert_array_equal(np.array(rel.out_coords), want)
    assert rel.contract.out_tensor_stride == tuple(int(s) for s in st)
    ks = tuple(np.broadcast_to(np.array(kernel_size), (3,)).tolist())
    out = np.array(rel.out_coords)
    assert edge_set(rel) == ref.brute_force_edges(
        coords, out, ref.offsets(ks, (1, 1, 1), (1, 1, 1))
    )
    check_groupings(rel)


def test_target_is_transpose_of_forward(rng, ref):
    fine = ref.random_coords(rng, 300, 8, batches=2)
    down = build_kernel_relation(fine, kernel_size=2, stride=2, kind="forward")
    up = build_kernel_relation(down.out_coords, fine, kernel_size=2, tensor_stride=1, kind="target")
    assert up.contract.kind == "target"
    assert up.n_out_capacity == len(fine)
    assert {(o, i, k) for i, o, k in edge_set(down)} == edge_set(up)
    offsets = ref.offsets((2, 2, 2), (1, 1, 1), (1, 1, 1))
    assert edge_set(up) == ref.brute_force_edges(np.array(down.out_coords), fine, offsets, sign=-1)
    check_groupings(up)


def _target_of(rel):
    """The target relation reversing ``rel``, built by searching coordinates."""
    c = rel.contract
    return build_kernel_relation(
        rel.out_coords,
        rel.in_coords,
        kernel_size=c.kernel_size,
        dilation=c.dilation,
        tensor_stride=c.tensor_stride,
        kind="target",
    )


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_transposed_equals_the_built_target_relation(rng, ref, order):
    # Reversing a forward relation (computed or given outputs) or a
    # submanifold one gives, array for array, the target relation the
    # builder finds by searching the coordinates; brute force checks the edges.
    for trial in range(10):
        kernel = tuple(int(v) for v in rng.integers(1, 5, 3))
        stride = tuple(int(v) for v in rng.integers(1, 4, 3))
        dilation = tuple(int(v) for v in rng.integers(1, 3, 3))
        ts = tuple(int(v) for v in rng.integers(1, 3, 3))
        fine = shifted_coords(rng, ref, int(rng.integers(0, 400)), 9, ts, (0, 0, 0))
        if order == "sorted":
            fine = np.unique(fine, axis=0)
        down = build_kernel_relation(
            fine, kernel_size=kernel, stride=stride, dilation=dilation, tensor_stride=ts,
            kind="forward",
        )
        coarse = np.array(down.out_coords)[::-1].copy()  # given outputs, in another order
        given = build_kernel_relation(
            fine, coarse, kernel_size=kernel, dilation=dilation, tensor_stride=ts, kind="forward"
        )
        same = build_kernel_relation(fine, kernel_size=kernel, dilation=dilation, tensor_stride=ts)
        for rel in (down, given, same):
            up = rel.transposed()
            built = _target_of(rel)
            assert up.contract == built.contract, trial
            assert up.contract.kind == "target" and up.contract.stride == (1, 1, 1)
            assert (up.n_in, up.n_out_capacity, up.n_kernels) == (
                built.n_in, built.n_out_capacity, built.n_kernels,
            )
            np.testing.assert_array_equal(np.array(up.in_coords), np.array(rel.out_coords))
            np.testing.assert_array_equal(np.array(up.out_coords), fine)
            for a, b in zip(relation_arrays(up), relation_arrays(built), strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"trial {trial}")
            check_groupings(up)
        offsets = ref.offsets(kernel, dilation, ts)
        assert edge_set(down.transposed()) == ref.brute_force_edges(
            np.array(down.out_coords), fine, offsets, sign=-1
        )


def test_transposed_rows_with_many_edges(rng):
    # A dense block under a 5x5x5 and a 7x7x7 kernel: inner rows hold 125 and
    # 343 edges, past the transpose's insertion sort (rows shuffled, so each
    # row's edges arrive out of offset order).
    grid = np.stack(np.meshgrid(*[np.arange(8)] * 3, indexing="ij"), -1).reshape(-1, 3)
    coords = np.concatenate([np.zeros((len(grid), 1)), grid], 1).astype(np.int32)
    coords = coords[rng.permutation(len(coords))]
    for size in (5, 7):
        rel = build_kernel_relation(coords, kernel_size=size)
        assert np.bincount(np.array(rel.edges.in_rows)).max() == size**3
        for a, b in zip(
            relation_arrays(rel.transposed()), relation_arrays(_target_of(rel)), strict=True
        ):
            np.testing.assert_array_equal(a, b)


def test_transposed_relation_convolves_as_the_built_one(rng, ref):
    # The transposed relation carries its own native form: a convolution and
    # its gradients through it equal those through the built target relation.
    from mlx_lattice.core.ops import sparse_conv_features_from_relation as conv

    fine = ref.random_coords(rng, 500, 10, batches=2)
    down = build_kernel_relation(fine, kernel_size=2, stride=2, kind="forward")
    up, built = down.transposed(), _target_of(down)
    feats = mx.array(rng.standard_normal((up.n_in, 8)).astype(np.float32))
    weight = mx.array(rng.standard_normal((8, 8, 6)).astype(np.float32))
    results = []
    for rel in (up, built):
        loss = mx.value_and_grad(lambda f, w, r=rel: (conv(f, w, r) ** 2).sum(), argnums=(0, 1))
        value, (d_feats, d_weight) = loss(feats, weight)
        results.append([np.array(a) for a in (conv(feats, weight, rel), value, d_feats, d_weight)])
    assert results[0][0].shape == (len(fine), 6)
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


def test_transposed_rejects_targets_and_bad_relations(rng, ref):
    import dataclasses

    fine = ref.random_coords(rng, 200, 8)
    down = build_kernel_relation(fine, kernel_size=2, stride=2, kind="forward")
    with pytest.raises(MlxLatticeError, match="'target' relation already"):
        down.transposed().transposed()
    # An index array replaced by one out of range: validated, named.
    bad_rows = np.array(down.edges.out_rows)
    bad_rows[0] = down.n_out_capacity
    broken = dataclasses.replace(
        down, edges=dataclasses.replace(down.edges, out_rows=mx.array(bad_rows))
    )
    with pytest.raises(MlxLatticeError, match="out_rows"):
        broken.transposed()
    # A hand-made relation whose input row has two edges of one offset (a kNN
    # relation, say) has no transpose in the builder's layout.
    two = np.array([[0, 0, 0, 0], [0, 1, 0, 0]], np.int32)
    one = np.array([[0, 0, 0, 0]], np.int32)
    rel = build_kernel_relation(one, two, kernel_size=1, kind="forward")
    assert rel.n_edges == 1
    def i32(values):
        return mx.array(np.array(values, np.int32))

    knn = dataclasses.replace(
        rel,
        edges=dataclasses.replace(rel.edges, in_rows=i32([0, 0]), out_rows=i32([0, 1]),
                                  kernel_ids=i32([0, 0])),
        output_csr=dataclasses.replace(rel.output_csr, row_offsets=i32([0, 1, 2])),
        input_csr=dataclasses.replace(rel.input_csr, row_offsets=i32([0, 2]),
                                      edge_ids=i32([0, 1])),
        kernel_csr=dataclasses.replace(rel.kernel_csr, row_offsets=i32([0, 2]),
                                       edge_ids=i32([0, 1])),
        n_out_capacity=2,
    )
    with pytest.raises(MlxLatticeError, match="input row 0 has two edges of kernel offset 0"):
        knn.transposed()


def test_given_forward_outputs_and_empty_sets(rng, ref):
    coords = ref.random_coords(rng, 100, 6)
    far = np.array([[0, 100, 100, 100]], dtype=np.int32)
    rel = build_kernel_relation(coords, far, kind="forward")
    assert rel.n_edges == 0
    assert rel.n_out_capacity == 1
    empty = build_kernel_relation(np.zeros((0, 4), np.int32))
    assert empty.n_edges == 0 and empty.n_out_capacity == 0
    check_groupings(empty)


def test_negative_and_large_coordinates(rng, ref):
    big = 2**31 - 2
    coords = np.array(
        [
            [0, -5, -5, -5],
            [0, -4, -5, -5],
            [0, big, 0, 0],
            [0, big - 1, 0, 0],
            [1, -(2**31), 7, 7],
            [3, 0, 0, 0],
        ],
        dtype=np.int32,
    )
    rel = build_kernel_relation(coords, kernel_size=3)
    assert edge_set(rel) == ref.brute_force_edges(
        coords, coords, ref.offsets((3, 3, 3), (1, 1, 1), (1, 1, 1))
    )


def test_colliding_hash_candidates_never_alias(ref):
    # Many coordinates that differ only in high bits or batch: exact key
    # comparison must keep them apart.
    rows = [[b, x << 16, y << 16, 0] for b in range(3) for x in range(-4, 4) for y in range(-4, 4)]
    coords = np.array(rows, dtype=np.int32)
    rel = build_kernel_relation(coords, kernel_size=3, dilation=1 << 16)
    offsets = ref.offsets((3, 3, 3), (1 << 16,) * 3, (1, 1, 1))
    assert edge_set(rel) == ref.brute_force_edges(coords, coords, offsets)


def test_edge_order_is_deterministic(rng, ref):
    coords = ref.random_coords(rng, 500, 10, batches=2)
    a = build_kernel_relation(coords, kernel_size=3, stride=2, kind="forward")
    b = build_kernel_relation(coords, kernel_size=3, stride=2, kind="forward")
    for x, y in (
        (a.edges.in_rows, b.edges.in_rows),
        (a.edges.kernel_ids, b.edges.kernel_ids),
        (a.out_coords, b.out_coords),
    ):
        np.testing.assert_array_equal(np.array(x), np.array(y))


def test_sorted_view(rng, ref):
    coords = ref.random_coords(rng, 700, 9, batches=2)
    rel = build_kernel_relation(coords, kernel_size=3)
    view = rel.require_sorted_implicit_gemm()
    assert rel.require_sorted_implicit_gemm() is view
    dense = np.full((rel.n_out_capacity, 27), -1)
    for i, o, k in edge_set(rel):
        dense[o, k] = i
    np.testing.assert_array_equal(np.array(view.out_in_map), dense)
    perm = np.array(view.reorder_rows)
    np.testing.assert_array_equal(np.sort(perm), np.arange(len(perm)))
    sorted_map = np.array(view.sorted_out_in_map)
    np.testing.assert_array_equal(sorted_map, dense[perm])
    np.testing.assert_array_equal(np.array(view.sorted_kv_out_in_map), sorted_map.T)
    masks = ((sorted_map >= 0) * (1 << np.arange(27))).sum(1)
    assert np.all(np.diff(masks) >= 0)  # rows sorted by neighbourhood shape
    tiles = np.array(view.tile_masks)
    assert len(tiles) == -(-len(perm) // SORTED_TILE_ROWS)
    for t, m in enumerate(tiles):
        assert m == np.bitwise_or.reduce(masks[t * SORTED_TILE_ROWS : (t + 1) * SORTED_TILE_ROWS])


def test_mirrored_edge_pass_with_and_without_popcnt(rng, ref):
    # The sorted, symmetric edge pass is built twice (POPCNT, taken at the
    # avx2-fma level and above, and portable bit counting, taken under a
    # 'scalar' ceiling): the same arrays, and the brute-force edges.
    import mlx_lattice

    coords = np.unique(ref.random_coords(rng, 4000, 16, batches=2), axis=0)
    expected = build_kernel_relation(coords, kernel_size=3)
    offsets = ref.offsets((3, 3, 3), (1, 1, 1), (1, 1, 1))
    assert edge_set(expected) == ref.brute_force_edges(coords, coords, offsets)
    mlx_lattice.set_kernel_isa("scalar")
    try:
        portable = build_kernel_relation(coords, kernel_size=3)
    finally:
        mlx_lattice.set_kernel_isa(None)
    for a, b in zip(relation_arrays(portable), relation_arrays(expected), strict=True):
        np.testing.assert_array_equal(a, b)


def test_duplicate_coordinates_name_rows():
    coords = np.array([[0, 1, 2, 3], [0, 4, 5, 6], [0, 1, 2, 3]], dtype=np.int32)
    with pytest.raises(ValueError, match=r"duplicate coordinate \(0, 1, 2, 3\) at rows 0 and 2"):
        build_kernel_relation(coords)
    with pytest.raises(ValueError, match="rows 0 and 2"):
        check_coordinates(coords)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kernel_size": 8}, ValueError, "kernel_size"),
        ({"kernel_size": 0}, ValueError, "kernel_size"),
        ({"kernel_size": (3, 3)}, TypeError, "kernel_size"),
        ({"stride": 2}, ValueError, "stride applies to 'forward'"),
        ({"dilation": 0}, ValueError, "dilation"),
        ({"kind": "sideways"}, ValueError, "kind"),
        ({"kind": "target"}, ValueError, "needs out_coords"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    coords = np.array([[0, 0, 0, 0]], dtype=np.int32)
    with pytest.raises(error, match=match):
        build_kernel_relation(coords, **kwargs)


def test_bad_coordinates():
    with pytest.raises(ValueError, match=r"\(N, 4\)"):
        build_kernel_relation(np.zeros((3, 3), np.int32))
    with pytest.raises(TypeError, match="integers"):
        build_kernel_relation(np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="int32 range"):
        build_kernel_relation(np.array([[0, 2**40, 0, 0]]))
    with pytest.raises(ValueError, match="do not pass out_coords"):
        build_kernel_relation(np.zeros((1, 4), np.int32), np.zeros((1, 4), np.int32))
    assert build_kernel_relation(mx.array([[0, 1, 2, 3]], dtype=mx.int64)).n_edges == 1


def relation_arrays(rel):
    """Every index array of a relation, as NumPy."""
    return [
        np.array(a)
        for a in (
            rel.edges.in_rows,
            rel.edges.out_rows,
            rel.edges.kernel_ids,
            rel.output_csr.row_offsets,
            rel.input_csr.row_offsets,
            rel.input_csr.edge_ids,
            rel.kernel_csr.row_offsets,
            rel.kernel_csr.edge_ids,
        )
    ]


def shell_coords(radius: float, batches: int = 1) -> np.ndarray:
    """Voxels of a sphere surface (every cell whose centre lies within half a
    voxel of the radius), batches stacked, rows in x-major order."""
    r = int(np.ceil(radius)) + 1
    g = np.arange(-r, r + 1)
    x, y, z = np.meshgrid(g, g, g, indexing="ij")
    keep = np.abs(np.sqrt(x**2 + y**2 + z**2) - radius) <= 0.5
    xyz = np.stack([x[keep], y[keep], z[keep]], 1)
    return np.concatenate(
        [np.concatenate([np.full((len(xyz), 1), b), xyz], 1) for b in range(batches)]
    ).astype(np.int32)


@pytest.mark.parametrize(
    ("kernel_size", "dilation", "tensor_stride"),
    [(3, 1, 1), (2, 1, 1), (5, 2, 1), (7, 1, 1), ((3, 1, 5), 1, 1), (3, 1, 2), (4, 1, 1)],
)
def test_block_grid_matches_coordinate_hash(rng, ref, kernel_size, dilation, tensor_stride):
    # A dense set relates to itself through the block grid; the same relation
    # with its outputs given goes through the coordinate hash. Every array,
    # order included, must agree, and both match the brute force.
    coords = ref.random_coords(rng, 900, 10, batches=2)
    args = {"kernel_size": kernel_size, "dilation": dilation, "tensor_stride": tensor_stride}
    grid = build_kernel_relation(coords, **args)
    hashed = build_kernel_relation(coords, coords, kind="forward", **args)
    unstrided = build_kernel_relation(coords, kind="forward", **args)
    for a, b, c in zip(
        relation_arrays(grid), relation_arrays(hashed), relation_arrays(unstrided), strict=True
    ):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    ks = (kernel_size,) * 3 if isinstance(kernel_size, int) else kernel_size
    offsets = ref.offsets(ks, (dilation,) * 3, (tensor_stride,) * 3)
    assert edge_set(grid) == ref.brute_force_edges(coords, coords, offsets)
    check_groupings(grid)


def check_3x3x3_against_hash(ref, coords):
    """The 3x3x3 submanifold relation of `coords`: the brute-force edges,
    canonical groupings, and every array equal to the relation of the same
    set given as outputs (the coordinate hash)."""
    rel = build_kernel_relation(coords, kernel_size=3)
    assert edge_set(rel) == ref.brute_force_edges(
        coords, coords, ref.offsets((3, 3, 3), (1, 1, 1), (1, 1, 1))
    )
    check_groupings(rel)
    for a, b in zip(
        relation_arrays(rel),
        relation_arrays(build_kernel_relation(coords, coords, kind="forward")),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("kernel_size", "dilation", "tensor_stride"),
    [
        (3, 1, 1),
        (1, 1, 1),
        (2, 1, 1),
        (4, 1, 1),
        (5, 2, 1),
        (7, 1, 1),
        ((3, 1, 5), 1, 1),
        ((2, 4, 3), (1, 2, 1), 2),
    ],
)
@pytest.mark.parametrize("extent", [40, 9])
def test_sorted_coordinates_match_coordinate_hash(
    rng, ref, kernel_size, dilation, tensor_stride, extent
):
    # Rows sorted by (batch, x, y, z), as voxelize and np.unique give them,
    # relate to themselves through the sorted walk, sparse (extent 40) or
    # dense (extent 9). Every array, order included, must equal the relation
    # of the same set given as outputs (coordinate hash), and the edges the
    # brute force.
    ts = (tensor_stride,) * 3 if isinstance(tensor_stride, int) else tensor_stride
    coords = ref.random_coords(rng, 700, extent, batches=3, step=ts[0])
    coords = coords[np.lexsort(coords.T[::-1])]
    coords[:, 1] -= 20 * ts[0]  # negative x too
    args = {"kernel_size": kernel_size, "dilation": dilation, "tensor_stride": tensor_stride}
    merged = build_kernel_relation(coords, **args)
    hashed = build_kernel_relation(coords, coords, kind="forward", **args)
    for a, b in zip(relation_arrays(merged), relation_arrays(hashed), strict=True):
        np.testing.assert_array_equal(a, b)
    ks = (kernel_size,) * 3 if isinstance(kernel_size, int) else kernel_size
    dil = (dilation,) * 3 if isinstance(dilation, int) else dilation
    assert edge_set(merged) == ref.brute_force_edges(coords, coords, ref.offsets(ks, dil, ts))
    check_groupings(merged)


def test_sorted_sparse_rows_at_coordinate_limits(ref):
    # Sorted sparse rows at both ends of int32, in several batches (too wide
    # a span for the sorted walk's 62-bit keys, so searched by the hash):
    # no neighbour wraps around, crosses a batch or is missed.
    low, high = -(2**31), 2**31 - 1
    rows = []
    for b in range(3):
        for x in (low, low + 1, -1, 0, 1, high - 1, high):
            for y in (low, 0, high - 1, high):
                for z in (low, low + 2, 0, high):
                    if (x + y + z + b) % 3:
                        rows.append((b, x, y, z))
    coords = np.array(sorted(rows), dtype=np.int64).astype(np.int32)
    check_3x3x3_against_hash(ref, coords)


def test_sorted_rows_at_the_key_limit(ref):
    # Sorted sparse rows whose span just fits the sorted walk's keys (three
    # batches, 2^20 + 2 cells along each padded axis: 2^61.6 in all), at the
    # ends of every axis: a neighbour one cell past an axis' end is never
    # found at the next x, y or batch.
    top = 2**20 - 1
    rows = []
    for b in range(3):
        for x in (0, 1, top - 1, top):
            for y in (0, 1, top - 1, top):
                for z in (0, 1, 2, top - 1, top):
                    if (x + y + z + b) % 4:
                        rows.append((b, x, y, z))
    check_3x3x3_against_hash(ref, np.array(sorted(rows), dtype=np.int32))


def test_sorted_rows_with_long_slabs(rng, ref, restore_threads):
    # Four x slabs of 6000 sparse rows each, the same (y, z) in every slab:
    # each row's neighbour at dx = -1 lies 6000 rows back, past a chunk of
    # the parallel walk, which must then lengthen its chunks (a mirror
    # written by two threads at once can lose bits, seen as missing edges,
    # and ThreadSanitizer reports it: tools/sanitizers.sh runs this test).
    # Reference: a dict of the coordinates (the brute force's pairwise
    # table would not fit in memory).
    yz = np.sort(rng.choice(4000 * 4000, size=6000, replace=False))
    rows = [(0, x, int(v) // 4000, int(v) % 4000) for x in range(4) for v in yz]
    coords = np.array(rows, dtype=np.int32)
    index = {row: r for r, row in enumerate(rows)}
    expected = set()
    for k, (dx, dy, dz) in enumerate(ref.offsets((3, 3, 3), (1, 1, 1), (1, 1, 1)).tolist()):
        for o, (b, x, y, z) in enumerate(rows):
            i = index.get((b, x + dx, y + dy, z + dz))
            if i is not None:
                expected.add((i, o, k))
    hashed = relation_arrays(build_kernel_relation(coords, coords, kind="forward"))
    for threads in (1, 2, 4):
        restore_threads.set_num_threads(threads)
        rel = build_kernel_relation(coords, kernel_size=3)
        assert edge_set(rel) == expected
        check_groupings(rel)
        for a, b in zip(relation_arrays(rel), hashed, strict=True):
            np.testing.assert_array_equal(a, b)


def test_dense_clusters_at_coordinate_limits(rng, ref):
    # Dense clusters (block grid path) at both ends of int32, straddling zero
    # and in several batches: no neighbour wraps around or crosses a batch.
    low, high = -(2**31), 2**31 - 5
    cube = np.stack(np.meshgrid(*[np.arange(5)] * 3, indexing="ij"), -1).reshape(-1, 3)
    parts = []
    for b, corner in ((0, (high, high, high)), (1, (low, low, low)), (0, (-2, -3, -2)), (2, (high, low, 0))):
        xyz = cube + np.array(corner, dtype=np.int64)
        parts.append(np.concatenate([np.full((len(xyz), 1), b), xyz], 1))
    coords = np.concatenate(parts).astype(np.int32)
    coords = coords[rng.permutation(len(coords))]
    check_3x3x3_against_hash(ref, coords)


def test_duplicates_found_on_both_paths():
    dense = shell_coords(6.0)
    dup = np.concatenate([dense, dense[[7]], dense[:3]])
    with pytest.raises(ValueError, match=rf"at rows 7 and {len(dense)}\."):
        build_kernel_relation(dup)
    sparse = np.array([[0, 0, 0, 0], [0, 1000, 0, 0], [1, 5, 5, 5], [0, 1000, 0, 0]], np.int32)
    with pytest.raises(ValueError, match=r"\(0, 1000, 0, 0\) at rows 1 and 3\."):
        build_kernel_relation(sparse)


@pytest.fixture
def restore_threads():
    import mlx_lattice

    previous = mlx_lattice.get_num_threads()
    yield mlx_lattice
    mlx_lattice.set_num_threads(previous)


def test_large_surface_is_exact_for_any_thread_count(rng, restore_threads):
    # About 10k voxels per batch, 2 batches, rows shuffled: many grid tasks and
    # several grouping chunks. The hash path and NumPy's stable argsort are the
    # references; 1, 2 and 3 threads give identical bits.
    coords = shell_coords(28.0, batches=2)
    coords = coords[rng.permutation(len(coords))]
    expected = relation_arrays(build_kernel_relation(coords, coords, kind="forward"))
    results = []
    for n in (1, 2, 3):
        restore_threads.set_num_threads(n)
        rel = build_kernel_relation(coords, kernel_size=3)
        results.append(relation_arrays(rel))
    check_groupings(rel)
    assert rel.n_edges > 2 * 65536  # at least two grouping chunks
    for arrays in results:
        for a, b in zip(arrays, expected, strict=True):
            np.testing.assert_array_equal(a, b)


def _triple(v):
    return tuple(int(a) for a in np.broadcast_to(np.array(v), (3,)))


def shifted_coords(rng, ref, n, extent, ts, shift, batches=2):
    """Random rows on a grid of spacing ts (per axis), moved by shift (per
    axis; negative coordinates included)."""
    rows = ref.random_coords(rng, n, extent, batches=batches)
    rows = rows.astype(np.int64)
    rows[:, 1:] = rows[:, 1:] * np.array(ts) + np.array(shift)
    return rows.astype(np.int32)


@pytest.mark.parametrize(
    ("tensor_stride", "shift", "kernel_size", "dilation"),
    [
        (2, (0, 0, 0), 3, 1),
        (4, (-40, -40, -40), 3, 1),
        (8, (-4, 0, 4), 3, 1),
        (3, (1, -2, 0), 3, 1),
        ((2, 4, 1), (1, 1, 0), 3, 1),
        (2, (0, 0, 0), 5, 2),
        (4, (0, 0, 0), 2, 1),
    ],
)
def test_coarse_submanifold_matches_brute_force(
    rng, ref, tensor_stride, shift, kernel_size, dilation
):
    # Rows on a grid of spacing tensor_stride, shifted (negative coordinates
    # too), as at the strided levels of a network: the self relation and the
    # same relation with its outputs given agree in every array, and both
    # match the brute force.
    ts = _triple(tensor_stride)
    coords = shifted_coords(rng, ref, 300, 7, ts, shift)
    args = {"kernel_size": kernel_size, "dilation": dilation, "tensor_stride": tensor_stride}
    grid = build_kernel_relation(coords, **args)
    hashed = build_kernel_relation(coords, coords, kind="forward", **args)
    for a, b in zip(relation_arrays(grid), relation_arrays(hashed), strict=True):
        np.testing.assert_array_equal(a, b)
    offsets = ref.offsets(_triple(kernel_size), _triple(dilation), ts)
    assert edge_set(grid) == ref.brute_force_edges(coords, coords, offsets)
    check_groupings(grid)


def test_coarse_submanifold_with_a_row_off_the_grid(rng, ref):
    # One row off the tensor-stride grid: no neighbour of it, the rest exact.
    coords = shifted_coords(rng, ref, 200, 6, (2, 2, 2), (0, 0, 0))
    coords = np.concatenate([coords, np.array([[0, 1, 1, 1]], np.int32)])
    rel = build_kernel_relation(coords, kernel_size=3, tensor_stride=2)
    offsets = ref.offsets((3, 3, 3), (1, 1, 1), (2, 2, 2))
    assert edge_set(rel) == ref.brute_force_edges(coords, coords, offsets)
    check_groupings(rel)


@pytest.mark.parametrize("stride", [2, 3])
def test_strided_outputs_name_duplicated_inputs(stride):
    # Computed strided outputs sort their inputs instead of hashing them: a
    # duplicated input still raises, naming the first repeat in row order.
    coords = np.array([[0, x, y, -6] for x in range(6) for y in range(6)], np.int32)
    dup = np.concatenate([coords, coords[[7, 5, 7]]])
    n = len(coords)
    with pytest.raises(ValueError, match=rf"\(0, 1, 1, -6\) at rows 7 and {n}\."):
        build_kernel_relation(dup, kernel_size=2, stride=stride, kind="forward")
    far = np.array([[0, 0, 0, 0], [0, 2**31 - 1, -(2**31), 5], [0, 0, 0, 0]], np.int32)
    with pytest.raises(ValueError, match=r"\(0, 0, 0, 0\) at rows 0 and 2\."):
        build_kernel_relation(far, kernel_size=1, stride=stride, kind="forward")


def test_coarse_duplicates_show_the_given_coordinates():
    coords = np.array([[0, 2 * x, 2 * y, -6] for x in range(6) for y in range(6)], np.int32)
    dup = np.concatenate([coords, coords[[5]]])
    with pytest.raises(ValueError, match=rf"\(0, 0, 10, -6\) at rows 5 and {len(coords)}\."):
        build_kernel_relation(dup, tensor_stride=2)


@pytest.mark.parametrize(
    ("kernel_size", "stride", "dilation", "tensor_stride", "shift"),
    [
        (2, 2, 1, 1, (0, 0, 0)),
        (2, 2, 1, 1, (-9, -4, -1)),
        (2, 3, 1, 1, (0, 0, 0)),
        (2, 4, 1, 1, (-3, 0, 0)),
        (2, 4, 2, 1, (0, -5, 0)),
        (2, 2, 1, 2, (0, 0, 0)),
        (2, 2, 1, 4, (-8, 4, 0)),
        ((2, 1, 2), (2, 1, 2), 1, 1, (0, 0, 0)),
        ((2, 2, 1), (2, 1, 2), 1, 1, (-1, 0, 0)),
        (1, 2, 1, 1, (0, 0, -3)),
        (3, 3, 1, 1, (0, 0, 0)),
    ],
)
@pytest.mark.parametrize("fine_order", ["random", "sorted"])
def test_strided_and_transposed_relations_match_brute_force(
    rng, ref, kernel_size, stride, dilation, tensor_stride, shift, fine_order
):
    # Forward (outputs computed and given) and target relations of kernels of
    # up to two taps per axis take one candidate per fine row; every kind is
    # checked against the brute force and the canonical groupings (which fix
    # every array), and the target against the transpose of the forward.
    # Sorted sets are searched by key, others hashed: both orders of the
    # fine rows, and the coarse rows sorted (as computed) and reversed.
    ts = _triple(tensor_stride)
    fine = shifted_coords(rng, ref, 300, 7, ts, shift)
    if fine_order == "sorted":
        fine = np.unique(fine, axis=0)
    args = {"kernel_size": kernel_size, "dilation": dilation, "tensor_stride": tensor_stride}
    down = build_kernel_relation(fine, stride=stride, kind="forward", **args)
    st = np.array(_triple(stride)) * np.array(ts)
    floored = np.concatenate([fine[:, :1], (fine[:, 1:] // st) * st], axis=1)
    coarse = np.array(down.out_coords)
    np.testing.assert_array_equal(coarse, np.unique(floored, axis=0))
    offsets = ref.offsets(_triple(kernel_size), _triple(dilation), ts)
    assert edge_set(down) == ref.brute_force_edges(fine, coarse, offsets)
    check_groupings(down)
    for outs in (coarse, coarse[::-1].copy()):
        given = build_kernel_relation(fine, outs, kind="forward", **args)
        assert edge_set(given) == ref.brute_force_edges(fine, outs, offsets)
        check_groupings(given)
        up = build_kernel_relation(outs, fine, kind="target", **args)
        assert edge_set(up) == ref.brute_force_edges(outs, fine, offsets, sign=-1)
        check_groupings(up)
    up = build_kernel_relation(coarse, fine, kind="target", **args)
    assert edge_set(up) == {(o, i, k) for i, o, k in edge_set(down)}


def test_transposed_relation_onto_sets_off_the_coarse_grid(rng, ref):
    # Coarse rows not all multiples of 2 * dilation * tensor_stride (and a
    # coarse row between fine rows): the general search, still exact.
    fine = ref.random_coords(rng, 200, 7, batches=2)
    coarse = ref.random_coords(rng, 80, 7, batches=2)
    offsets = ref.offsets((2, 2, 2), (1, 1, 1), (1, 1, 1))
    up = build_kernel_relation(coarse, fine, kernel_size=2, kind="target")
    assert edge_set(up) == ref.brute_force_edges(coarse, fine, offsets, sign=-1)
    check_groupings(up)
    down = build_kernel_relation(fine, coarse, kernel_size=2, kind="forward")
    assert edge_set(down) == ref.brute_force_edges(fine, coarse, offsets)
    check_groupings(down)


def test_strided_relations_at_coordinate_limits_and_empty(ref):
    low, high = -(2**31), 2**31 - 1
    fine = np.array(
        [[0, low, low, 0], [0, low + 1, low, 1], [0, high, high, high], [1, high - 1, 0, -1],
         [1, -1, -1, -1], [1, 0, 0, 0]],
        np.int32,
    )
    down = build_kernel_relation(fine, kernel_size=2, stride=2, kind="forward")
    coarse = np.array(down.out_coords)
    offsets = ref.offsets((2, 2, 2), (1, 1, 1), (1, 1, 1))
    assert edge_set(down) == ref.brute_force_edges(fine, coarse, offsets)
    up = build_kernel_relation(coarse, fine, kernel_size=2, kind="target")
    assert edge_set(up) == ref.brute_force_edges(coarse, fine, offsets, sign=-1)
    for rel in (down, up):
        check_groupings(rel)
    # An odd stride cannot floor int32's minimum inside int32 on the coarse
    # grid of a transposed relation: no partner, no wrap-around.
    edge = np.array([[0, low, 0, 0]], np.int32)
    coarse3 = np.array([[0, high - 1, 0, 0]], np.int32)
    rel = build_kernel_relation(coarse3, edge, kernel_size=2, tensor_stride=1, kind="target")
    assert rel.n_edges == 0
    empty = np.zeros((0, 4), np.int32)
    for rel in (
        build_kernel_relation(empty, kernel_size=2, stride=2, kind="forward"),
        build_kernel_relation(empty, fine, kernel_size=2, kind="target"),
        build_kernel_relation(coarse, empty, kernel_size=2, kind="target"),
        build_kernel_relation(empty, tensor_stride=4),
    ):
        check_groupings(rel)
        assert rel.n_edges == 0


def test_strided_forward_outputs_outside_int32_raise():
    """int32's minimum floored to an odd stride (or a stride times
    tensor_stride that does not divide 2^31) lies below int32: the computed
    forward outputs raise, naming the row, instead of wrapping around to
    the other end of the grid (found by fuzzing)."""
    low = -(2**31)
    rows = np.array([[0, 5, 5, 5], [0, 0, 0, low]], np.int32)
    for stride, tensor_stride in ((3, 1), ((1, 1, 3), 1), (2, (1, 1, 3))):
        with pytest.raises(MlxLatticeError, match=r"in_coords row 1 .* outside int32"):
            build_kernel_relation(
                rows, kernel_size=1, stride=stride, tensor_stride=tensor_stride, kind="forward"
            )
    # Strides dividing 2^31 floor it to itself.
    rel = build_kernel_relation(rows, kernel_size=1, stride=4, kind="forward")
    assert np.array(rel.out_coords).tolist() == [[0, 0, 0, low], [0, 4, 4, 4]]


@pytest.mark.parametrize("shuffled", [True, False])
@pytest.mark.parametrize("kind", ["forward", "target", "submanifold", "transposed"])
def test_strided_kinds_are_exact_for_any_thread_count(rng, ref, restore_threads, kind, shuffled):
    # About 40k fine rows (several tiles, and two parts of the groupings'
    # counting sort from 2 threads on): 1, 2 and 3 threads give identical
    # bits, hashed (shuffled rows) or searched by key (sorted rows; the
    # target's key search restarts at every tile).
    fine = shell_coords(40.0, batches=2)
    if shuffled:
        fine = fine[rng.permutation(len(fine))]
    down = build_kernel_relation(fine, kernel_size=2, stride=2, kind="forward")
    results = []
    for n in (1, 2, 3):
        restore_threads.set_num_threads(n)
        if kind == "forward":
            rel = build_kernel_relation(fine, kernel_size=2, stride=2, kind="forward")
        elif kind == "target":
            rel = build_kernel_relation(down.out_coords, fine, kernel_size=2, kind="target")
        elif kind == "transposed":  # several row tiles of the transpose
            rel = down.transposed()
        else:
            rel = build_kernel_relation(down.out_coords, tensor_stride=2)
        results.append(relation_arrays(rel))
    check_groupings(rel)
    for arrays in results[1:]:
        for a, b in zip(arrays, results[0], strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shuffled", [True, False])
def test_strided_forward_with_parentless_rows_at_any_thread_count(rng, restore_threads, shuffled):
    # Stride 4, kernel 2: a fine row has an edge only where its offset in
    # its 4-cell is 0 or 1 on every axis, so most rows have none and their
    # output may have none either. About 40k fine rows: the edges, the
    # outputs' first edges and the input grouping are written in parallel
    # parts, so 1, 2 and 3 threads must agree with a NumPy reference of the
    # edges (by output, then offset) and its canonical groupings.
    fine = shell_coords(40.0, batches=2)
    if shuffled:
        fine = fine[rng.permutation(len(fine))]
    floored = np.concatenate([fine[:, :1], (fine[:, 1:] // 4) * 4], axis=1)
    coarse, out_of_row = np.unique(floored, axis=0, return_inverse=True)
    within = fine[:, 1:] - floored[:, 1:]
    valid = np.all(within < 2, axis=1)
    kid = within[:, 0] * 4 + within[:, 1] * 2 + within[:, 2]
    rows = np.flatnonzero(valid)
    order = np.lexsort((kid[rows], out_of_row.reshape(-1)[rows]))
    expected = [rows[order], out_of_row.reshape(-1)[rows][order], kid[rows][order]]
    assert 0 < len(rows) < len(fine) // 2 and len(coarse) > len(np.unique(expected[1]))
    results = []
    for n in (1, 2, 3):
        restore_threads.set_num_threads(n)
        rel = build_kernel_relation(fine, kernel_size=2, stride=4, kind="forward")
        np.testing.assert_array_equal(np.array(rel.out_coords), coarse)
        for got, want in zip(relation_arrays(rel)[:3], expected, strict=True):
            np.testing.assert_array_equal(got, want)
        check_groupings(rel)
        results.append(relation_arrays(rel))
    for arrays in results[1:]:
        for a, b in zip(arrays, results[0], strict=True):
            np.testing.assert_array_equal(a, b)


_MIRROR_SCRIPT = """
import sys
import numpy as np
from mlx_lattice._native import ext
from mlx_lattice.core import build_kernel_relation

rng = np.random.default_rng(11)
pts = rng.integers(0, 24, (9000, 3))
coords = np.unique(np.concatenate([rng.integers(0, 2, (9000, 1)), pts], 1), axis=0)
coords = coords.astype(np.int32)
arrays = {}
for size in ((3, 3, 3), (3, 3, 1), (5, 5, 1), (1, 1, 1)):
    rel = build_kernel_relation(coords, kernel_size=size)
    for name in ("in_rows", "out_rows", "kernel_ids"):
        arrays[f"{size}.{name}"] = np.array(getattr(rel.edges, name))
    for name in ("input_csr", "kernel_csr", "output_csr"):
        arrays[f"{size}.{name}.offsets"] = np.array(getattr(rel, name).row_offsets)
        arrays[f"{size}.{name}.ids"] = np.array(getattr(rel, name).edge_ids)
np.savez(sys.argv[1], isa=ext.gemm_isa(), **arrays)
"""


def test_mirrored_relations_are_the_same_bits_at_every_isa(tmp_path, isa_child):
    # Sorted rows and odd kernels of at most 32 offsets take the mirrored
    # edge pass, whose writer differs by ISA ceiling (AVX-512 compresses a
    # row's kernel ids, POPCNT counts mirrors, the portable one counts bits
    # by arithmetic): about 8k rows (several of its 2048-row tiles), kernels
    # with both 16-offset halves, with one empty, and the single centre. The
    # default ISA's relations are checked against the brute force by the
    # other tests.
    results = {}
    for isa in ext.gemm_isas():
        path = tmp_path / f"{isa}.npz"
        isa_child(_MIRROR_SCRIPT, isa, path)
        results[isa] = dict(np.load(path))
        assert str(results[isa].pop("isa")) == isa
    reference = results.pop(ext.gemm_isa())
    for isa, arrays in results.items():
        assert arrays.keys() == reference.keys()
        for key, want in reference.items():
            np.testing.assert_array_equal(arrays[key], want, err_msg=f"{isa}: {key}")
