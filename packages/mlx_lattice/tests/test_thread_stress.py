"""Several Python threads at once through the native layer, at 2-4 kernel
threads: relation building, convolutions and their gradients, pooling, the
weight-only quantized convolution (its dequantized-weight cache shared by
all threads), kNN search and voxelization. Every thread's results equal a
serial run's bit for bit.

The serial run is the reference for the concurrent one (each kernel is
checked against independent references elsewhere); this test's value is in
the concurrency, with a fourth thread resizing the kernel thread pool
meanwhile: it is one of the targets ``tools/sanitizers.sh`` runs under
ThreadSanitizer and AddressSanitizer, where a race or a use after free in
the shared caches or the thread pool is a report."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice.core import QuantizedWeight, build_kernel_relation, ops
from mlx_lattice.geometry import knn_relation, quantize_points, voxelize

PYTHON_THREADS = 3
ROUNDS = 2


def make_inputs(rng: np.random.Generator, ref) -> dict:
    coords = ref.random_coords(rng, 800, 10, batches=2)
    n = len(coords)
    weight = rng.standard_normal((27, 32, 10)).astype(np.float32) * 0.2
    return {
        "coords": coords,
        "feats": rng.standard_normal((n, 32)).astype(np.float32),
        "weight": weight,
        "probe": rng.standard_normal((n, 10)).astype(np.float32),
        "qweight": QuantizedWeight.from_float(mx.array(weight), bits=4, group_size=32),
        "points": rng.uniform(0, 4, (300, 3)),
        "point_feats": rng.standard_normal((300, 5)).astype(np.float32),
    }


def work(inputs: dict) -> list[np.ndarray]:
    """One task's results, each a NumPy array."""
    rel = build_kernel_relation(inputs["coords"], kernel_size=3)
    f, w = mx.array(inputs["feats"]), mx.array(inputs["weight"])
    probe = mx.array(inputs["probe"])

    def loss(a, b):
        return (ops.sparse_conv_features_from_relation(a, b, rel) * probe).sum()

    out = ops.sparse_conv_features_from_relation(f, w, rel)
    gf, gw = mx.grad(loss, argnums=(0, 1))(f, w)
    pooled = ops.sparse_pool_features_from_relation(f, rel, input_exclusive=False, mode="max")
    # Twice: the first call notes the weight, the second fills the shared
    # dequantized-weight cache (or hits another thread's entry).
    quantized = [
        ops.sparse_quantized_conv_features_from_relation(f, inputs["qweight"], rel)
        for _ in range(2)
    ]
    knn = knn_relation(inputs["points"], inputs["points"][::3], 4)
    vox = quantize_points(inputs["points"], 0.5)
    voxel_feats = voxelize(mx.array(inputs["point_feats"]), vox, "mean")
    arrays = [rel.edges.in_rows, rel.edges.out_rows, out, gf, gw, pooled, *quantized]
    arrays += [knn.edges.in_rows, knn.edges.out_rows, voxel_feats]
    return [np.array(a) for a in arrays]


@pytest.fixture
def restore_threads():
    previous = mlx_lattice.get_num_threads()
    yield
    mlx_lattice.set_num_threads(previous)


@pytest.mark.parametrize("kernel_threads", [2, 3, 4])
def test_concurrent_tasks_match_a_serial_run(rng, ref, restore_threads, kernel_threads):
    mlx_lattice.set_num_threads(kernel_threads)
    mlx_lattice.clear_caches()
    tasks = [make_inputs(rng, ref) for _ in range(PYTHON_THREADS)]
    serial = [work(t) for t in tasks]

    mlx_lattice.clear_caches()
    results: dict[tuple[int, int], list[np.ndarray]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(PYTHON_THREADS + 1)

    def run(index: int) -> None:
        try:
            start.wait()
            for round_ in range(ROUNDS):
                # Each thread walks the tasks in its own order: its own and
                # the others' relations, weights and cache entries at once.
                task = (index + round_) % PYTHON_THREADS
                results[index, task] = work(tasks[task])
        except BaseException as err:  # re-raised in the main thread below
            errors.append(err)

    def resize() -> None:
        # The pool resized while kernels run on it: bits never change.
        try:
            start.wait()
            for n in [2, 4, 3, 1, kernel_threads] * 4:
                mlx_lattice.set_num_threads(n)
                time.sleep(0.002)
        except BaseException as err:  # re-raised in the main thread below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(PYTHON_THREADS)]
    threads.append(threading.Thread(target=resize))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert len(results) == PYTHON_THREADS * ROUNDS
    for (index, task), got in results.items():
        for i, (a, b) in enumerate(zip(got, serial[task], strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"thread {index}, task {task}, array {i}")
