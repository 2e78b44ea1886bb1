"""The dequantized-weight cache of the weight-only quantized convolution:
a quantized weight's float32 values are cached on its second call and
reused by later calls (``mlx_lattice.weight_cache_info``; the first call
only notes the weight). Uncached and cached calls give the same bits, equal to the float convolution of a NumPy
dequantization; a new weight never gets an older weight's values, also
after the older one is freed and its memory reused; eviction, clearing,
thread counts, ``mx.compile`` and the feature gradient keep the results."""

from __future__ import annotations

import dataclasses
import gc

import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice.core import QuantizedWeight, build_kernel_relation, ops


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Every test starts from an empty cache with the default budget and
    leaves it that way."""
    budget = mlx_lattice.weight_cache_info()["budget"]
    mlx_lattice.clear_caches()
    yield
    mlx_lattice.set_weight_cache_budget(budget)
    mlx_lattice.clear_caches()


def make_relation(rng: np.random.Generator, n_points: int = 300):
    pts = rng.integers(0, 8, (n_points, 3))
    batch = rng.integers(0, 2, (n_points, 1))
    coords = np.unique(np.concatenate([batch, pts], 1), axis=0).astype(np.int32)
    return build_kernel_relation(coords, kernel_size=3), len(coords)


def make_weight(rng, cin: int, cout: int, bits: int, group: int, dtype=mx.float32):
    w = rng.standard_normal((27, cin, cout)).astype(np.float32) * 0.2
    return QuantizedWeight.from_float(mx.array(w).astype(dtype), bits=bits, group_size=group)


def dequantized_ref(qw: QuantizedWeight) -> np.ndarray:
    """(K, Cin, Cout) float32 values s * q + b from the packed words in
    NumPy (each product and sum rounded to float32, as documented)."""
    words = np.array(qw.weight).astype("<u4")
    k, cout, _ = words.shape
    bits = np.unpackbits(words.view(np.uint8).reshape(k, cout, -1), axis=2, bitorder="little")
    bits = bits.reshape(k, cout, qw.storage_in_channels, qw.bits).astype(np.int64)
    codes = (bits * (1 << np.arange(qw.bits))).sum(axis=3)[:, :, : qw.in_channels]
    g = np.arange(qw.in_channels) // qw.group_size
    scales = np.array(qw.scales.astype(mx.float32))[:, :, g]
    biases = np.array(qw.biases.astype(mx.float32))[:, :, g]
    values = (scales * codes.astype(np.float32)).astype(np.float32) + biases
    return np.ascontiguousarray(values.astype(np.float32).transpose(0, 2, 1))


def conv64_ref(feats: np.ndarray, weight: np.ndarray, rel) -> tuple[np.ndarray, np.ndarray]:
    """The convolution in float64 from the relation's edge list, and the
    sum of |products| per output (for the float32 rounding bound)."""
    in_rows = np.array(rel.edges.in_rows)
    out_rows = np.array(rel.edges.out_rows)
    kernel_ids = np.array(rel.edges.kernel_ids)
    out = np.zeros((rel.n_out_capacity, weight.shape[2]))
    mag = np.zeros_like(out)
    f64, w64 = feats.astype(np.float64), weight.astype(np.float64)
    for k in range(weight.shape[0]):
        sel = kernel_ids == k
        np.add.at(out, out_rows[sel], f64[in_rows[sel]] @ w64[k])
        np.add.at(mag, out_rows[sel], np.abs(f64[in_rows[sel]]) @ np.abs(w64[k]))
    return out, mag


def check_against_refs(got: mx.array, feats: np.ndarray, qw: QuantizedWeight, rel, msg: str):
    """Bit for bit the float convolution with the NumPy-dequantized weight,
    and within float32 accumulation error of the float64 convolution."""
    dense = dequantized_ref(qw)
    want = ops.sparse_conv_features_from_relation(mx.array(feats), mx.array(dense), rel)
    got_np = np.array(got.astype(mx.float32))
    np.testing.assert_array_equal(got_np, np.array(want), err_msg=msg)
    ref, mag = conv64_ref(feats, dense, rel)
    # Each output sums at most K * Cin float32 products: |error| <= n * eps * sum|products|
    # (to first order; 2n for the rounding of the products themselves).
    n = 2 * dense.shape[0] * dense.shape[1]
    bound = n * np.finfo(np.float32).eps * mag
    assert np.all(np.abs(got_np - ref) <= bound), msg


SHAPES = [
    # (cin, cout, bits, group): C from 1 to 130, padded input groups.
    (1, 1, 8, 32),
    (1, 130, 4, 32),
    (7, 3, 4, 64),
    (64, 64, 8, 64),
    (64, 64, 4, 32),
    (130, 17, 8, 128),
    (33, 130, 4, 128),
    (130, 130, 8, 32),
]


@pytest.mark.parametrize(("cin", "cout", "bits", "group"), SHAPES)
def test_uncached_and_cached_calls_match_the_float_conv_of_a_numpy_dequantization(
    rng, seed, cin, cout, bits, group
):
    rel, n = make_relation(rng)
    qw = make_weight(rng, cin, cout, bits, group)
    feats = rng.standard_normal((n, cin)).astype(np.float32)
    f = mx.array(feats)
    msg = f"seed {seed}, cin {cin}, cout {cout}, bits {bits}, group {group}"
    outs = []
    # (misses, hits, entries) after each call: noted, cached, reused.
    for want in [(1, 0, 0), (2, 0, 1), (2, 1, 1)]:
        outs.append(ops.sparse_quantized_conv_features_from_relation(f, qw, rel))
        mx.eval(outs[-1])
        info = mlx_lattice.weight_cache_info()
        assert (info["misses"], info["hits"], info["entries"]) == want, (msg, info)
    assert info["bytes"] >= 27 * cin * cout * 4 + qw.nbytes, (msg, info)
    for o in outs[1:]:
        np.testing.assert_array_equal(np.array(o), np.array(outs[0]), err_msg=msg)
    check_against_refs(outs[2], feats, qw, rel, msg)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_scales_hit_the_cache(rng, seed, dtype):
    """A weight quantized from a half-precision weight has half-precision
    scales; they are converted to float32 once per weight, so later calls
    hit the cache too, with the same bits."""
    rel, n = make_relation(rng)
    qw = make_weight(rng, 48, 40, 4, 32, dtype)
    assert qw.scales.dtype == dtype
    f = mx.array(rng.standard_normal((n, 48)).astype(np.float32)).astype(dtype)
    outs = []
    for _ in range(4):
        outs.append(ops.sparse_quantized_conv_features_from_relation(f, qw, rel))
        mx.eval(outs[-1])
    info = mlx_lattice.weight_cache_info()
    assert (info["misses"], info["hits"]) == (2, 2), (seed, info)
    for o in outs[1:]:
        np.testing.assert_array_equal(
            np.array(o.astype(mx.float32)), np.array(outs[0].astype(mx.float32)), err_msg=str(seed)
        )
    dense = mx.array(dequantized_ref(qw))
    want = ops.sparse_conv_features_from_relation(f.astype(mx.float32), dense, rel).astype(dtype)
    np.testing.assert_array_equal(
        np.array(outs[0].astype(mx.float32)), np.array(want.astype(mx.float32)), err_msg=str(seed)
    )


def test_a_weight_copied_anew_on_every_call_never_fills_the_cache(rng, seed):
    """Fresh arrays with the same values on every call, each freed after
    its call (as a conversion in the caller would make them): the allocator
    may hand the freed buffers' addresses to the next copy, but a noted key
    whose buffers died is stale, so no call is ever cached."""
    rel, n = make_relation(rng)
    qw = make_weight(rng, 16, 8, 8, 32)
    codes, scales, biases = (np.array(a) for a in (qw.weight, qw.scales, qw.biases))
    f = mx.array(rng.standard_normal((n, 16)).astype(np.float32))
    feats = np.array(f)
    for i in range(6):
        copy = dataclasses.replace(
            qw, weight=mx.array(codes), scales=mx.array(scales), biases=mx.array(biases)
        )
        got = ops.sparse_quantized_conv_features_from_relation(f, copy, rel)
        check_against_refs(got, feats, copy, rel, f"seed {seed}, call {i}")
        del copy, got
        gc.collect()
    info = mlx_lattice.weight_cache_info()
    assert (info["misses"], info["hits"], info["entries"]) == (6, 0, 0), (seed, info)


@pytest.mark.parametrize("one_entry_budget", [False, True])
def test_new_weights_of_the_same_shape_never_get_a_stale_entry(rng, seed, one_entry_budget):
    """New weights of one shape, each made after the previous one is deleted
    and collected (so the allocator may hand its memory, and its buffers'
    bookkeeping, to the next): every new weight misses once and gives its
    own convolution. With a budget of one entry the previous entry is
    evicted (its buffers released) on every insertion."""
    rel, n = make_relation(rng)
    cin, cout = 32, 24
    if one_entry_budget:
        # The largest entry (an 8-bit weight) fits, two of the smallest do not.
        largest = make_weight(rng, cin, cout, 8, 32).nbytes
        mlx_lattice.set_weight_cache_budget(27 * cin * cout * 4 + largest)
    f = mx.array(rng.standard_normal((n, cin)).astype(np.float32))
    feats = np.array(f)
    for i in range(8):
        qw = make_weight(rng, cin, cout, 8 if i % 2 else 4, 32)
        mx.eval(qw.weight, qw.scales, qw.biases)
        msg = f"seed {seed}, weight {i}, one-entry budget {one_entry_budget}"
        for _ in range(3):
            got = ops.sparse_quantized_conv_features_from_relation(f, qw, rel)
            check_against_refs(got, feats, qw, rel, msg)
        info = mlx_lattice.weight_cache_info()
        assert (info["misses"], info["hits"]) == (2 * (i + 1), i + 1), (msg, info)
        if one_entry_budget:
            assert info["entries"] == 1 and info["evictions"] == i, (msg, info)
        del qw, got
        gc.collect()


def test_eviction_under_a_small_budget_and_no_caching_at_zero(rng, seed):
    rel, n = make_relation(rng)
    a = make_weight(rng, 40, 40, 8, 32)
    b = make_weight(rng, 40, 40, 4, 32)
    f = mx.array(rng.standard_normal((n, 40)).astype(np.float32))
    feats = np.array(f)
    one = 27 * 40 * 40 * 4 + max(a.nbytes, b.nbytes)
    mlx_lattice.set_weight_cache_budget(one)
    # Noted, noted, cached, cached (a evicted), reused.
    for i, qw in enumerate([a, b, a, b, b]):
        check_against_refs(
            ops.sparse_quantized_conv_features_from_relation(f, qw, rel), feats, qw, rel,
            f"seed {seed}, call {i}",
        )
    info = mlx_lattice.weight_cache_info()
    assert (info["misses"], info["hits"], info["evictions"]) == (4, 1, 1), (seed, info)
    assert info["entries"] == 1 and info["bytes"] <= one, (seed, info)
    mlx_lattice.set_weight_cache_budget(0)
    info = mlx_lattice.weight_cache_info()
    assert (info["entries"], info["bytes"], info["evictions"]) == (0, 0, 2), (seed, info)
    for i in range(2):
        check_against_refs(
            ops.sparse_quantized_conv_features_from_relation(f, a, rel), feats, a, rel,
            f"seed {seed}, budget 0, call {i}",
        )
    info = mlx_lattice.weight_cache_info()
    assert (info["misses"], info["entries"]) == (6, 0), (seed, info)


def test_clear_caches_drops_entries_and_results_stay(rng, seed):
    rel, n = make_relation(rng)
    qw = make_weight(rng, 16, 20, 4, 32)
    f = mx.array(rng.standard_normal((n, 16)).astype(np.float32))
    before = np.array(ops.sparse_quantized_conv_features_from_relation(f, qw, rel))
    mx.eval(ops.sparse_quantized_conv_features_from_relation(f, qw, rel))
    assert mlx_lattice.weight_cache_info()["entries"] == 1
    mlx_lattice.clear_caches()
    info = mlx_lattice.weight_cache_info()
    assert (info["entries"], info["bytes"]) == (0, 0), (seed, info)
    after = ops.sparse_quantized_conv_features_from_relation(f, qw, rel)
    np.testing.assert_array_equal(np.array(after), before, err_msg=str(seed))
    check_against_refs(after, np.array(f), qw, rel, f"seed {seed}")
    assert mlx_lattice.weight_cache_info()["misses"] == 1


def test_bad_budgets_raise():
    with pytest.raises(ValueError, match="nbytes"):
        mlx_lattice.set_weight_cache_budget(-1)
    with pytest.raises(TypeError, match="nbytes"):
        mlx_lattice.set_weight_cache_budget(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_thread_counts_give_the_same_bits_first_and_cached(rng, seed, dtype):
    rel, n = make_relation(rng, 600)
    qw = make_weight(rng, 64, 96, 4, 64, dtype)
    f = mx.array(rng.standard_normal((n, 64)).astype(np.float32)).astype(dtype)
    before = mlx_lattice.get_num_threads()
    results = {}
    try:
        for threads in (1, 2, 3):
            mlx_lattice.set_num_threads(threads)
            mlx_lattice.clear_caches()
            first = ops.sparse_quantized_conv_features_from_relation(f, qw, rel)
            mx.eval(first)
            mx.eval(ops.sparse_quantized_conv_features_from_relation(f, qw, rel))
            cached = ops.sparse_quantized_conv_features_from_relation(f, qw, rel)
            mx.eval(cached)
            assert mlx_lattice.weight_cache_info()["hits"] == 1, (seed, threads)
            results[threads] = (np.array(first.astype(mx.float32)), np.array(cached.astype(mx.float32)))
    finally:
        mlx_lattice.set_num_threads(before)
    for threads, (first, cached) in results.items():
        np.testing.assert_array_equal(first, results[1][0], err_msg=f"seed {seed}, {threads} threads")
        np.testing.assert_array_equal(cached, results[1][0], err_msg=f"seed {seed}, {threads} threads")


def test_compile_and_feature_gradient(rng, seed):
    """mx.compile gives the eager bits and uses the cache; the gradient with
    respect to the features is that of the float convolution with the
    dequantized weight (float64 reference, float32 accumulation bound)."""
    rel, n = make_relation(rng)
    cin, cout = 24, 40
    qw = make_weight(rng, cin, cout, 8, 32)
    feats = rng.standard_normal((n, cin)).astype(np.float32)
    f = mx.array(feats)
    probe_np = rng.standard_normal((rel.n_out_capacity, cout)).astype(np.float32)
    probe = mx.array(probe_np)

    def run(x):
        return ops.sparse_quantized_conv_features_from_relation(x, qw, rel)

    eager = np.array(run(f))
    compiled = mx.compile(run)
    for _ in range(2):
        np.testing.assert_array_equal(np.array(compiled(f)), eager, err_msg=str(seed))
    info = mlx_lattice.weight_cache_info()
    assert (info["misses"], info["hits"]) == (2, 1), (seed, info)

    grad = np.array(mx.grad(lambda x: (run(x) * probe).sum())(f))
    dense = dequantized_ref(qw).astype(np.float64)
    in_rows = np.array(rel.edges.in_rows)
    out_rows = np.array(rel.edges.out_rows)
    kernel_ids = np.array(rel.edges.kernel_ids)
    want = np.zeros((n, cin))
    mag = np.zeros((n, cin))
    for k in range(27):
        sel = kernel_ids == k
        g = probe_np[out_rows[sel]].astype(np.float64)
        np.add.at(want, in_rows[sel], g @ dense[k].T)
        np.add.at(mag, in_rows[sel], np.abs(g) @ np.abs(dense[k]).T)
    bound = 2 * 27 * cout * np.finfo(np.float32).eps * mag
    assert np.all(np.abs(grad - want) <= bound), seed
