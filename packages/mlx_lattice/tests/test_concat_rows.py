"""The extension's row concatenation ``ext.concat_rows(a, b)`` (``csrc/concat_rows.cpp``)
and :func:`mlx_lattice.ops.cat`, which runs it for two tensors of one dtype.

* Its bytes against NumPy's ``concatenate`` of the same bit patterns
  (random bits, so float NaN payloads too: the op copies, never converts),
  for float32 / float16 / bfloat16 / int8 / uint8 / int16 / int32 / int64 /
  bool, widths that are and are not multiples of 4 (the constant-size and
  the general copies), zero rows and zero-width operands, strided inputs,
  several parallel tasks, and one thread against the pool.
* Bad arguments raise :class:`~mlx_lattice.MlxLatticeError` naming them.
* Transforms against MLX's own concatenate: vjp, jvp, vmap (each operand
  mapped or not, on any axis), ``mx.compile`` (also shapeless).
* Its output comes from the active activation arena.
* ``ops.cat``, a model's eval forward and the compiled float and static
  int8 graphs (whose concatenations join int8 codes) give the bits of
  ``mx.concatenate``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice import ops
from mlx_lattice._native import ext
from mlx_lattice.tensor import SparseTensor

_spec = importlib.util.spec_from_file_location(
    "data", Path(__file__).with_name("inference_data.py")
)
data = importlib.util.module_from_spec(_spec)  # the shared tests/inference_data.py
_spec.loader.exec_module(data)

# dtype -> the unsigned NumPy type of its bit pattern.
_BITS = {
    mx.float32: np.uint32,
    mx.float16: np.uint16,
    mx.bfloat16: np.uint16,
    mx.int8: np.uint8,
    mx.uint8: np.uint8,
    mx.int16: np.uint16,
    mx.int32: np.uint32,
    mx.int64: np.uint64,
    mx.bool_: np.uint8,
}
_MX_BITS = {np.uint8: mx.uint8, np.uint16: mx.uint16, np.uint32: mx.uint32, np.uint64: mx.uint64}


def _random(rng: np.random.Generator, dtype, shape: tuple[int, int]) -> tuple[mx.array, np.ndarray]:
    """An array of ``dtype`` with random bits (bool: 0 or 1) and those bits in NumPy."""
    kind = _BITS[dtype]
    top = 2 if dtype == mx.bool_ else np.iinfo(kind).max
    bits = rng.integers(0, top, shape, dtype=kind, endpoint=dtype != mx.bool_)
    return mx.array(bits).view(dtype), bits


def _bits_of(x: mx.array) -> np.ndarray:
    return np.array(x.view(_MX_BITS[_BITS[x.dtype]]))


# (rows, a's width, b's width): row byte counts that take the constant-size
# copies (4 .. 512 bytes) and others (widths not multiples of 4), zero rows,
# zero-width operands, and outputs of many 128 KiB tasks.
_SHAPES = [(1, 1, 1), (7, 3, 5), (300, 17, 13), (2000, 64, 32), (513, 4, 16), (0, 3, 5)]
_SHAPES += [(257, 0, 7), (257, 7, 0), (20000, 32, 96), (9000, 129, 2)]


@pytest.mark.parametrize("dtype", list(_BITS), ids=str)
@pytest.mark.parametrize("shape", _SHAPES, ids=str)
def test_concat_rows_is_numpy_concatenate_bit_for_bit(rng, dtype, shape):
    n, ca, cb = shape
    a, a_bits = _random(rng, dtype, (n, ca))
    b, b_bits = _random(rng, dtype, (n, cb))
    out = ext.concat_rows(a, b)
    assert out.dtype == dtype and out.shape == (n, ca + cb)
    np.testing.assert_array_equal(_bits_of(out), np.concatenate([a_bits, b_bits], axis=1))


def test_strided_inputs_and_thread_counts_give_the_same_bytes(rng):
    big, bits = _random(rng, mx.float32, (6000, 90))
    a, a_bits = big[::2, 5:40], bits[::2, 5:40]  # rows and columns strided
    row, row_bits = _random(rng, mx.float32, (1, 23))
    b, b_bits = mx.broadcast_to(row, (3000, 23)), np.broadcast_to(row_bits, (3000, 23))  # stride 0
    want = np.concatenate([a_bits, b_bits], axis=1)
    np.testing.assert_array_equal(_bits_of(ext.concat_rows(a, b)), want)
    t, t_bits = _random(rng, mx.int8, (41, 3000))  # a transposed (column-major) operand
    c, c_bits = _random(rng, mx.int8, (3000, 7))
    np.testing.assert_array_equal(
        _bits_of(ext.concat_rows(t.T, c)), np.concatenate([t_bits.T, c_bits], axis=1)
    )
    x, _ = _random(rng, mx.float16, (30000, 37))
    y, _ = _random(rng, mx.float16, (30000, 21))
    threads = mlx_lattice.get_num_threads()
    try:
        mlx_lattice.set_num_threads(1)
        one = _bits_of(ext.concat_rows(x, y))
        mlx_lattice.set_num_threads(max(2, threads))
        np.testing.assert_array_equal(_bits_of(ext.concat_rows(x, y)), one)
    finally:
        mlx_lattice.set_num_threads(threads)


def test_bad_arguments_name_them():
    a = mx.zeros((4, 3))
    with pytest.raises(mlx_lattice.MlxLatticeError, match=r"concat_rows: a must be 2-D.*\(4,\)"):
        ext.concat_rows(mx.zeros((4,)), a)
    with pytest.raises(mlx_lattice.MlxLatticeError, match=r"b must be 2-D.*\(4, 3, 1\)"):
        ext.concat_rows(a, mx.zeros((4, 3, 1)))
    with pytest.raises(mlx_lattice.MlxLatticeError, match="b must have a's dtype float32, got"):
        ext.concat_rows(a, mx.zeros((4, 2), dtype=mx.float16))
    with pytest.raises(mlx_lattice.MlxLatticeError, match="b must have a's 4 rows, got 5"):
        ext.concat_rows(a, mx.zeros((5, 2)))
    with pytest.raises(mlx_lattice.MlxLatticeError, match="b must have a's 0 rows, got 1"):
        ext.concat_rows(mx.zeros((0, 2)), mx.zeros((1, 2)))
    with pytest.raises(TypeError):
        ext.concat_rows(np.zeros((4, 3), np.float32), a)


def _mlx_cat(a: mx.array, b: mx.array) -> mx.array:
    return mx.concatenate([a, b], axis=1)


def test_gradients_match_mlx_concatenate(rng):
    a = mx.array(rng.standard_normal((50, 6)).astype(np.float32))
    b = mx.array(rng.standard_normal((50, 9)).astype(np.float32))
    w = mx.array(rng.standard_normal((50, 15)).astype(np.float32))
    for argnums in [(0,), (1,), (0, 1)]:

        def loss(fn, a, b):
            return (fn(a, b) * w).sum()

        got = mx.grad(lambda a, b: loss(ext.concat_rows, a, b), argnums=argnums)(a, b)
        want = mx.grad(lambda a, b: loss(_mlx_cat, a, b), argnums=argnums)(a, b)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, r in zip(got, want, strict=True):
            assert g.shape == r.shape
            assert mx.array_equal(g, r)
    ta = mx.array(rng.standard_normal((50, 6)).astype(np.float32))
    tb = mx.array(rng.standard_normal((50, 9)).astype(np.float32))
    (got,), (want,) = (mx.jvp(f, [a, b], [ta, tb])[1] for f in (ext.concat_rows, _mlx_cat))
    assert mx.array_equal(got, want)
    # A tangent for one operand only: the other contributes zeros.
    (got,) = mx.jvp(lambda x: ext.concat_rows(x, b), [a], [ta])[1]
    assert mx.array_equal(got, _mlx_cat(ta, mx.zeros_like(b)))


@pytest.mark.parametrize(
    ("in_axes", "shapes"),
    [
        ((0, 0), ((3, 40, 5), (3, 40, 2))),
        ((0, None), ((3, 40, 5), (40, 2))),
        ((None, 2), ((40, 5), (40, 2, 4))),
        ((1, 0), ((40, 3, 5), (3, 40, 2))),
    ],
)
def test_vmap_matches_mlx_concatenate(rng, in_axes, shapes):
    a, b = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in shapes)
    got = mx.vmap(ext.concat_rows, in_axes=in_axes)(a, b)
    want = mx.vmap(_mlx_cat, in_axes=in_axes)(a, b)
    assert got.shape == want.shape
    assert mx.array_equal(got, want)


def test_compile_and_shapeless_compile(rng):
    compiled = mx.compile(lambda a, b: ext.concat_rows(a, b) * 2)
    shapeless = mx.compile(lambda a, b: ext.concat_rows(a, b) * 2, shapeless=True)
    for n, ca, cb in [(30, 4, 3), (70, 4, 3), (11, 2, 9)]:
        a = mx.array(rng.standard_normal((n, ca)).astype(np.float32))
        b = mx.array(rng.standard_normal((n, cb)).astype(np.float32))
        want = _mlx_cat(a, b) * 2
        for fn in (compiled, shapeless):
            got = fn(a, b)
            assert got.shape == want.shape
            assert mx.array_equal(got, want)


def test_output_comes_from_the_active_arena(rng):
    a = mx.array(rng.standard_normal((500, 16)).astype(np.float32))
    b = mx.array(rng.standard_normal((500, 8)).astype(np.float32))
    mx.eval(a, b)
    arena = ext.ActivationArena(1 << 24)
    with arena:
        mx.eval(ext.concat_rows(a, b))  # 48 KB: one fresh buffer, then returned
    mx.synchronize()
    with arena:
        out = ext.concat_rows(a, b)
        mx.eval(out)
    stats = arena.stats()
    assert (stats["fresh"], stats["hits"]) == (1, 1)
    assert mx.array_equal(out, _mlx_cat(a, b))
    arena.close()


def _tensors(rng: np.random.Generator, dtypes) -> list[SparseTensor]:
    cells = np.unique(rng.integers(0, 12, (400, 3)), axis=0).astype(np.int32)
    coords = mx.array(np.concatenate([np.zeros((len(cells), 1), np.int32), cells], axis=1))
    out, x = [], None
    for dtype, width in dtypes:
        feats = mx.array(rng.standard_normal((len(cells), width)).astype(np.float32)).astype(dtype)
        x = SparseTensor(coords, feats) if x is None else x.replace(feats)
        out.append(x)
    return out


def test_ops_cat_gives_mlx_concatenate_bits(rng):
    for dtypes in (
        [(mx.float32, 5), (mx.float32, 3)],
        [(mx.bfloat16, 7), (mx.bfloat16, 1)],
        [(mx.int8, 6), (mx.int8, 10)],
        [(mx.float16, 4), (mx.float32, 3)],  # mixed: MLX promotes
        [(mx.float32, 2), (mx.float32, 3), (mx.float32, 4)],
    ):
        xs = _tensors(rng, dtypes)
        got = ops.cat(*xs).feats
        want = mx.concatenate([x.feats for x in xs], axis=1)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(_bits_of(got), _bits_of(want))


class _Spy:
    """``ext`` for ``ops.cat``: counts concat_rows calls and their dtypes,
    and runs either the native op or MLX's concatenate."""

    def __init__(self, native: bool) -> None:
        self.native, self.dtypes = native, []

    def concat_rows(self, a: mx.array, b: mx.array) -> mx.array:
        self.dtypes.append(a.dtype)
        return ext.concat_rows(a, b) if self.native else _mlx_cat(a, b)


@pytest.mark.parametrize("form", ["float", "w8a8-static"])
def test_eval_and_compiled_graphs_give_mlx_concatenate_bits(rng, monkeypatch, form):
    model = data.model("MinkUNet", form, rng, data.points(rng, 900, 4.0))
    x = data.model_input("MinkUNet", *data.points(rng, 1200, 5.0))
    net = mlx_lattice.compile(model)
    cats = sum(node["op"] == "cat" for node in net.graph["nodes"])
    outputs = {}
    for native in (True, False):
        spy = _Spy(native)
        monkeypatch.setattr(ops, "ext", spy)
        outputs[native] = (np.array(model(x).feats), np.array(net(x).feats))
        assert len(spy.dtypes) == 2 * cats  # every concatenation took ops.cat's native path
        if native and form == "w8a8-static":  # the compiled graph joins int8 codes
            assert mx.int8 in spy.dtypes[cats:]
    for got, want in zip(outputs[True], outputs[False], strict=True):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
