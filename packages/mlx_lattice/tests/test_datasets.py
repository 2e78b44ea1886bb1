"""Datasets on disk: a generated SemanticKITTI tree (labels through the
published learning map, checked against the table written out here) and a
folder of labelled PLY/LAS files; both train a MinkUNet whose loss falls."""

from __future__ import annotations

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest

from mlx_lattice.data import SceneConfig, make_batch, synthetic_lidar_scan
from mlx_lattice.io import (
    PointCloudFormatError,
    folder_dataset,
    read_points,
    semantickitti,
    semantickitti_dataset,
)
from mlx_lattice.models import MinkUNet, class_weights, train_step

#: Published semantic-kitti.yaml: raw id -> (learning class 1..19, name);
#: the training class is learning class - 1, learning class 0 is ignored.
PUBLISHED = {
    10: 1, 11: 2, 13: 5, 15: 3, 16: 5, 18: 4, 20: 5, 30: 6, 31: 7, 32: 8, 40: 9, 44: 10,
    48: 11, 49: 12, 50: 13, 51: 14, 52: 0, 60: 9, 70: 15, 71: 16, 72: 17, 80: 18, 81: 19,
    99: 0, 252: 1, 253: 7, 254: 6, 255: 8, 256: 5, 257: 5, 258: 4, 259: 5, 0: 0, 1: 0,
}  # fmt: skip
PUBLISHED_NAMES = {1: "car", 2: "bicycle", 3: "motorcycle", 4: "truck", 5: "other-vehicle",
                   6: "person", 7: "bicyclist", 8: "motorcyclist", 9: "road", 10: "parking",
                   11: "sidewalk", 12: "other-ground", 13: "building", 14: "fence",
                   15: "vegetation", 16: "trunk", 17: "terrain", 18: "pole",
                   19: "traffic-sign"}  # fmt: skip

#: Synthetic classes (ground, building, car, pole, vegetation) -> raw ids to draw from.
RAW_FOR_CLASS = {0: (40, 60, 72), 1: (50,), 2: (10, 252), 3: (80,), 4: (70, 71)}
SMALL = SceneConfig(beams=16, azimuth_steps=256, buildings=6, cars=8, poles=8, trees=6, bushes=4)


def test_table_matches_published_map():
    assert semantickitti.LEARNING_MAP == PUBLISHED
    assert tuple(PUBLISHED_NAMES[k] for k in range(1, 20)) == semantickitti.CLASS_NAMES
    for raw, learning in PUBLISHED.items():
        assert semantickitti.RAW_LABEL_NAMES[raw]
        expect = learning - 1 if learning else 19
        assert semantickitti.training_labels(np.array([raw]))[0] == expect
    for learning, raw in semantickitti.LEARNING_MAP_INV.items():
        assert PUBLISHED[raw] == learning


def make_semantickitti(root, rng, sequences=("00", "08"), scans=2):
    """Scans of synthetic streets with raw SemanticKITTI ids (and 5% unlabeled/outlier)."""
    truth = {}
    for s, seq in enumerate(sequences):
        (root / "sequences" / seq / "velodyne").mkdir(parents=True)
        (root / "sequences" / seq / "labels").mkdir(parents=True)
        for i in range(scans):
            scan = synthetic_lidar_scan(10 * s + i, SMALL)
            raw = np.array([rng.choice(RAW_FOR_CLASS[int(c)]) for c in scan.labels], np.uint32)
            noise = rng.random(len(raw)) < 0.05
            raw[noise] = rng.choice([0, 1, 52, 99], noise.sum())
            inst = rng.integers(0, 50, len(raw)).astype(np.uint32)
            rec = np.concatenate([scan.points, rng.random((len(raw), 1), np.float32)], axis=1)
            rec.astype("<f4").tofile(root / "sequences" / seq / "velodyne" / f"{i:06d}.bin")
            ((inst << 16) | raw).astype("<u4").tofile(
                root / "sequences" / seq / "labels" / f"{i:06d}.label"
            )
            expect = np.array([PUBLISHED[int(r)] - 1 if PUBLISHED[int(r)] else 19 for r in raw])
            truth[(seq, i)] = (scan.points, expect)
    return truth


def train(model, batches, steps, ignore):
    opt = optim.Adam(learning_rate=1e-2)
    # Class weights over the real classes (0..ignore-1): the ignored label is dropped.
    weights = class_weights(np.concatenate([np.array(b.labels) for b in batches]), ignore)
    model.train()
    return [
        train_step(model, opt, b.tensor, b.labels, weights=weights, ignore_index=ignore)
        for b in (batches[k % len(batches)] for k in range(steps))
    ]


def test_semantickitti_tree_labels_and_training(tmp_path, rng):
    truth = make_semantickitti(tmp_path, rng)
    ds = semantickitti_dataset(tmp_path, ["00", "08"])
    assert len(ds) == 4 and ds.ignore_label == 19
    for k, path in enumerate(ds.files):
        points, expect = truth[(path.parent.parent.name, int(path.stem))]
        scan = ds.scan(k)
        np.testing.assert_array_equal(scan.points, points)
        np.testing.assert_array_equal(scan.labels, expect)
    assert len(semantickitti_dataset(tmp_path, "valid")) == 2
    assert len(semantickitti_dataset(tmp_path, "train")) == 2  # only 00 of the split is here
    train_set, val_set = ds.split(0.25, seed=3)
    assert len(train_set) == 3 and len(val_set) == 1
    assert not set(train_set.files) & set(val_set.files)
    assert ds.split(0.25, seed=3) == (train_set, val_set)
    batches = list(train_set.batches(0.5, batch_size=2, seed=0))
    assert [b.tensor.coords[:, 0].max().item() for b in batches] == [1, 0]
    mx.random.seed(0)
    model = MinkUNet(2, 19, widths=(8, 16))
    losses = train(model, batches, 16, ds.ignore_label)
    assert np.mean(losses[-4:]) < 0.7 * np.mean(losses[:4]), losses


def test_semantickitti_errors(tmp_path, rng):
    with pytest.raises(PointCloudFormatError, match="no 'sequences' folder"):
        semantickitti_dataset(tmp_path)
    make_semantickitti(tmp_path, rng, sequences=("03",), scans=1)
    with pytest.raises(PointCloudFormatError, match="sequences/05/velodyne: no such sequence"):
        semantickitti_dataset(tmp_path, ["05"])
    (tmp_path / "sequences/03/labels/000000.label").unlink()
    with pytest.raises(PointCloudFormatError, match=r"000000.bin: no label file"):
        semantickitti_dataset(tmp_path, ["03"])


def write_ascii_ply(path, points, labels):
    lines = ["ply", "format ascii 1.0", f"element vertex {len(points)}", "property float x",
             "property float y", "property float z", "property uchar label", "end_header"]  # fmt: skip
    lines += [
        f"{p[0]!r} {p[1]!r} {p[2]!r} {int(c)}" for p, c in zip(points.tolist(), labels, strict=True)
    ]
    path.write_text("\n".join(lines) + "\n")


def test_folder_of_ply_and_las(tmp_path, rng):
    import laspy

    scans = [synthetic_lidar_scan(s, SMALL) for s in range(3)]
    write_ascii_ply(tmp_path / "a.ply", scans[0].points, scans[0].labels)
    (tmp_path / "sub").mkdir()
    write_ascii_ply(tmp_path / "sub" / "b.ply", scans[1].points, scans[1].labels)
    header = laspy.LasHeader(point_format=1, version="1.2")
    header.scales = [1e-4] * 3
    las = laspy.LasData(header)
    las.x, las.y, las.z = (scans[2].points[:, k].astype(np.float64) for k in range(3))
    las.classification = scans[2].labels
    las.write(str(tmp_path / "c.las"))
    ds = folder_dataset(tmp_path)
    assert ds.class_names == ("class0", "class1", "class2", "class3", "class4")
    assert [p.name for p in ds.files] == ["a.ply", "c.las", "b.ply"]
    for k, scan in zip([0, 2, 1], scans, strict=True):
        got = ds.scan(k)
        np.testing.assert_array_equal(got.labels, scan.labels)
        # LAS: 0.1 mm steps, points relative to the origin the reader reports.
        origin = read_points(ds.files[k]).origin
        np.testing.assert_allclose(got.points + origin, scan.points, atol=1e-4, rtol=0)
    mapped = folder_dataset(tmp_path, class_names=["ground", "car"], label_map={0: 0, 2: 1})
    lab = mapped.scan(0).labels
    np.testing.assert_array_equal(
        lab, np.select([scans[0].labels == 0, scans[0].labels == 2], [0, 1], 2)
    )
    mx.random.seed(0)
    batches = [make_batch([ds.scan(k)], 0.5) for k in range(3)]
    losses = train(MinkUNet(2, 5, widths=(8, 16)), batches, 12, ds.ignore_label)
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses


def test_folder_errors(tmp_path):
    with pytest.raises(PointCloudFormatError, match="no point files"):
        folder_dataset(tmp_path)
    np.savez(tmp_path / "a.npz", points=np.zeros((2, 3)))
    with pytest.raises(PointCloudFormatError, match=r"a.npz: no label field"):
        folder_dataset(tmp_path)
    np.savez(tmp_path / "a.npz", points=np.zeros((2, 3)), labels=np.array([0, 7]))
    with pytest.raises(PointCloudFormatError, match=r"a.npz: labels must lie in \[0, 2\]"):
        folder_dataset(tmp_path, class_names=["x", "y"]).scan(0)
