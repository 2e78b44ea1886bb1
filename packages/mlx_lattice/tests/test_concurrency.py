"""Calls from several Python threads at once give the same bits as serial
calls: convolutions (forward and vjp, float and quantized), geometry (kNN,
quantize_points, voxelize/devoxelize), relation building and the caches;
``set_num_threads`` and ``clear_caches`` while other threads compute are
safe and change no bit.

Every test joins its threads with a timeout (``JOIN_S``) and fails, instead
of hanging, when one has not finished; a thread's exception fails the test
with its traceback."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as mnn
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice import SparseTensor, geometry
from mlx_lattice import nn as lattice_nn
from mlx_lattice.core import QuantizedWeight, build_kernel_relation, ops
from mlx_lattice.core import weights as core_weights

THREADS = 4
ROUNDS = 12
# Generous for 2 busy cores: each test's serial work takes well under 1 s.
JOIN_S = 120.0


@pytest.fixture(autouse=True)
def _restore():
    threads = mlx_lattice.get_num_threads()
    budget = mlx_lattice.weight_cache_info()["budget"]
    mlx_lattice.clear_caches()
    yield
    mlx_lattice.set_num_threads(threads)
    mlx_lattice.set_weight_cache_budget(budget)
    mlx_lattice.clear_caches()


def _bits(out) -> list[tuple[str, tuple, bytes]]:
    arrays = out if isinstance(out, (list, tuple)) else [out]
    mx.eval(arrays)
    # NumPy has no bfloat16: compare its bits as uint16.
    raw = [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in arrays]
    return [(str(a.dtype), tuple(a.shape), np.array(r).tobytes()) for a, r in zip(arrays, raw, strict=True)]


def run_concurrently(
    jobs: list[tuple[str, Callable[[], object]]],
    *,
    meddlers: list[Callable[[], None]] = (),
    seed: int,
) -> int:
    """Runs every job serially for its reference bits, then THREADS threads
    that each run all jobs ROUNDS times (in a thread-specific order) and
    compare with the reference, while each meddler runs in a loop in its own
    thread until the workers finish. Returns the number of comparisons."""
    want = {name: _bits(job()) for name, job in jobs}
    errors: list[str] = []
    compared = [0]
    lock = threading.Lock()
    done = threading.Event()

    def worker(t: int) -> None:
        try:
            order = np.random.default_rng(seed + t).permutation(len(jobs) * ROUNDS) % len(jobs)
            for j in order:
                name, job = jobs[j]
                got = _bits(job())
                if got != want[name]:
                    with lock:
                        errors.append(f"thread {t}: {name} differs from the serial call")
                with lock:
                    compared[0] += 1
        except BaseException:
            with lock:
                errors.append(f"thread {t}:\n{traceback.format_exc()}")

    def meddle(fn: Callable[[], None]) -> None:
        try:
            while not done.is_set():
                fn()
        except BaseException:
            with lock:
                errors.append(f"meddler:\n{traceback.format_exc()}")

    workers = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(THREADS)]
    others = [threading.Thread(target=meddle, args=(m,), daemon=True) for m in meddlers]
    for th in others + workers:
        th.start()
    for th in workers:
        th.join(JOIN_S)
    done.set()
    for th in others:
        th.join(JOIN_S)
    stuck = [th.name for th in workers + others if th.is_alive()]
    assert not stuck, f"seed {seed}: threads still running after {JOIN_S} s: {stuck}"
    assert not errors, f"seed {seed}:\n" + "\n".join(errors)
    assert compared[0] == THREADS * ROUNDS * len(jobs)
    return compared[0]


def _coords(rng, n=600, extent=10):
    return np.unique(
        np.concatenate([rng.integers(0, 2, (n, 1)), rng.integers(0, extent, (n, 3))], 1), axis=0
    ).astype(np.int32)


@pytest.fixture
def conv_inputs(rng):
    coords = _coords(rng)
    rel = build_kernel_relation(mx.array(coords))
    n = len(coords)
    f = mx.array(rng.standard_normal((n, 16)).astype(np.float32))
    w = mx.array(rng.standard_normal((27, 16, 8)).astype(np.float32))
    qw = QuantizedWeight.from_float(
        mx.array(rng.standard_normal((27, 16, 8)).astype(np.float32)), bits=4, group_size=32
    )
    cot = mx.array(rng.standard_normal((rel.n_out_capacity, 8)).astype(np.float32))
    mx.eval(f, w, cot)
    return coords, rel, f, w, qw, cot


def _conv_jobs(conv_inputs):
    coords, rel, f, w, qw, cot = conv_inputs

    def vjp():
        _, grads = mx.vjp(
            lambda a, b: ops.sparse_conv_features_from_relation(a, b, rel), [f, w], [cot]
        )
        return grads

    return [
        ("forward", lambda: ops.sparse_conv_features_from_relation(f, w, rel)),
        ("vjp", vjp),
        ("half", lambda: ops.sparse_conv_features_from_relation(
            f.astype(mx.bfloat16), w.astype(mx.bfloat16), rel
        )),
        ("weight-only", lambda: ops.sparse_quantized_conv_features_from_relation(f, qw, rel)),
        ("int8", lambda: ops.sparse_quantized_conv_features_from_relation(f, qw, rel, act_bits=8)),
        ("relation", lambda: list(
            vars(build_kernel_relation(mx.array(coords)).edges).values()
        )),
    ]


def test_convolutions_from_threads_match_serial_bits(conv_inputs, seed):
    run_concurrently(_conv_jobs(conv_inputs), seed=seed)


def _geometry_jobs(rng):
    pts = rng.uniform(0, 5, (800, 3)).astype(np.float32)
    batch = rng.integers(0, 2, 800).astype(np.int32)
    pf = mx.array(rng.standard_normal((800, 4)).astype(np.float32))
    vox = geometry.quantize_points(pts, 0.4, batch=batch)
    pvm = geometry.point_voxel_map(pts, vox.coords, 0.4, batch=batch)
    vf = mx.array(rng.standard_normal((vox.coords.shape[0], 4)).astype(np.float32))
    cot = mx.array(rng.standard_normal((800, 4)).astype(np.float32))

    def knn():
        r = geometry.knn_relation(pts, pts, 6, query_batch=batch, support_batch=batch)
        return [r.edges.in_rows, r.edges.out_rows, r.edges.kernel_ids]

    def quantize():
        v = geometry.quantize_points(pts, 0.4, batch=batch)
        return [v.coords, v.point_to_voxel, v.counts, v.voxel_offsets, v.voxel_points]

    def devox_vjp():
        _, (g,) = mx.vjp(lambda a: geometry.devoxelize(a, pvm), [vf], [cot])
        return g

    jobs = [
        ("knn", knn),
        ("quantize_points", quantize),
        ("voxelize", lambda: [geometry.voxelize(pf, vox, r) for r in ("sum", "mean", "max")]),
        ("devoxelize", lambda: [geometry.devoxelize(vf, pvm, i) for i in ("linear", "nearest")]),
        ("devoxelize vjp", devox_vjp),
    ]
    return jobs


def test_geometry_from_threads_matches_serial_bits(rng, seed):
    run_concurrently(_geometry_jobs(rng), seed=seed)


def test_model_forward_from_threads_matches_serial_bits(rng, seed):
    """A small network (submanifold and strided convolutions, batch norm in
    eval mode, max pooling, a transposed convolution back) shared by the
    threads, each building its own SparseTensor from the same inputs."""
    mx.random.seed(seed)
    model = mnn.Sequential(
        lattice_nn.SubMConv3d(4, 8, 3),
        lattice_nn.BatchNorm(8),
        lattice_nn.ReLU(),
        lattice_nn.Conv3d(8, 16, 2, stride=2),
        lattice_nn.MaxPool3d(2, 2),
        lattice_nn.ConvTranspose3d(16, 8, 2, stride=2),
    )
    model.eval()
    mx.eval(model.parameters())
    coords = mx.array(_coords(rng, 700, 12))
    feats = mx.array(rng.standard_normal((coords.shape[0], 4)).astype(np.float32))

    def forward():
        y = model(SparseTensor(coords, feats))
        return [y.feats, y.coords]

    run_concurrently([("model", forward)], seed=seed)


def test_set_num_threads_and_clear_caches_during_calls(conv_inputs, rng, seed):
    """One thread cycles the kernel thread count through 1-3 and another
    clears every cache, over and over, while the workers run convolutions
    (the weight-only one through the dequantized-weight cache, a 5-D weight
    through the per-value layout conversion), build relations and run the
    geometry ops: no crash, the same bits as serial calls."""
    counts = iter(range(10**9))

    def cycle_threads():
        mlx_lattice.set_num_threads(1 + next(counts) % 3)

    def clear():
        mlx_lattice.clear_caches()
        # A short pause: the workers still hit the caches in between.
        threading.Event().wait(0.002)

    _, rel, f, _, _, _ = conv_inputs
    w5 = mx.array(rng.standard_normal((8, 3, 3, 3, 16)).astype(np.float32))
    mapped = [
        ("5-D weight", lambda: ops.sparse_conv_features_from_relation(
            f, core_weights.mapped_conv_weight(w5), rel
        ))
    ]
    jobs = _conv_jobs(conv_inputs) + _geometry_jobs(rng) + mapped
    run_concurrently(jobs, meddlers=[cycle_threads, clear], seed=seed)


def test_weight_cache_from_threads_stays_within_budget(rng, seed):
    """Threads share the dequantized-weight cache under a budget of two
    entries over six weights: results match serial bits and the charged
    bytes never exceed the budget."""
    coords = _coords(rng, 300, 8)
    rel = build_kernel_relation(mx.array(coords))
    f = mx.array(rng.standard_normal((len(coords), 32)).astype(np.float32))
    qws = [
        QuantizedWeight.from_float(
            mx.array(rng.standard_normal((27, 32, 16)).astype(np.float32)), bits=8, group_size=32
        )
        for _ in range(6)
    ]
    entry = 27 * 32 * 16 * 4 + sum(a.nbytes for a in (qws[0].weight, qws[0].scales, qws[0].biases))
    mlx_lattice.set_weight_cache_budget(2 * entry)
    over = []

    def watch():
        info = mlx_lattice.weight_cache_info()
        if info["bytes"] > info["budget"] or info["entries"] > 2:
            over.append(info)

    jobs = [
        (f"w{i}", lambda q=q: ops.sparse_quantized_conv_features_from_relation(f, q, rel))
        for i, q in enumerate(qws)
    ]
    run_concurrently(jobs, meddlers=[watch], seed=seed)
    assert not over, (seed, over[:3])
    info = mlx_lattice.weight_cache_info()
    assert info["hits"] + info["misses"] >= THREADS * ROUNDS * len(jobs), info
    assert info["evictions"] > 0, info


def test_cached_weight_layout_is_usable_from_another_thread(rng, seed):
    """Regression: the per-value layout conversion of a 5-D weight cached a
    lazy array; a thread that took it from the cache before the creating
    thread evaluated it failed with "There is no Stream(cpu, N) in current
    thread" (or, racing with that thread's evaluation, got wrong values).
    The conversion is now evaluated before it is cached."""
    coords = _coords(rng, 200, 6)
    rel = build_kernel_relation(mx.array(coords))
    f = mx.array(rng.standard_normal((len(coords), 5)).astype(np.float32))
    w5_np = rng.standard_normal((3, 3, 3, 3, 5)).astype(np.float32)
    w5 = mx.array(w5_np)
    mapped = np.ascontiguousarray(w5_np.transpose(1, 2, 3, 4, 0).reshape(27, 5, 3))
    want = np.array(ops.sparse_conv_features_from_relation(f, mx.array(mapped), rel))
    core_weights.mapped_conv_weight(w5)  # cached here, never evaluated by this thread
    result: dict[str, object] = {}

    def other() -> None:
        try:
            out = ops.sparse_conv_features_from_relation(f, core_weights.mapped_conv_weight(w5), rel)
            result["got"] = np.array(out)
        except BaseException as err:
            result["error"] = repr(err)

    th = threading.Thread(target=other, daemon=True)
    th.start()
    th.join(JOIN_S)
    assert not th.is_alive(), f"seed {seed}: thread still running after {JOIN_S} s"
    assert "error" not in result, (seed, result["error"])
    np.testing.assert_array_equal(result["got"], want, err_msg=f"seed {seed}")


def test_one_sparse_tensor_shared_by_threads(rng, seed):
    """Threads start together on one SparseTensor that nobody has used yet,
    so they race to fill its coordinate manager's caches (output
    coordinates, relations): every thread gets the serial result."""
    model = mnn.Sequential(
        lattice_nn.Conv3d(3, 8, 2, stride=2),
        lattice_nn.SubMConv3d(8, 8, 3),
        lattice_nn.ConvTranspose3d(8, 4, 2, stride=2),
    )
    mx.eval(model.parameters())
    errors: list[str] = []
    for trial in range(4):
        coords = _coords(rng, 500, 10)
        feats = mx.array(rng.standard_normal((len(coords), 3)).astype(np.float32))
        want = _bits(model(SparseTensor(mx.array(coords), feats)).feats)
        shared = SparseTensor(mx.array(coords), feats)
        barrier = threading.Barrier(THREADS)

        def worker(t: int, shared=shared, want=want, trial=trial, barrier=barrier) -> None:
            try:
                barrier.wait(JOIN_S)
                if _bits(model(shared).feats) != want:
                    errors.append(f"trial {trial}, thread {t}: differs from the serial call")
            except BaseException:
                errors.append(f"trial {trial}, thread {t}:\n{traceback.format_exc()}")

        threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(JOIN_S)
        assert not any(th.is_alive() for th in threads), f"seed {seed}: threads still running"
    assert not errors, f"seed {seed}:\n" + "\n".join(errors)
