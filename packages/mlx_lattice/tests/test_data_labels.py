"""The labelled built-in scans against independent references: scene
geometry for the labels, brute-force voxel grouping for the batches and
per-class counting for the scores."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from mlx_lattice import SparseTensorError
from mlx_lattice.data import (
    CLASS_NAMES,
    HEIGHT_SCALE,
    SceneConfig,
    confusion_matrix,
    iou_per_class,
    labelled_scans,
    make_batch,
    mean_iou,
    synthetic_lidar_scan,
    voxel_labels,
)

SMALL = SceneConfig(beams=16, azimuth_steps=512)


def test_every_class_is_drawn_and_labels_follow_the_geometry():
    scan = synthetic_lidar_scan(0)
    counts = np.bincount(scan.labels, minlength=len(CLASS_NAMES))
    assert len(counts) == len(CLASS_NAMES) == 5
    assert np.all(counts > 500), counts
    z = scan.points[:, 2]
    # Ground is the plane z = 0 (range noise 1 cm along the ray).
    assert np.abs(z[scan.labels == 0]).max() < 0.1
    # Cars sit on 0.2 m and are at most 1.7 m tall.
    car = z[scan.labels == 2]
    assert car.min() > 0.1 and car.max() < 2.0
    # Objects stand on the ground: nothing but ground below -0.1 m.
    assert np.all(z[scan.labels != 0] > -0.1)
    # Vegetation: trees up to crown 5.5 + 2.2 m, at 6.5..9 m from the street axis (+ radius).
    veg = scan.points[scan.labels == 4]
    assert veg[:, 2].max() < 7.8
    assert np.abs(veg[:, 1]).min() > 6.5 - 2.3 and np.abs(veg[:, 1]).max() < 9.0 + 1.2
    # Points are within the sensor's range of it.
    dist = np.linalg.norm(scan.points - np.array([0, 0, SceneConfig().sensor_height]), axis=1)
    assert dist.max() <= SceneConfig().max_range + 0.1


def test_scans_are_seeded_and_the_split_is_disjoint():
    data = labelled_scans(3, 2, seed=7, config=SMALL)
    assert data.train_seeds == (7, 8, 9) and data.validation_seeds == (10, 11)
    assert not set(data.train_seeds) & set(data.validation_seeds)
    again = synthetic_lidar_scan(10, SMALL)
    np.testing.assert_array_equal(data.validation[0].points, again.points)
    np.testing.assert_array_equal(data.validation[0].labels, again.labels)
    other = synthetic_lidar_scan(11, SMALL)
    assert len(other.points) != len(again.points) or not np.array_equal(other.points, again.points)


@pytest.mark.parametrize(("n_train", "n_validation"), [(-1, 1), (0, 0), (1.5, 1), (True, 1)])
def test_bad_split_sizes_raise(n_train, n_validation):
    with pytest.raises(SparseTensorError, match=r"n_train|n_validation"):
        labelled_scans(n_train, n_validation, config=SMALL)


def test_voxel_labels_are_the_majority_by_brute_force():
    rng = np.random.default_rng(3)
    p2v = rng.integers(0, 50, 2000)
    labels = rng.integers(0, 5, 2000)
    got = voxel_labels(p2v, labels, 50)
    for v in range(50):
        votes = Counter(labels[p2v == v].tolist())
        if not votes:
            assert got[v] == 0
            continue
        best = max(votes.values())
        assert got[v] == min(k for k, c in votes.items() if c == best)


def test_voxel_labels_reject_bad_rows():
    with pytest.raises(SparseTensorError, match="point_to_voxel"):
        voxel_labels(np.array([0, 5]), np.array([1, 1]), 5)
    with pytest.raises(SparseTensorError, match="labels"):
        voxel_labels(np.array([0, 1]), np.array([1, -1]), 5)
    with pytest.raises(SparseTensorError, match="point_to_voxel and labels"):
        voxel_labels(np.array([0, 1]), np.array([1]), 5)


def test_batch_groups_points_into_their_voxels():
    data = labelled_scans(2, 0, seed=1, config=SMALL)
    vox = 0.3
    batch = make_batch(data.train, vox)
    coords = np.array(batch.tensor.coords)
    feats = np.array(batch.tensor.feats)
    points = np.concatenate([s.points for s in data.train]).astype(np.float64)
    item = np.concatenate([np.full(len(s.points), i) for i, s in enumerate(data.train)])
    p2v = batch.point_to_voxel
    # Every point lies in the voxel it maps to, in its own batch item.
    np.testing.assert_array_equal(coords[p2v, 1:], np.floor(points / vox).astype(np.int64))
    np.testing.assert_array_equal(coords[p2v, 0], item)
    assert len(np.unique(coords, axis=0)) == len(coords)
    # Features: occupancy 1 and the mean height of the voxel's points.
    rng = np.random.default_rng(0)
    for v in rng.choice(len(coords), 50, replace=False):
        members = points[p2v == v]
        assert len(members) > 0
        np.testing.assert_allclose(feats[v], [1.0, members[:, 2].mean() / HEIGHT_SCALE], rtol=1e-5)
    np.testing.assert_array_equal(
        np.array(batch.labels), voxel_labels(p2v, batch.point_labels, len(coords))
    )
    np.testing.assert_array_equal(
        batch.point_labels, np.concatenate([s.labels for s in data.train])
    )


def test_batch_rejects_bad_inputs():
    scan = synthetic_lidar_scan(0, SMALL)
    with pytest.raises(SparseTensorError, match="voxel_size"):
        make_batch([scan], 0.0)
    with pytest.raises(SparseTensorError, match="scans"):
        make_batch([], 0.1)


def test_scores_against_per_class_counting():
    rng = np.random.default_rng(5)
    truth = rng.integers(0, 4, 500)
    pred = np.where(rng.random(500) < 0.7, truth, rng.integers(0, 4, 500))
    cm = confusion_matrix(pred, truth, 5)
    ious = iou_per_class(cm)
    for k in range(4):
        tp = np.sum((pred == k) & (truth == k))
        union = np.sum((pred == k) | (truth == k))
        assert ious[k] == pytest.approx(tp / union)
    assert np.isnan(ious[4])  # never present, never predicted
    assert mean_iou(cm) == pytest.approx(np.mean(ious[:4]))
    with pytest.raises(SparseTensorError, match="pred and truth"):
        confusion_matrix(np.array([5]), np.array([0]), 5)
