"""Convolution padding and explicit output supports, weight-normalized variants,
pooling with padding/dilation, unpooling and trilinear upsampling.

References: MLX's dense ``mx.conv_general`` on a scattered grid (and its vjp
for transposed convolutions), brute-force neighbourhoods, NumPy/SciPy
trilinear interpolation; gradients against central finite differences.
"""

import functools
import itertools

import mlx.core as mx
import numpy as np
import pytest
from scipy.interpolate import RegularGridInterpolator

from mlx_lattice import SparseTensor, SparseTensorError, nn, ops
from mlx_lattice.core import QuantizedWeight
from mlx_lattice.core import ops as core_ops

GRID = 8


@pytest.fixture(params=[21, 22])
def seeded(request):
    """A seeded generator; the seed is printed so a failure shows it."""
    print(f"seed={request.param}")
    mx.random.seed(request.param)
    return np.random.default_rng(request.param)


def arr(rng, *shape):
    return mx.array(rng.standard_normal(shape).astype(np.float32))


def close(a, b, tol=1e-4):
    a, b = np.array(a), np.array(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()))


def padded_offsets(ks, dilation, padding, ts=(1, 1, 1)):
    """Window offsets i * d - p per axis, x-major, written out from the formula."""
    return np.array(
        [
            [(i[a] * dilation[a] - padding[a]) * ts[a] for a in range(3)]
            for i in itertools.product(*(range(k) for k in ks))
        ],
        dtype=np.int64,
    )


def dense_forward(ref, coords, feats, w, out_coords, *, stride, dilation, padding, batches=2):
    """Dense conv with explicit low padding (high padding covers every output)."""
    ks = tuple(int(d) for d in w.shape[1:4])
    hi = [d * (k - 1) for k, d in zip(ks, dilation, strict=True)]
    dense = ref.to_dense(coords, feats, (GRID,) * 3, batches)
    out = mx.conv_general(
        dense, w, stride=list(stride), padding=(list(padding), hi), kernel_dilation=list(dilation)
    )
    idx = out_coords.astype(np.int64)
    pos = [mx.array(idx[:, a + 1] // stride[a]) for a in range(3)]
    return out[mx.array(idx[:, 0]), pos[0], pos[1], pos[2]]


def dense_transpose(ref, coarse, feats, w, fine, *, stride, dilation, padding, batches=2):
    """The adjoint of the dense forward conv: vjp w.r.t. its fine input."""
    ks = tuple(int(d) for d in w.shape[1:4])
    cin_t, cout_t = int(w.shape[4]), int(w.shape[0])
    mapped = np.array(core_ops.mapped_conv_weight(w))  # (K, Cin_t, Cout_t)
    v = mx.array(mapped.transpose(0, 2, 1).reshape(*ks, cout_t, cin_t).transpose(4, 0, 1, 2, 3))
    hi = [d * (k - 1) for k, d in zip(ks, dilation, strict=True)]

    def forward(grid):
        return mx.conv_general(
            grid,
            v,
            stride=list(stride),
            padding=(list(padding), hi),
            kernel_dilation=list(dilation),
        )

    primal = mx.zeros((batches, GRID, GRID, GRID, cout_t))
    out_shape = forward(primal).shape
    idx = coarse.astype(np.int64)
    flat = (
        (idx[:, 0] * out_shape[1] + idx[:, 1] // stride[0]) * out_shape[2] + idx[:, 2] // stride[1]
    ) * out_shape[3] + idx[:, 3] // stride[2]
    cot = mx.zeros((int(np.prod(out_shape[:4])), cin_t)).at[mx.array(flat)].add(feats)
    _, (grad,) = mx.vjp(forward, [primal], [cot.reshape(out_shape)])
    f = fine.astype(np.int64)
    return grad[mx.array(f[:, 0]), mx.array(f[:, 1]), mx.array(f[:, 2]), mx.array(f[:, 3])]


def brute_transpose(coarse, feats, w, fine, offsets):
    """out[r] = sum over (q, i) with r == q + offsets[i] of feats[q] @ W_i."""
    mapped = np.array(core_ops.mapped_conv_weight(w)).astype(np.float64)
    index = {tuple(r): n for n, r in enumerate(fine.tolist())}
    out = np.zeros((len(fine), mapped.shape[2]))
    f = np.array(feats).astype(np.float64)
    for q, row in enumerate(coarse.tolist()):
        for i, off in enumerate(offsets):
            r = index.get((row[0], *(np.array(row[1:]) + off)))
            if r is not None:
                out[r] += f[q] @ mapped[i]
    return out


# -- conv3d: padding and coordinates ------------------------------------------------------------


@pytest.mark.parametrize(
    ("ks", "stride", "dilation", "padding"),
    [
        ((3, 3, 3), (1, 1, 1), (1, 1, 1), (0, 1, 2)),
        ((3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0)),
        ((3, 3, 3), (2, 2, 2), (1, 1, 1), (2, 1, 0)),
        ((3, 2, 3), (2, 2, 2), (2, 1, 1), (3, 1, 4)),
        ((2, 2, 2), (2, 2, 2), (1, 1, 1), (1, 1, 1)),
        ((3, 3, 3), (1, 2, 1), (2, 2, 2), (2, 2, 2)),
    ],
)
def test_conv3d_padding_matches_dense(seeded, ref, ks, stride, dilation, padding):
    coords = ref.random_coords(seeded, 250, GRID, batches=2)
    x = SparseTensor(coords, arr(seeded, len(coords), 3))
    w, b = arr(seeded, 5, *ks, 3), arr(seeded, 5)
    y = ops.conv3d(x, w, b, stride=stride, dilation=dilation, padding=padding)
    # Padding moves the window, not the output support.
    plain = ops.conv3d(x, w, stride=stride, dilation=dilation)
    assert y.coordinate_key == plain.coordinate_key
    expected = dense_forward(
        ref,
        coords,
        x.feats,
        w,
        np.array(y.coords),
        stride=stride,
        dilation=dilation,
        padding=padding,
    )
    close(y.feats, expected + b)
    # The module gives the same.
    layer = nn.Conv3d(3, 5, ks, stride, dilation, padding=padding)
    layer.weight, layer.bias = w, b
    close(layer(x).feats, y.feats, 1e-6)


def test_conv3d_default_padding_is_centred(seeded, ref):
    coords = ref.random_coords(seeded, 200, GRID, batches=2)
    x = SparseTensor(coords, arr(seeded, len(coords), 4))
    w = arr(seeded, 3, 3, 3, 3, 4)
    np.testing.assert_allclose(
        np.array(ops.conv3d(x, w, padding=1).feats),
        np.array(ops.subm_conv3d(x, w).feats),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("form", ["array", "tensor", "key"])
def test_conv3d_explicit_coordinates_match_dense(seeded, ref, form):
    coords = ref.random_coords(seeded, 250, GRID, batches=2)
    x = SparseTensor(coords, arr(seeded, len(coords), 3))
    w = arr(seeded, 4, 3, 3, 3, 3)
    # Outputs anywhere on the stride-2 grid, including cells no input floors to.
    out = ref.random_coords(seeded, 60, GRID // 2, batches=2, step=2)
    if form == "array":
        target = out
    elif form == "tensor":
        target = SparseTensor(out, mx.zeros((len(out), 1)), tensor_stride=2)
    else:
        target = x.manager.register(mx.array(out), (2, 2, 2), "mine")
    y = ops.conv3d(x, w, stride=2, padding=1, coordinates=target)
    assert y.tensor_stride == (2, 2, 2)
    np.testing.assert_array_equal(np.array(y.coords), out)
    expected = dense_forward(
        ref, coords, x.feats, w, out, stride=(2, 2, 2), dilation=(1, 1, 1), padding=(1, 1, 1)
    )
    close(y.feats, expected)
    # Stride 1 onto other coordinates of the same grid.
    out1 = ref.random_coords(seeded, 80, GRID, batches=2)
    y1 = ops.conv3d(x, w, coordinates=out1)
    expected = dense_forward(
        ref, coords, x.feats, w, out1, stride=(1, 1, 1), dilation=(1, 1, 1), padding=(1, 1, 1)
    )
    close(y1.feats, expected)


def test_conv3d_padding_gradients_match_finite_differences(seeded, ref):
    coords = ref.random_coords(seeded, 60, 5, batches=1)
    x = SparseTensor(coords, arr(seeded, len(coords), 2))
    w = arr(seeded, 3, 3, 3, 3, 2)
    direction = None

    def loss(f, weight):
        out = ops.conv3d(x.replace(f), weight, stride=2, padding=(0, 2, 1)).feats
        return (out * direction).sum()

    direction = arr(seeded, *ops.conv3d(x, w, stride=2, padding=(0, 2, 1)).feats.shape)
    gf, gw = mx.grad(loss, argnums=(0, 1))(x.feats, w)
    vf, vw = arr(seeded, *x.feats.shape), arr(seeded, *w.shape)
    h = 1e-2
    fd = (loss(x.feats + h * vf, w + h * vw) - loss(x.feats - h * vf, w - h * vw)).item() / (2 * h)
    analytic = ((gf * vf).sum() + (gw * vw).sum()).item()
    assert analytic == pytest.approx(fd, rel=1e-3, abs=1e-3)


# -- transposed and generative convolution ------------------------------------------------------


@pytest.mark.parametrize(
    ("ks", "dilation", "padding"),
    [
        ((2, 2, 2), (1, 1, 1), None),
        ((3, 3, 3), (1, 1, 1), (0, 1, 2)),
        ((3, 3, 2), (2, 1, 1), (4, 0, 1)),
    ],
)
def test_conv_transpose3d_is_the_adjoint_of_dense_conv(seeded, ref, ks, dilation, padding):
    fine = ref.random_coords(seeded, 250, GRID, batches=2)
    x = SparseTensor(fine, arr(seeded, len(fine), 3))
    down = ops.conv3d(x, mx.ones((6, 2, 2, 2, 3)), stride=2)
    w, b = arr(seeded, 4, *ks, 6), arr(seeded, 4)
    up = ops.conv_transpose3d(down, w, b, stride=2, dilation=dilation, padding=padding)
    assert up.coords is x.coords
    pad = padding or tuple(((k - 1) // 2) * d for k, d in zip(ks, dilation, strict=True))
    expected = dense_transpose(
        ref,
        np.array(down.coords),
        down.feats,
        w,
        fine,
        stride=(2, 2, 2),
        dilation=dilation,
        padding=pad,
    )
    close(up.feats, expected + b)
    layer = nn.ConvTranspose3d(6, 4, ks, 2, dilation, padding=padding)
    layer.weight, layer.bias = w, b
    close(layer(down).feats, up.feats, 1e-6)
    # Onto explicit coordinates (here: another fine set, with cells no input covers).
    other = ref.random_coords(seeded, 90, GRID, batches=2)
    onto = ops.conv_transpose3d(
        down, w, stride=2, dilation=dilation, padding=padding, coordinates=other
    )
    expected = dense_transpose(
        ref,
        np.array(down.coords),
        down.feats,
        w,
        other,
        stride=(2, 2, 2),
        dilation=dilation,
        padding=pad,
    )
    close(onto.feats, expected)


@pytest.mark.parametrize(
    ("ks", "dilation", "padding"),
    [((2, 2, 2), (1, 1, 1), None), ((3, 3, 3), (2, 2, 2), None), ((3, 2, 3), (1, 2, 1), (0, 1, 3))],
)
def test_generative_transpose_honours_dilation_and_padding(seeded, ref, ks, dilation, padding):
    coords = ref.random_coords(seeded, 40, GRID // 2, batches=2, step=2)
    x = SparseTensor(coords, arr(seeded, len(coords), 3), tensor_stride=2)
    w = arr(seeded, 2, *ks, 3)
    y = ops.generative_conv_transpose3d(x, w, stride=2, dilation=dilation, padding=padding)
    pad = padding or tuple(((k - 1) // 2) * d for k, d in zip(ks, dilation, strict=True))
    offsets = padded_offsets(ks, dilation, pad)
    expected_rows = {
        (r[0], *(np.array(r[1:]) + off).tolist()) for r in coords.tolist() for off in offsets
    }
    got = np.array(y.coords)
    assert {tuple(r) for r in got.tolist()} == expected_rows
    assert y.tensor_stride == (1, 1, 1)
    close(y.feats, brute_transpose(coords, x.feats, w, got, offsets))
    # Module form, and the set is generated once per input set and geometry.
    layer = nn.GenerativeConvTranspose3d(3, 2, ks, 2, dilation, bias=False, padding=padding)
    layer.weight = w
    again = layer(x)
    assert again.coordinate_key == y.coordinate_key
    close(again.feats, y.feats, 1e-6)
    legacy = nn.ConvTranspose3d(3, 2, ks, 2, dilation, bias=False, generative=True, padding=padding)
    legacy.weight = w
    close(legacy(x).feats, y.feats, 1e-6)


def test_normalized_variants_match_their_formula(seeded, ref):
    fine = ref.random_coords(seeded, 250, GRID, batches=2)
    x = SparseTensor(fine, arr(seeded, len(fine), 3))
    w = arr(seeded, 4, 3, 3, 3, 3)
    y = ops.normalized_subm_conv3d(x, w, eps=1e-3)
    num = ref.dense_conv(fine, x.feats, w, grid=(GRID,) * 3, batches=2, out_coords=fine)
    den = ref.dense_conv(
        fine, mx.ones(x.feats.shape), w * w, grid=(GRID,) * 3, batches=2, out_coords=fine
    )
    close(y.feats, num / mx.sqrt(den + 1e-3))
    layer = nn.NormalizedSubMConv3d(3, 4, eps=1e-3, bias=False)
    layer.weight = w
    close(layer(x).feats, y.feats, 1e-6)

    down = ops.conv3d(x, mx.ones((5, 2, 2, 2, 3)), stride=2)
    coarse = np.array(down.coords)
    wt = arr(seeded, 3, 2, 2, 2, 5)
    kw = {"stride": (2, 2, 2), "dilation": (1, 1, 1), "padding": (0, 0, 0)}
    num = dense_transpose(ref, coarse, down.feats, wt, fine, **kw)
    den = dense_transpose(ref, coarse, mx.ones(down.feats.shape), wt * wt, fine, **kw)
    close(ops.normalized_conv_transpose3d(down, wt).feats, num / mx.sqrt(den + 1e-6))
    layer = nn.NormalizedConvTranspose3d(5, 3, bias=False)
    layer.weight = wt
    close(layer(down).feats, num / mx.sqrt(den + 1e-6))

    gen = ops.normalized_generative_conv_transpose3d(down, wt, eps=1e-6)
    rows = np.array(gen.coords)
    offsets = padded_offsets((2, 2, 2), (1, 1, 1), (0, 0, 0))
    num = brute_transpose(coarse, down.feats, wt, rows, offsets)
    den = brute_transpose(coarse, mx.ones(down.feats.shape), wt * wt, rows, offsets)
    close(gen.feats, num / np.sqrt(den + 1e-6))
    layer = nn.NormalizedGenerativeConvTranspose3d(5, 3, bias=False)
    layer.weight = wt
    close(layer(down).feats, gen.feats, 1e-6)


# -- pooling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["max", "avg", "sum"])
@pytest.mark.parametrize(
    ("ks", "stride", "dilation", "padding"),
    [
        ((2, 2, 2), (2, 2, 2), (1, 1, 1), None),
        ((3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0)),
        ((3, 3, 3), (2, 2, 2), (2, 2, 2), (1, 2, 3)),
        ((2, 3, 2), (1, 1, 1), (1, 1, 2), (1, 1, 1)),
    ],
)
def test_pool3d_with_padding_and_dilation(seeded, ref, mode, ks, stride, dilation, padding):
    coords = ref.random_coords(seeded, 250, GRID, batches=2)
    x = SparseTensor(coords, arr(seeded, len(coords), 3))
    y = ops.pool3d(x, ks, stride, padding=padding, dilation=dilation, mode=mode)
    pad = padding or tuple(((k - 1) // 2) * d for k, d in zip(ks, dilation, strict=True))
    edges = ref.brute_force_edges(coords, np.array(y.coords), padded_offsets(ks, dilation, pad))
    expected = ref.brute_force_pool(np.array(x.feats), edges, y.num_points, mode)
    np.testing.assert_allclose(np.array(y.feats), expected, rtol=1e-5, atol=1e-5)
    layer = {"max": nn.MaxPool3d, "avg": nn.AvgPool3d, "sum": nn.SumPool3d}[mode](
        ks, stride, padding, dilation
    )
    np.testing.assert_array_equal(np.array(layer(x).feats), np.array(y.feats))


@pytest.mark.parametrize("mode", ["sum", "avg", "max"])
def test_pool_transpose3d_against_brute_force(seeded, ref, mode):
    fine = ref.random_coords(seeded, 250, GRID, batches=2)
    x = SparseTensor(fine, arr(seeded, len(fine), 3))
    down = ops.max_pool3d(x, 2, 2)
    for ks in ((2, 2, 2), (3, 3, 3)):
        up = ops.pool_transpose3d(down, ks, 2, mode=mode)
        assert up.coords is x.coords
        offsets = ref.offsets(ks, (1, 1, 1), (1, 1, 1))
        edges = ref.brute_force_edges(np.array(down.coords), fine, offsets, sign=-1)
        expected = ref.brute_force_pool(np.array(down.feats), edges, len(fine), mode)
        np.testing.assert_allclose(np.array(up.feats), expected, rtol=1e-5, atol=1e-5)
    # kernel == stride: every fine point gets its parent's features.
    up = nn.PoolTranspose3d(2, 2, mode=mode)(down)
    parent = {tuple(r): i for i, r in enumerate(np.array(down.coords).tolist())}
    rows = [parent[(r[0], *(np.array(r[1:]) // 2 * 2).tolist())] for r in fine.tolist()]
    np.testing.assert_array_equal(np.array(up.feats), np.array(down.feats)[rows])


# -- trilinear upsampling ----------------------------------------------------------------------


def trilinear_reference(coarse, coarse_feats, T, fine, t):
    """Per-point loop: centres at c + stride / 2, absent corners dropped, renormalized."""
    table = {tuple(r): i for i, r in enumerate(coarse.tolist())}
    f = np.array(coarse_feats).astype(np.float64)
    out = np.zeros((len(fine), f.shape[1]))
    for n, row in enumerate(fine.tolist()):
        pos = [(row[a + 1] + t[a] / 2 - T[a] / 2) / T[a] for a in range(3)]
        lo = [int(np.floor(p)) for p in pos]
        acc, total = np.zeros(f.shape[1]), 0.0
        for corner in itertools.product((0, 1), repeat=3):
            key = (row[0], *[(lo[a] + corner[a]) * T[a] for a in range(3)])
            weight = np.prod(
                [pos[a] - lo[a] if corner[a] else 1 - (pos[a] - lo[a]) for a in range(3)]
            )
            if key in table:
                acc += weight * f[table[key]]
                total += weight
        out[n] = acc / total if total > 0 else 0.0
    return out


def test_trilinear_matches_scipy_on_a_full_grid(seeded):
    # A full 4^3 coarse grid at stride 2; fine points inside the hull of the centres.
    cells = np.array(list(itertools.product(range(4), repeat=3)))
    coarse = np.concatenate([np.zeros((64, 1), int), cells * 2], 1).astype(np.int32)
    values = seeded.standard_normal((64, 2)).astype(np.float32)
    x = SparseTensor(coarse, mx.array(values), tensor_stride=2)
    fine_cells = np.array(list(itertools.product(range(1, 7), repeat=3)))
    fine = np.concatenate([np.zeros((len(fine_cells), 1), int), fine_cells], 1).astype(np.int32)
    target = SparseTensor(fine, mx.zeros((len(fine), 1)))
    y = ops.trilinear_upsample3d(x, target)
    centres = np.arange(4) * 2 + 1.0
    grid_values = values.reshape(4, 4, 4, 2)
    for c in range(2):
        interp = RegularGridInterpolator((centres,) * 3, grid_values[..., c])
        np.testing.assert_allclose(
            np.array(y.feats)[:, c], interp(fine_cells + 0.5), rtol=1e-5, atol=1e-5
        )


def test_trilinear_on_sparse_inputs_and_by_stride(seeded, ref):
    coarse = ref.random_coords(seeded, 60, GRID // 4, batches=2, step=4)
    x = SparseTensor(coarse, arr(seeded, len(coarse), 3), tensor_stride=4)
    fine = ref.random_coords(seeded, 300, GRID + 4, batches=2)
    y = ops.trilinear_upsample3d(x, SparseTensor(fine, mx.zeros((len(fine), 1))))
    close(y.feats, trilinear_reference(coarse, x.feats, (4, 4, 4), fine, (1, 1, 1)), 1e-5)
    # By a stride: every fine cell of each block, here at tensor stride 2.
    up = nn.TrilinearUpsample3d(2)(x)
    assert up.tensor_stride == (2, 2, 2) and up.num_points == 8 * len(coarse)
    close(
        up.feats,
        trilinear_reference(coarse, x.feats, (4, 4, 4), np.array(up.coords), (2, 2, 2)),
        1e-5,
    )
    # Linear in the features: the gradient matches finite differences.
    direction = arr(seeded, *y.feats.shape)
    target = SparseTensor(fine, mx.zeros((len(fine), 1)))

    def loss(f):
        return (ops.trilinear_upsample3d(x.replace(f), target).feats * direction).sum()

    grad = mx.grad(loss)(x.feats)
    v = arr(seeded, *x.feats.shape)
    fd = (loss(x.feats + 0.1 * v) - loss(x.feats - 0.1 * v)).item() / 0.2
    assert (grad * v).sum().item() == pytest.approx(fd, rel=1e-3, abs=1e-3)


# -- bad input ------------------------------------------------------------------------------


def test_bad_padding_and_coordinates_raise(seeded, ref):
    coords = ref.random_coords(seeded, 100, GRID, batches=2)
    x = SparseTensor(coords, arr(seeded, len(coords), 3))
    w = mx.ones((2, 3, 3, 3, 3))
    with pytest.raises(ValueError, match="padding must be"):
        ops.conv3d(x, w, padding=-1)
    with pytest.raises(TypeError, match="padding must be"):
        ops.conv3d(x, w, padding=(1, 1))
    with pytest.raises(SparseTensorError, match="multiples of the output tensor stride"):
        ops.conv3d(x, w, stride=2, coordinates=np.array([[0, 1, 0, 0]], np.int32))
    with pytest.raises(SparseTensorError, match="tensor stride"):
        ops.conv3d(x, w, stride=2, coordinates=x)
    with pytest.raises(SparseTensorError, match="no coordinate set"):
        ops.conv3d(x, w, coordinates=((1, 1, 1), "missing"))
    with pytest.raises(SparseTensorError, match="coordinates must be"):
        ops.conv3d(x, w, coordinates=[[0, 0, 0, 0]])
    with pytest.raises(ValueError, match="duplicate"):
        ops.conv3d(x, w, coordinates=np.zeros((2, 4), np.int32))
    with pytest.raises(SparseTensorError, match="exactly one of target or stride"):
        ops.trilinear_upsample3d(x)
    with pytest.raises(SparseTensorError, match="mode must be"):
        ops.pool3d(x, mode="median")
    qw = QuantizedWeight.from_float(mx.ones((2, 3, 3, 3, 32)), bits=8, group_size=32)
    with pytest.raises(SparseTensorError, match="take float weights"):
        ops.normalized_subm_conv3d(x, qw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no coordinates="):
        nn.SubMConv3d(3, 2)(x, coordinates=x)


def directional_check(loss, args, seeded, h=1e-2, tol=2e-3):
    """<grad, v> against a central difference along a random direction v."""
    grads = mx.grad(loss, argnums=tuple(range(len(args))))(*args)
    grads = grads if isinstance(grads, tuple | list) else (grads,)
    vs = [arr(seeded, *a.shape) for a in args]
    plus = loss(*[a + h * v for a, v in zip(args, vs, strict=True)]).item()
    minus = loss(*[a - h * v for a, v in zip(args, vs, strict=True)]).item()
    analytic = sum((g * v).sum().item() for g, v in zip(grads, vs, strict=True))
    assert analytic == pytest.approx((plus - minus) / (2 * h), rel=tol, abs=tol)


@pytest.mark.parametrize("mode", ["sum", "avg"])
def test_pool_gradients_match_finite_differences(seeded, ref, mode):
    coords = ref.random_coords(seeded, 80, 6, batches=2)
    x = SparseTensor(coords, arr(seeded, len(coords), 3))
    down = ops.pool3d(x, 3, 2, padding=(0, 1, 2), dilation=(1, 2, 1), mode=mode)
    d1 = arr(seeded, *down.feats.shape)
    directional_check(
        lambda f: (
            ops.pool3d(x.replace(f), 3, 2, padding=(0, 1, 2), dilation=(1, 2, 1), mode=mode).feats
            * d1
        ).sum(),
        [x.feats],
        seeded,
    )
    d2 = arr(seeded, len(coords), 3)
    directional_check(
        lambda f: (ops.pool_transpose3d(down.replace(f), 3, 2, mode=mode).feats * d2).sum(),
        [down.feats],
        seeded,
    )


def test_transposed_and_normalized_gradients_match_finite_differences(seeded, ref):
    coords = ref.random_coords(seeded, 30, 3, batches=1, step=2)
    x = SparseTensor(coords, arr(seeded, len(coords), 2), tensor_stride=2)
    w = arr(seeded, 3, 3, 2, 3, 2)
    n_out = ops.generative_conv_transpose3d(x, w, padding=(1, 0, 2), dilation=(1, 2, 1)).num_points
    d = arr(seeded, n_out, 3)
    # eps 0.5 keeps the normalization smooth at the finite-difference step: an
    # output reached by one small weight is sharply curved in it at eps 1e-6.
    normalized = functools.partial(ops.normalized_generative_conv_transpose3d, eps=0.5)
    for fn in (ops.generative_conv_transpose3d, normalized):
        directional_check(
            lambda f, weight, fn=fn: (
                fn(x.replace(f), weight, padding=(1, 0, 2), dilation=(1, 2, 1)).feats * d
            ).sum(),
            [x.feats, w],
            seeded,
        )


def test_empty_inputs_give_empty_or_zero_outputs():
    e = SparseTensor(np.zeros((0, 4), np.int32), mx.zeros((0, 3)), tensor_stride=2)
    target = SparseTensor(np.array([[0, 0, 0, 0]], np.int32), mx.zeros((1, 1)))
    assert ops.trilinear_upsample3d(e, target).feats.tolist() == [[0.0, 0.0, 0.0]]
    assert ops.trilinear_upsample3d(e, stride=2).feats.shape == (0, 3)
    assert ops.generative_conv_transpose3d(e, mx.ones((2, 2, 2, 2, 3))).feats.shape == (0, 2)
    assert ops.conv3d(e, mx.ones((2, 3, 3, 3, 3)), padding=0).feats.shape == (0, 2)
    assert ops.pool3d(e, 3, 2, padding=1).feats.shape == (0, 3)
    assert ops.global_max_pool(e, batch_size=2).tolist() == [[0.0] * 3] * 2


def test_compile_and_vmap_over_features(seeded, ref):
    coords = ref.random_coords(seeded, 200, GRID, batches=2)
    x = SparseTensor(coords, arr(seeded, len(coords), 4))
    coarse = ops.max_pool3d(x)
    w = arr(seeded, 3, 3, 3, 3, 4)
    cases = [
        (lambda f: ops.trilinear_upsample3d(coarse.replace(f), x).feats, coarse.feats),
        (lambda f: ops.conv3d(x.replace(f), w, stride=2, padding=0).feats, x.feats),
        (lambda f: ops.pool_transpose3d(coarse.replace(f), 3, 2).feats, coarse.feats),
        (lambda f: ops.linear(x.replace(f), w[:, 0, 0, 0, :]).feats, x.feats),
    ]
    for fn, feats in cases:
        np.testing.assert_array_equal(np.array(mx.compile(fn)(feats)), np.array(fn(feats)))
    # Trilinear upsampling is plain MLX ops: it vmaps over a stack of feature sets.
    stack = mx.stack([coarse.feats, 2 * coarse.feats])
    upsample = cases[0][0]
    np.testing.assert_allclose(
        np.array(mx.vmap(upsample)(stack)[1]), np.array(upsample(2 * coarse.feats)), rtol=1e-6
    )
