"""The segment command end to end: a tiny model trained on one synthetic scan
and saved with save_model labels a generated KITTI .bin scan; the labels are
the model's own voxel argmax per point, the stages are timed, the picture is
a PNG with the classes' colours, and a damaged model or scan is an error
message, not a traceback. The same model exported as an artifact; a model
that declares intensity; SemanticKITTI .label files and a PLY read back by
plyfile. Any one output is enough and none is a usage error; --label-map
gives the demo's own classes (not SemanticKITTI names) their .label ids."""

import contextlib
import io
import json

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from matplotlib.image import imread

from examples import segment
from examples.pictures import class_colours
from mlx_lattice import export
from mlx_lattice.data import CLASS_NAMES, SceneConfig, make_batch, synthetic_lidar_scan
from mlx_lattice.io.semantickitti import CLASS_NAMES as KITTI_NAMES
from mlx_lattice.io.semantickitti import LEARNING_MAP_INV
from mlx_lattice.models import MinkUNet, point_cloud_input, save_model, train_step

SMALL = SceneConfig(beams=16, azimuth_steps=384)
VOXEL = 0.4


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    mx.random.seed(0)
    batch = make_batch([synthetic_lidar_scan(0, SMALL)], VOXEL)
    model = MinkUNet(2, 5, widths=(8, 16))
    opt = optim.Adam(learning_rate=1e-2)
    model.train()
    for _ in range(30):
        train_step(model, opt, batch.tensor, batch.labels)
    model.eval()
    path = tmp_path_factory.mktemp("model") / "tiny.safetensors"
    save_model(path, model, voxel_size=VOXEL, class_names=CLASS_NAMES)
    return path, model


def run(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = segment.main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_segment_a_kitti_scan(tmp_path, model_file):
    path, model = model_file
    scan = synthetic_lidar_scan(7, SMALL)
    rec = np.concatenate([scan.points, np.zeros((len(scan.points), 1), np.float32)], axis=1)
    rec.astype("<f4").tofile(tmp_path / "scan.bin")
    code, out, _ = run("--model", str(path), "--points", str(tmp_path / "scan.bin"),
                       "--out", str(tmp_path / "labels.npy"), "--picture", str(tmp_path / "scan.png"))  # fmt: skip
    print(out)
    assert code == 0
    labels = np.load(tmp_path / "labels.npy")
    assert labels.dtype == np.int32 and labels.shape == (len(scan.points),)
    batch = make_batch([scan], VOXEL)
    expect = np.array(mx.argmax(model(batch.tensor).feats, axis=1))[batch.point_to_voxel]
    np.testing.assert_array_equal(labels, expect)
    # Trained on another street, it still labels most points of this one right
    # (ground alone is ~60% of them; an untrained model scores ~20%).
    assert np.mean(labels == scan.labels) > 0.7
    for stage in ("load model", "read", "voxelize", "forward", "write"):
        assert f"  {stage}" in out and " ms" in out
    assert f"{len(scan.points)} points, {batch.tensor.num_points} voxels" in out
    assert "voxel size 0.4 m, 5 classes" in out
    # The picture, read back by matplotlib: one 500-pixel panel over a legend
    # of two rows (three classes a row at this width).
    view = np.rint(imread(tmp_path / "scan.png")[..., :3] * 255).astype(np.uint8)
    assert view.shape == (580, 520, 3)
    colours = class_colours(len(CLASS_NAMES))
    counts = np.bincount(labels, minlength=len(CLASS_NAMES))
    for k, colour in enumerate(colours):
        in_panel = np.all(view[:500] == colour, axis=2).sum()
        in_legend = np.all(view[500:] == colour, axis=2).sum()
        assert in_legend > 50, CLASS_NAMES[k]
        if counts[k] > 200:  # a class the prediction has, in its own colour
            assert in_panel > 20, CLASS_NAMES[k]


def test_segment_errors(tmp_path, model_file):
    path, _ = model_file
    np.save(tmp_path / "scan.npy", np.zeros((5, 3), np.float32))
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(path.read_bytes()[:-50])
    code, _, err = run("--model", str(broken), "--points", str(tmp_path / "scan.npy"),
                       "--out", str(tmp_path / "l.npy"))  # fmt: skip
    assert code == 2 and "broken.safetensors" in err
    (tmp_path / "scan.bin").write_bytes(b"\0" * 17)
    code, _, err = run("--model", str(path), "--points", str(tmp_path / "scan.bin"),
                       "--out", str(tmp_path / "l.npy"))  # fmt: skip
    assert code == 2 and "scan.bin: 17 bytes" in err
    with pytest.raises(SystemExit):
        run(
            "--model",
            str(path),
            "--points",
            str(tmp_path / "scan.npy"),
            "--out",
            str(tmp_path / "l.txt"),
        )


def _kitti_bin(tmp_path, seed=7):
    scan = synthetic_lidar_scan(seed, SMALL)
    rec = np.concatenate([scan.points, scan.intensity[:, None]], axis=1)
    rec.astype("<f4").tofile(tmp_path / "scan.bin")
    return scan, tmp_path / "scan.bin"


def test_segment_with_an_artifact(tmp_path, model_file):
    """The model exported as an artifact (the model classes are not needed to
    run it): each point gets its voxel's argmax, as the model scores it."""
    path, model = model_file
    art = tmp_path / "tiny.mlxl"
    export.export_model(model, art, voxel_size=VOXEL, features="occupancy,height",
                        class_names=CLASS_NAMES)  # fmt: skip
    scan, scan_path = _kitti_bin(tmp_path)
    code, out, err = run("--model", str(art), "--points", str(scan_path),
                         "--out", str(tmp_path / "a.npy"))  # fmt: skip
    assert code == 0, err
    assert "MinkUNet artifact (format version 2), compiled graph" in out
    assert "features occupancy,height" in out
    labels = np.load(tmp_path / "a.npy")
    feats = np.stack([np.ones(len(scan.points)), scan.points[:, 2] / 4.0], 1).astype(np.float32)
    compiled = export.load(art, compiled=True).predict_points(scan.points, feats)
    np.testing.assert_array_equal(labels, np.array(mx.argmax(compiled, axis=1)))
    # --nocompiled: the artifact op for op, the model's own eval forward.
    code, out, err = run("--model", str(art), "--points", str(scan_path), "--nocompiled",
                         "--out", str(tmp_path / "op.npy"))  # fmt: skip
    assert code == 0, err
    assert "MinkUNet artifact (format version 2), op for op" in out
    inp = point_cloud_input(scan.points, feats, VOXEL)
    scores = model(inp.tensor).feats
    expect = np.array(mx.argmax(scores, axis=1))[np.array(inp.voxels.point_to_voxel)]
    np.testing.assert_array_equal(np.load(tmp_path / "op.npy"), expect)
    # The compiled graph reorders float32 products only: near-ties may differ.
    assert np.mean(labels == expect) > 0.999
    # The save_model file labels the same scan the same way (its voxel means
    # are taken in float64, the artifact's in float32: near-ties may differ).
    code, _, _ = run("--model", str(path), "--points", str(scan_path),
                     "--out", str(tmp_path / "s.npy"))  # fmt: skip
    assert code == 0
    assert np.mean(np.load(tmp_path / "s.npy") == labels) > 0.999
    art.write_bytes(art.read_bytes()[:-40])
    code, _, err = run("--model", str(art), "--points", str(scan_path),
                       "--out", str(tmp_path / "a.npy"))  # fmt: skip
    assert code == 2 and "tiny.mlxl" in err


def test_segment_runs_a_static_int8_artifact_compiled(tmp_path, model_file):
    """A calibrated static-int8 artifact (as the demo exports one): segment
    loads it as the compiled graph, whose int8 activations stay int8 between
    the static layers, and labels the scan with that graph's scores."""
    import mlx_lattice
    import quantrules as qr

    _, model = model_file
    static = MinkUNet(2, 5, widths=(8, 16))
    static.update(model.parameters())
    rule = qr.Rule(op_names=("sparse_conv",), weight_qtype="int8", act_qtype="int8",
                   act_static_scale=True, tile_size=32)  # fmt: skip
    mlx_lattice.quantize(static, [qr.Rule(module_path="stem/.*"), rule], allow_growth=True)
    mlx_lattice.calibrate(static, [make_batch([synthetic_lidar_scan(0, SMALL)], VOXEL)])
    art = tmp_path / "static.mlxl"
    export.export_model(static.eval(), art, voxel_size=VOXEL, features="occupancy,height",
                        class_names=CLASS_NAMES)  # fmt: skip
    loaded = segment.load(art)
    assert loaded.compiled and "compiled graph" in loaded.description
    assert not segment.load(art, compiled=False).compiled
    scan, scan_path = _kitti_bin(tmp_path)
    code, out, err = run("--model", str(art), "--points", str(scan_path),
                         "--out", str(tmp_path / "a.npy"))  # fmt: skip
    assert code == 0, err
    assert "quantized (1 forms), compiled graph" in out
    net = export.load(art, compiled=True)
    assert net.graph["int8_values"]  # int8 codes between the static layers
    feats = np.stack([np.ones(len(scan.points)), scan.points[:, 2] / 4.0], 1).astype(np.float32)
    want = np.array(mx.argmax(net.predict_points(scan.points, feats), axis=1))
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), want)


def test_segment_declared_intensity_labels_and_ply(tmp_path):
    """A model declaring occupancy,height,intensity reads the .bin's
    intensity (and a file without one is an error naming it); .label files
    hold the raw SemanticKITTI ids of the classes by name; the PLY has the
    points, class colours and labels."""
    from plyfile import PlyData

    mx.random.seed(1)
    batch = make_batch([synthetic_lidar_scan(0, SMALL)], VOXEL,
                       features=("occupancy", "height", "intensity"))  # fmt: skip
    model = MinkUNet(3, 5, widths=(8, 16))
    opt = optim.Adam(learning_rate=1e-2)
    model.train()
    for _ in range(5):
        train_step(model, opt, batch.tensor, batch.labels)
    model.eval()
    names = ("road", "building", "car", "pole", "vegetation")  # SemanticKITTI class names
    path = tmp_path / "intensity.safetensors"
    save_model(path, model, voxel_size=VOXEL, class_names=names,
               features="occupancy,height,intensity")  # fmt: skip
    scan, scan_path = _kitti_bin(tmp_path)
    code, out, err = run("--model", str(path), "--points", str(scan_path), "--out",
                         str(tmp_path / "l.npy"), "--labels-out", str(tmp_path / "kitti"),
                         "--ply-out", str(tmp_path / "scan.ply"))  # fmt: skip
    assert code == 0, err
    assert "features occupancy,height,intensity" in out
    labels = np.load(tmp_path / "l.npy")
    expect_batch = make_batch([scan], VOXEL, features=("occupancy", "height", "intensity"))
    scores = model(expect_batch.tensor).feats
    np.testing.assert_array_equal(
        labels, np.array(mx.argmax(scores, axis=1))[expect_batch.point_to_voxel]
    )
    raw = np.fromfile(tmp_path / "kitti" / "scan.label", dtype="<u4")
    ids = [LEARNING_MAP_INV[KITTI_NAMES.index(n) + 1] for n in names]
    assert ids == [40, 50, 10, 80, 70]
    np.testing.assert_array_equal(raw, np.array(ids, np.uint32)[labels])
    ply = PlyData.read(str(tmp_path / "scan.ply"))
    vertex = ply["vertex"]
    assert vertex.count == len(scan.points)
    assert [(p.name, vertex[p.name].dtype.str) for p in vertex.properties] == [
        ("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("red", "|u1"), ("green", "|u1"),
        ("blue", "|u1"), ("label", "<i4"),
    ]  # fmt: skip
    assert ply.comments == [f"segment: label is the class index; classes {','.join(names)}"]
    np.testing.assert_array_equal(
        np.stack([vertex["x"], vertex["y"], vertex["z"]], 1), scan.points
    )
    np.testing.assert_array_equal(vertex["label"], labels)
    rgb = np.stack([vertex["red"], vertex["green"], vertex["blue"]], 1)
    np.testing.assert_array_equal(rgb, class_colours(5)[labels])
    # A scan without intensity: an error naming the feature and the file.
    np.save(tmp_path / "xyz.npy", scan.points)
    code, _, err = run("--model", str(path), "--points", str(tmp_path / "xyz.npy"),
                       "--out", str(tmp_path / "m.npy"))  # fmt: skip
    assert code == 2 and "xyz.npy: has no 'intensity' feature" in err
    # Classes that are not SemanticKITTI's cannot be written as .label files.
    other = tmp_path / "other.safetensors"
    save_model(other, model, voxel_size=VOXEL, class_names=CLASS_NAMES,
               features="occupancy,height,intensity")  # fmt: skip
    code, _, err = run("--model", str(other), "--points", str(scan_path), "--out",
                       str(tmp_path / "o.npy"), "--labels-out", str(tmp_path / "kitti"))  # fmt: skip
    assert code == 2 and "class 'ground' is not a SemanticKITTI class" in err
    # ... and the message says how to give them ids, with the model's classes.
    assert "Pass --label-map FILE.json" in err
    assert '{"ground": ID, "building": 50, "car": 10, "pole": 80, "vegetation": 70}' in err


def test_any_one_output_is_enough_and_none_is_a_usage_error(tmp_path, model_file):
    path, model = model_file
    scan, scan_path = _kitti_bin(tmp_path)
    batch = make_batch([scan], VOXEL)
    expect = np.array(mx.argmax(model(batch.tensor).feats, axis=1))[batch.point_to_voxel]
    outputs = {
        "--ply-out": tmp_path / "out" / "only.ply",
        "--picture": tmp_path / "out" / "only.png",
        "--labels-out": tmp_path / "out" / "only",
    }
    label_map = tmp_path / "map.json"
    label_map.write_text(json.dumps({"ground": 72, "building": 50, "car": 10, "pole": 80,
                                     "vegetation": 70}))  # fmt: skip
    for flag, target in outputs.items():
        extra = ["--label-map", str(label_map)] if flag == "--labels-out" else []
        code, out, err = run("--model", str(path), "--points", str(scan_path), flag, str(target),
                             *extra)  # fmt: skip
        assert code == 0, (flag, err)
        written = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
        assert written == [target / "scan.label" if flag == "--labels-out" else target], flag
        assert not any(line.startswith("labels: ") for line in out.splitlines())  # no .npy
        if flag == "--ply-out":
            from plyfile import PlyData

            np.testing.assert_array_equal(PlyData.read(str(target))["vertex"]["label"], expect)
        written[0].unlink()
    # None at all: absl's usage error (exit status 2), before anything runs.
    with pytest.raises(SystemExit) as info:
        run("--model", str(path), "--points", str(scan_path))
    assert info.value.code == 2
    with pytest.raises(SystemExit):  # a map without a file to map into
        run("--model", str(path), "--points", str(scan_path), "--out", str(tmp_path / "l.npy"),
            "--label-map", str(label_map))  # fmt: skip


def test_label_map_gives_the_demo_classes_their_ids(tmp_path, model_file, monkeypatch):
    """The demo's classes (ground is no SemanticKITTI name) written through
    --label-map: each point's id is the map's id of its predicted class."""
    path, _ = model_file
    _, scan_path = _kitti_bin(tmp_path)
    ids = {"ground": 72, "building": 50, "car": 10, "pole": 80, "vegetation": 70}
    label_map = tmp_path / "map.json"
    label_map.write_text(json.dumps({**ids, "truck": 18}))  # a class the model lacks: unused
    code, out, err = run("--model", str(path), "--points", str(scan_path), "--out",
                         str(tmp_path / "l.npy"), "--labels-out", str(tmp_path / "kitti"),
                         "--label-map", str(label_map))  # fmt: skip
    assert code == 0, err
    labels = np.load(tmp_path / "l.npy")
    raw = np.fromfile(tmp_path / "kitti" / "scan.label", dtype="<u4")
    np.testing.assert_array_equal(raw, np.array([ids[n] for n in CLASS_NAMES], np.uint32)[labels])
    assert len(np.unique(labels)) > 1  # the map is checked on more than one class
    assert f"mapped labels: {tmp_path / 'kitti' / 'scan.label'}" in out
    # Bad maps: an error naming the file or the class, before the scan is
    # even read (so before the forward).
    import mlx_lattice.io

    def no_read(*_args, **_kwargs):
        raise AssertionError("the scan was read")

    monkeypatch.setattr(mlx_lattice.io, "read_points", no_read)
    bad = {
        "missing.json": (json.dumps({"ground": 1}), "no id for the model's classes 'building', 'car'"),
        "list.json": ("[1, 2]", "must hold a JSON object of class names to ids, got a list"),
        "range.json": (json.dumps({**ids, "car": 70000}),
                       "the id of 'car' must be an integer in [0, 65535], got 70000"),
        "float.json": (json.dumps({**ids, "car": 1.5}), "got 1.5"),
        "bool.json": (json.dumps({**ids, "car": True}), "got true"),
        "broken.json": ('{"ground": ', "broken.json is not JSON"),
    }  # fmt: skip
    for name, (text, message) in bad.items():
        (tmp_path / name).write_text(text)
        code, out, err = run("--model", str(path), "--points", str(scan_path), "--labels-out",
                             str(tmp_path / "k2"), "--label-map", str(tmp_path / name))  # fmt: skip
        assert code == 2 and message in err, (name, err)
        assert not (tmp_path / "k2").exists(), name
    code, _, err = run("--model", str(path), "--points", str(scan_path), "--labels-out",
                       str(tmp_path / "k2"), "--label-map", str(tmp_path / "absent.json"))  # fmt: skip
    assert code == 2 and "--label-map: cannot read" in err and "absent.json" in err


@pytest.mark.parametrize("flag", ["--out", "--ply-out", "--labels-out"])
def test_an_unwritable_output_is_an_error_message(tmp_path, model_file, flag):
    """An output under a regular file (no folder can be made there; as
    root, too) is `error: ...` and status 2, not a traceback."""
    path, _ = model_file
    _, scan_path = _kitti_bin(tmp_path)
    (tmp_path / "file").write_text("not a folder")
    target = tmp_path / "file" / ("labels.npy" if flag == "--out" else "scan.ply")
    if flag == "--labels-out":
        target = tmp_path / "file" / "kitti"
        code, _, err = run("--model", str(path), "--points", str(scan_path), flag, str(target),
                           "--label-map", str(_label_map(tmp_path)))  # fmt: skip
    else:
        code, _, err = run("--model", str(path), "--points", str(scan_path), flag, str(target))
    assert code == 2, err
    assert err.startswith("error: cannot write the outputs: ") and str(tmp_path / "file") in err


def _label_map(tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({name: 10 + k for k, name in enumerate(CLASS_NAMES)}))
    return path
