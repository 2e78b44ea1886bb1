"""The kNN search's paths against brute force, bit for bit.

The CPU search groups queries by grid cell, keeps each query's k best
candidates sorted while their k-th distance prunes cells, retries the queries
it cannot settle on coarser grids and ends with a ring search; queries far
outside the grid are scanned. Each case below drives some of these paths and
compares the neighbour rows and their order (squared distance in float64,
then support row) with a brute-force reference; the thread count never
changes a bit. Random inputs come from the repository's seeded generator
(``rng``: stable per test, printed on failure, replayed with
``TEST_SEED=<seed>``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import mlx_lattice
from mlx_lattice.data import synthetic_lidar_scan
from mlx_lattice.geometry import knn_relation

_spec = importlib.util.spec_from_file_location(
    "relation_refs", Path(__file__).with_name("relation_refs.py")
)
relation_refs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(relation_refs)


def brute_knn(q, qb, s, sb, k):
    """Every pair's squared distance ((dx^2 + dy^2) + dz^2 in float64), the k
    smallest by (distance, support row), per query."""
    out = []
    for i in range(len(q)):
        cand = np.flatnonzero(sb == qb[i])
        diff = s[cand] - q[i]
        d2 = diff[:, 0] * diff[:, 0] + diff[:, 1] * diff[:, 1] + diff[:, 2] * diff[:, 2]
        out.append(cand[np.lexsort((cand, d2))[:k]].tolist())
    return out


def check(q, s, k, qb=None, sb=None):
    qb = np.zeros(len(q), np.int64) if qb is None else qb
    sb = np.zeros(len(s), np.int64) if sb is None else sb
    rel = knn_relation(q, s, k, query_batch=qb, support_batch=sb)
    assert relation_refs.relation_lists(rel) == brute_knn(q, qb, s, sb, k)
    return rel


def scan_centres(voxel: float = 0.05) -> np.ndarray:
    """Voxel centres of the built-in scan (the benchmark's point set)."""
    pts = synthetic_lidar_scan(seed=0).points.astype(np.float64)
    cells = np.unique(np.floor(pts / voxel).astype(np.int64), axis=0)
    return (cells + 0.5) * voxel


@pytest.mark.parametrize("k", [1, 2, 15, 16, 17, 40])
def test_scan_centres_with_ties(rng, k):
    # A block of the scan's voxel centres: a lattice, so many neighbours tie
    # exactly and the row order decides.
    centres = scan_centres()
    lo = centres[rng.integers(len(centres))] - 1.0
    s = centres[np.all((centres >= lo) & (centres <= lo + 2.0), axis=1)]
    q = s[rng.choice(len(s), min(len(s), 150), replace=False)]
    check(q, s, k)


@pytest.mark.parametrize("k", [1, 8, 16, 33])
def test_dense_and_sparse_regions_need_coarser_levels(rng, k):
    # A dense cluster sizes the grid; queries among sparse points cannot be
    # settled by their cell's block and go through the coarser levels and the
    # ring search.
    dense = rng.uniform(0.0, 1.0, (2000, 3))
    sparse = rng.uniform(-60.0, 60.0, (60, 3))
    s = np.concatenate([dense, sparse])
    q = np.concatenate([dense[rng.choice(2000, 60, replace=False)], sparse[:30], sparse[30:] + 0.5])
    q = np.concatenate([q, rng.uniform(-80.0, 80.0, (30, 3))])
    check(q, s, k)


@pytest.mark.parametrize("k", [1, 16, 40])
def test_batches_smaller_than_k_and_empty(rng, k):
    # Batch 0 holds fewer than k support points (all returned), batch 2 has
    # no support (no neighbours), batch 1 many; batches never mix.
    s = np.concatenate([rng.uniform(0, 1, (7, 3)), rng.uniform(0, 1, (500, 3))])
    sb = np.concatenate([np.zeros(7, np.int64), np.ones(500, np.int64)])
    q = rng.uniform(-0.5, 1.5, (90, 3))
    qb = rng.integers(0, 3, len(q))
    rel = check(q, s, k, qb, sb)
    counts = np.bincount(np.array(rel.edges.out_rows), minlength=len(q))
    np.testing.assert_array_equal(counts, np.select([qb == 0, qb == 1], [min(k, 7), k], 0))


def test_duplicate_points_order_by_row(rng):
    # Every support point repeated: equal distances, so rows decide; the
    # query points sit exactly on support points.
    base = rng.uniform(0, 4, (120, 3)).round(1)
    s = np.concatenate([base, base[::-1], base])
    q = base[rng.choice(len(base), 40, replace=False)]
    check(q, s, 16)


def test_thread_count_never_changes_a_bit(rng):
    centres = scan_centres()
    s = centres[rng.choice(len(centres), 20000, replace=False)]
    q = np.concatenate([s[:3000], rng.uniform(s.min(0), s.max(0), (1000, 3))])
    before = mlx_lattice.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3):
            mlx_lattice.set_num_threads(threads)
            rel = knn_relation(q, s, 16)
            runs.append(
                (np.array(rel.edges.in_rows), np.array(rel.edges.out_rows), np.array(rel.counts))
            )
    finally:
        mlx_lattice.set_num_threads(before)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            np.testing.assert_array_equal(a, b)
    # and the single-thread answer is the brute-force one on a sample
    sample = rng.choice(len(q), 60, replace=False)
    got = relation_refs.relation_lists(knn_relation(q[sample], s, 16))
    assert got == brute_knn(q[sample], np.zeros(60), s, np.zeros(len(s)), 16)
