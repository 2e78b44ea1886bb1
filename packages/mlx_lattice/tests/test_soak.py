"""Long runs and the caches: resident memory stays flat over 10,000 mixed
calls; the validation memo, the dequantized-weight cache and the per-value
weight conversions never keep a dead array alive beyond their stated bounds,
never hand back a stale result (in-place updates, freed-and-reused
addresses), and stay within their budgets; retain_freed_memory keeps the
process near its peak over steps of changing shapes.

Memory is measured in child processes (other tests' arrays, MLX's buffer
cache and the allocator's state would otherwise blur it), as resident set
size from /proc/self/statm, or in process with ``mx.get_active_memory()``
(the bytes of MLX buffers alive right now, whatever the allocator keeps)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import platform
import subprocess
import sys
import weakref
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice.core import QuantizedWeight, build_kernel_relation, ops
from mlx_lattice.core import weights as core_weights

WORKER = Path(__file__).with_name("soak_worker.py")
MiB = 1 << 20
_LINUX = platform.system() == "Linux"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return env


@pytest.fixture(autouse=True)
def _fresh_caches():
    budget = mlx_lattice.weight_cache_info()["budget"]
    mlx_lattice.clear_caches()
    yield
    mlx_lattice.set_weight_cache_budget(budget)
    mlx_lattice.clear_caches()


# ---------------------------------------------------------------------------
# Soak


WARMUP = 1_000
CALLS = 10_000
# Bound on RSS growth from the end of the warm-up to the end: 8 MiB over
# 10,000 calls. A leak of 1 KiB per call (a relation's index arrays, an edge
# list, a cache entry never dropped) would add ~10 MiB; the calls' own
# arrays are a few KiB and MLX's CPU buffer cache, which may keep freed
# buffers, is bounded by the largest step's buffers, reached in the warm-up
# (every input is seen within its first 720 calls). Measured here: growth
# 0-1 MiB (see docs/topics/soak_and_concurrency.rst).
GROWTH_BOUND = 8 * MiB


@pytest.mark.skipif(not _LINUX, reason="reads /proc/self/statm")
def test_ten_thousand_mixed_calls_keep_resident_memory_flat(seed):
    out = subprocess.run(
        [sys.executable, str(WORKER), str(seed), str(WARMUP), str(CALLS), "1000"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=170,
    )
    assert out.returncode == 0, f"seed {seed}\n{out.stdout}\n{out.stderr[-4000:]}"
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rss = result["rss"]
    assert len(rss) == 1 + CALLS // 1000
    growth = rss[-1] - rss[0]
    print(
        f"soak: RSS after {WARMUP} warm-up calls {rss[0] / MiB:.1f} MiB, after {CALLS} more "
        f"{rss[-1] / MiB:.1f} MiB, growth {growth / MiB:+.2f} MiB, max "
        f"{max(rss) / MiB:.1f} MiB; {result['checks']} results checked; cache {result['cache']}"
    )
    assert growth < GROWTH_BOUND, (seed, [r / MiB for r in rss])
    # No sample is far above the final one either (a leak freed at the end
    # would not show in the difference alone).
    assert max(rss) - rss[0] < GROWTH_BOUND, (seed, [r / MiB for r in rss])
    # Every call after the first of each (op, input) pair was compared bit for bit.
    assert result["checks"] >= CALLS
    cache = result["cache"]
    # 44 weights in rotation (40 on even calls, 4 on odd ones), each seen
    # again before 64 other weights are noted: all cached, then hits.
    assert cache["entries"] == 44, cache
    assert cache["hits"] > CALLS // 50, cache
    assert cache["bytes"] <= cache["budget"]


# ---------------------------------------------------------------------------
# The validation memo


def _relation(rng, n=400, extent=12):
    coords = np.unique(
        np.concatenate([rng.integers(0, 2, (n, 1)), rng.integers(0, extent, (n, 3))], 1), axis=0
    ).astype(np.int32)
    return build_kernel_relation(mx.array(coords)), len(coords)


def _unbuilt(rel):
    """The relation with its edge arrays copied: no longer the builder's own
    arrays, so every call validates it through the memo (a built relation
    skips validation while its arrays are the ones it was built with)."""
    copies = {k: mx.array(np.array(getattr(rel.edges, k))) for k in ("in_rows", "out_rows", "kernel_ids")}
    return dataclasses.replace(rel, edges=dataclasses.replace(rel.edges, **copies))


# Float32 against the float64 reference: each output sums at most 27 * 3
# products of unit-normal values (|sum| up to ~30), so float32 accumulation
# errs by ~1e-6; a stale or foreign weight or relation is off by O(1).
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _conv64(feats: np.ndarray, weight: np.ndarray, rel) -> np.ndarray:
    """The convolution in float64 from the relation's edge list."""
    in_rows = np.array(rel.edges.in_rows)
    out_rows = np.array(rel.edges.out_rows)
    kernel_ids = np.array(rel.edges.kernel_ids)
    out = np.zeros((rel.n_out_capacity, weight.shape[2]))
    for k in range(weight.shape[0]):
        sel = kernel_ids == k
        np.add.at(out, out_rows[sel], feats[in_rows[sel]].astype(np.float64) @ weight[k])
    return out


def test_validation_memo_releases_dead_relations_within_its_bound(rng, seed):
    """The memo pins the index arrays of the last 32 validated relations (so
    their identities cannot be reused while remembered): a dropped relation's
    buffers are freed after 32 other validations, or at clear_caches."""
    small = [(_unbuilt(r), n) for r, n in (_relation(rng, 30, 4) for _ in range(40))]
    f_small = [mx.ones((n, 2)) for _, n in small]
    w_small = mx.ones((27, 2, 2))
    gc.collect()
    mx.eval(f_small)
    base = mx.get_active_memory()
    big, n = _relation(rng, 60_000, 64)
    big = _unbuilt(big)
    gc.collect()
    edge_bytes = sum(a.nbytes for a in (big.edges.in_rows, big.edges.out_rows, big.edges.kernel_ids))
    assert edge_bytes > 1 * MiB
    mx.eval(ops.sparse_conv_features_from_relation(mx.ones((n, 2)), w_small, big))
    del big
    gc.collect()
    pinned = mx.get_active_memory() - base
    # Still remembered: at least the edge arrays are alive.
    assert pinned >= edge_bytes, (seed, pinned, edge_bytes)
    for (rel, _), f in zip(small[:40], f_small, strict=True):
        mx.eval(ops.sparse_conv_features_from_relation(f, w_small, rel))
    gc.collect()
    assert mx.get_active_memory() - base < edge_bytes // 4, (seed, mx.get_active_memory() - base)
    # And clear_caches frees at once.
    big, n = _relation(rng, 60_000, 64)
    big = _unbuilt(big)
    gc.collect()
    mx.eval(ops.sparse_conv_features_from_relation(mx.ones((n, 2)), w_small, big))
    del big
    gc.collect()
    assert mx.get_active_memory() - base >= edge_bytes
    mlx_lattice.clear_caches()
    gc.collect()
    assert mx.get_active_memory() - base < edge_bytes // 4, seed


def test_validation_memo_sees_in_place_updates(rng, seed):
    rel, n = _relation(rng)
    f = mx.array(rng.standard_normal((n, 3)).astype(np.float32))
    w = mx.array(rng.standard_normal((27, 3, 2)).astype(np.float32))
    mx.eval(ops.sparse_conv_features_from_relation(f, w, rel))  # validated and remembered
    rel.edges.in_rows[0] = n + 1000  # in place: out of range now
    with pytest.raises(ValueError, match=r"in_rows\[0\] = .* is out of range"):
        mx.eval(ops.sparse_conv_features_from_relation(f, w, rel))


def test_freed_and_reused_relations_never_get_a_stale_validation(rng, seed):
    """A valid relation is validated and dropped (and, every other trial,
    pushed out of the memo by 32 other validations, so its buffers and
    descriptors are freed); the same relation rebuilt right after (the
    allocator is likely to hand it the freed memory) with one index out of
    range must raise, and rebuilt intact must give the float64 reference's
    result."""
    f_np = rng.standard_normal((2000, 3)).astype(np.float32)
    w_np = rng.standard_normal((27, 3, 2)).astype(np.float32)
    f, w = mx.array(f_np), mx.array(w_np)
    fillers = [(_unbuilt(r), m) for r, m in (_relation(rng, 20, 3) for _ in range(32))]
    for trial in range(8):
        coords = np.unique(
            np.concatenate([rng.integers(0, 2, (400, 1)), rng.integers(0, 12, (400, 3))], 1),
            axis=0,
        ).astype(np.int32)
        n = len(coords)
        rel = build_kernel_relation(mx.array(coords))
        mx.eval(ops.sparse_conv_features_from_relation(f[:n], w, rel))
        bad_rows = np.array(rel.edges.in_rows)
        bad_rows[len(bad_rows) // 2] = n
        del rel
        if trial % 2:
            for r, m in fillers:
                mx.eval(ops.sparse_conv_features_from_relation(f[:m], w, r))
        gc.collect()
        rebuilt = build_kernel_relation(mx.array(coords))
        bad = dataclasses.replace(
            rebuilt, edges=dataclasses.replace(rebuilt.edges, in_rows=mx.array(bad_rows))
        )
        del rebuilt
        with pytest.raises(ValueError, match=r"in_rows.* is out of range"):
            mx.eval(ops.sparse_conv_features_from_relation(f[:n], w, bad))
        del bad
        gc.collect()
        good = build_kernel_relation(mx.array(coords))
        got = np.array(ops.sparse_conv_features_from_relation(f[:n], w, good))
        want = _conv64(f_np[:n], w_np.astype(np.float64), good)
        np.testing.assert_allclose(got, want, **TOL, err_msg=f"seed {seed}")


# ---------------------------------------------------------------------------
# The per-value weight conversions (Python) and the dequantized-weight cache


def test_per_value_conversion_drops_dead_weights_and_sees_updates(rng, seed):
    rel, n = _relation(rng)
    f_np = rng.standard_normal((n, 3)).astype(np.float32)
    f = mx.array(f_np)

    def conv(w5):
        return ops.sparse_conv_features_from_relation(f, core_weights.mapped_conv_weight(w5), rel)

    before = len(core_weights._MAPPED_WEIGHT_CACHE)
    w5_np = rng.standard_normal((2, 3, 3, 3, 3)).astype(np.float32)
    w5 = mx.array(w5_np)
    ref = weakref.ref(w5)
    mapped = np.ascontiguousarray(w5_np.transpose(1, 2, 3, 4, 0).reshape(27, 3, 2))
    np.testing.assert_array_equal(
        np.array(conv(w5)), np.array(ops.sparse_conv_features_from_relation(f, mx.array(mapped), rel))
    )
    assert len(core_weights._MAPPED_WEIGHT_CACHE) == before + 1
    # In place: the cached layout must not be reused.
    w5[0] = w5[0] * 2
    w5_np[0] *= 2
    mapped = np.ascontiguousarray(w5_np.transpose(1, 2, 3, 4, 0).reshape(27, 3, 2))
    np.testing.assert_array_equal(
        np.array(conv(w5)), np.array(ops.sparse_conv_features_from_relation(f, mx.array(mapped), rel))
    )
    # Dropped: the entry (and the value it held) goes with the weight.
    del w5
    gc.collect()
    assert ref() is None
    assert len(core_weights._MAPPED_WEIGHT_CACHE) == before
    # A new weight of the same shape (likely at the freed id) gets its own values.
    for _ in range(8):
        w_np = rng.standard_normal((2, 3, 3, 3, 3)).astype(np.float32)
        w = mx.array(w_np)
        mapped = np.ascontiguousarray(w_np.transpose(1, 2, 3, 4, 0).reshape(27, 3, 2))
        got = np.array(conv(w))
        want = _conv64(f_np, mapped.astype(np.float64), rel)
        np.testing.assert_allclose(got, want, **TOL, err_msg=f"seed {seed}")
        del w
        gc.collect()
    assert len(core_weights._MAPPED_WEIGHT_CACHE) == before


def test_weight_gradient_flows_through_the_cached_conversion(rng, seed):
    """The conversion is evaluated before it is cached (so other threads can
    use it), but not inside a transformation: the gradient with respect to a
    5-D weight equals the one through an uncached transpose, before and
    after the weight's value has been cached outside the transformation."""
    rel, n = _relation(rng)
    f = mx.array(rng.standard_normal((n, 4)).astype(np.float32))
    w5 = mx.array(rng.standard_normal((3, 3, 3, 3, 4)).astype(np.float32))
    cot = mx.array(rng.standard_normal((rel.n_out_capacity, 3)).astype(np.float32))

    def loss(w, mapping):
        return (ops.sparse_conv_features_from_relation(f, mapping(w), rel) * cot).sum()

    def by_hand(w):
        return mx.contiguous(w.transpose(1, 2, 3, 4, 0).reshape(27, 4, 3))

    want = np.array(mx.grad(lambda w: loss(w, by_hand))(w5))
    assert np.abs(want).max() > 0.1
    for _ in range(2):
        got = np.array(mx.grad(lambda w: loss(w, core_weights.mapped_conv_weight))(w5))
        np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")
        mx.eval(loss(w5, core_weights.mapped_conv_weight))  # cache w5's value outside
    compiled = mx.compile(mx.grad(lambda w: loss(w, core_weights.mapped_conv_weight)))
    np.testing.assert_array_equal(np.array(compiled(w5)), want, err_msg=f"seed {seed}")


def _quantized(rng, cin=64, cout=64):
    w = rng.standard_normal((27, cin, cout)).astype(np.float32) * 0.2
    return QuantizedWeight.from_float(mx.array(w), bits=4, group_size=32)


def test_weight_cache_frees_dead_weights_when_evicted_or_cleared(rng, seed):
    """An entry holds its weight's packed buffers (so their addresses cannot
    be reused for another weight while it lives); the buffers are freed when
    the entry is evicted by the budget or cleared, and ``bytes`` never
    exceeds ``budget``."""
    rel, n = _relation(rng, 200, 6)
    f = mx.array(rng.standard_normal((n, 64)).astype(np.float32))
    gc.collect()
    base = mx.get_active_memory()
    qw = _quantized(rng)
    packed = sum(a.nbytes for a in (qw.weight, qw.scales, qw.biases))
    for _ in range(2):  # noted, then cached
        mx.eval(ops.sparse_quantized_conv_features_from_relation(f, qw, rel))
    info = mlx_lattice.weight_cache_info()
    assert info["entries"] == 1 and info["bytes"] == 27 * 64 * 64 * 4 + packed, info
    del qw
    gc.collect()
    assert mx.get_active_memory() - base >= packed  # held by the entry
    # A budget of one entry: the next weights evict it.
    mlx_lattice.set_weight_cache_budget(info["bytes"])
    for _ in range(3):
        other = _quantized(rng)
        for _ in range(2):
            mx.eval(ops.sparse_quantized_conv_features_from_relation(f, other, rel))
        info = mlx_lattice.weight_cache_info()
        assert info["bytes"] <= info["budget"] and info["entries"] == 1, info
        del other
        gc.collect()
    assert mlx_lattice.weight_cache_info()["evictions"] == 3
    # Only the last weight's buffers are alive (held by its entry).
    assert mx.get_active_memory() - base < 2 * packed, seed
    mlx_lattice.clear_caches()
    gc.collect()
    assert mx.get_active_memory() - base < packed // 2, seed


# ---------------------------------------------------------------------------
# retain_freed_memory over changing shapes

_RETAIN_CHILD = r"""
import json, os, sys
import mlx.core as mx
import numpy as np
import mlx_lattice
from mlx_lattice.core import build_kernel_relation, ops

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

seed = int(sys.argv[1])
assert mlx_lattice.retain_freed_memory()
rng = np.random.default_rng(seed)
w = mx.array(rng.standard_normal((27, 32, 32)).astype(np.float32))
start = rss()
peaks = []
after = []
for step in range(60):
    # 2k to 40k rows: the arrays of a step vary from ~0.3 MiB to ~20 MiB.
    n = int(rng.integers(2_000, 40_000))
    coords = np.unique(np.concatenate([rng.integers(0, 2, (n, 1)), rng.integers(0, 48, (n, 3))], 1), axis=0).astype(np.int32)
    rel = build_kernel_relation(mx.array(coords))
    f = mx.array(rng.standard_normal((len(coords), 32)).astype(np.float32))
    g = mx.grad(lambda a, b: ops.sparse_conv_features_from_relation(a, b, rel).sum(), (0, 1))(f, w)
    mx.eval(g)
    peaks.append(mx.get_peak_memory())
    mx.reset_peak_memory()
    del rel, f, g
    after.append(rss())
print(json.dumps({"start": start, "rss": after, "peak": max(peaks)}))
"""


@pytest.mark.skipif(
    not (_LINUX and platform.libc_ver()[0] == "glibc"), reason="glibc's malloc only"
)
def test_retained_memory_stays_bounded_over_changing_shapes(seed):
    """With freed memory kept in the heap, steps of varying sizes reuse it:
    RSS stays within 3x the largest single step's MLX footprint (plus the
    process's baseline) and stops growing once the largest step has run.
    3x: glibc serves differently sized requests from one heap, so a step may
    not fit in the holes the previous one left (fragmentation), and MLX's
    buffer cache keeps some freed buffers of its own."""
    out = subprocess.run(
        [sys.executable, "-c", _RETAIN_CHILD, str(seed)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=170,
    )
    assert out.returncode == 0, f"seed {seed}\n{out.stderr[-4000:]}"
    r = json.loads(out.stdout.strip().splitlines()[-1])
    rss, peak, start = r["rss"], r["peak"], r["start"]
    print(
        f"retain: start {start / MiB:.0f} MiB, peak step {peak / MiB:.1f} MiB, "
        f"RSS max {max(rss) / MiB:.0f} MiB, last {rss[-1] / MiB:.0f} MiB"
    )
    assert max(rss) - start <= 3 * peak, (seed, peak / MiB, [x / MiB for x in rss])
    # The second half adds at most one peak step's worth over the first half's maximum.
    half = len(rss) // 2
    assert max(rss[half:]) <= max(rss[:half]) + peak, (seed, [x / MiB for x in rss])

