"""save_model / load_model: float and quantized MinkUNet and SPVCNN come back
bit for bit with their configuration; edited, damaged and mismatched files
raise ModelFileError."""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
import quantrules as qr
from mlx_lattice.data import SceneConfig, make_batch, synthetic_lidar_scan
from mlx_lattice.models import SPVCNN, MinkUNet, ModelFileError, load_model, save_model
from mlx_lattice.models import files as model_files

RULES = [
    qr.Rule(module_path="stem/.*"),
    qr.Rule(module_path="encoder/.*", op_names=("sparse_conv",), weight_qtype="int4", tile_size=32),
    qr.Rule(op_names=("sparse_conv",), weight_qtype="int8", tile_size=32),
]
NAMES = ("ground", "building", "car", "pole", "vegetation")


@pytest.fixture
def scan():
    return synthetic_lidar_scan(1, SceneConfig(beams=8, azimuth_steps=256))


def trained_like(model):
    """Random, non-default parameters (running statistics too)."""
    params = model.parameters()
    from mlx.utils import tree_flatten, tree_unflatten

    flat = [(k, mx.random.normal(v.shape).astype(v.dtype) * 0.3 + (1.0 if "var" in k else 0.0))
            for k, v in tree_flatten(params)]  # fmt: skip
    flat = [(k, mx.abs(v) if "var" in k else v) for k, v in flat]
    model.update(tree_unflatten(flat))
    return model.eval()


def read_header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw, n, json.loads(raw[8 : 8 + n])


def write_header(path, raw, n, header):
    text = json.dumps(header).encode()
    text += b" " * ((-len(text)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def test_float_and_quantized_minkunet_round_trip(tmp_path, scan):
    model = trained_like(MinkUNet(2, 5, widths=(8, 16, 16), depths=(1, 2, 1)))
    batch = make_batch([scan], 0.5)
    save_model(
        tmp_path / "f.safetensors", model, voxel_size=0.5, class_names=NAMES, metadata={"steps": 3}
    )
    loaded = load_model(tmp_path / "f.safetensors")
    assert (loaded.architecture, loaded.voxel_size, loaded.class_names) == ("MinkUNet", 0.5, NAMES)
    assert loaded.model.depths == (1, 2, 1) and loaded.report is None
    assert loaded.metadata == {"steps": 3} and loaded.version == mlx_lattice.__version__
    assert mx.array_equal(model(batch.tensor).feats, loaded.model(batch.tensor).feats).item()

    report = mlx_lattice.quantize(model, RULES)
    save_model(tmp_path / "q.safetensors", model, voxel_size=0.5, class_names=NAMES, rules=RULES)
    q = load_model(tmp_path / "q.safetensors")
    assert isinstance(q.model.encoder.block1.conv, mlx_lattice.nn.QuantizedConv)
    assert q.model.encoder.block1.conv.quantization.bits == 4
    assert q.model.decoder.block1.conv.quantization.bits == 8
    assert q.report.layers == report.layers
    assert mx.array_equal(model(batch.tensor).feats, q.model(batch.tensor).feats).item()
    # Per point: the voxel argmax of the model, through the loaded file's own voxel size.
    pred = q.predict(q.prepare(scan.points))
    expect = np.array(mx.argmax(model(batch.tensor).feats, axis=1))[batch.point_to_voxel]
    np.testing.assert_array_equal(pred, expect)


def test_spvcnn_round_trip(tmp_path, scan):
    model = trained_like(SPVCNN(2, 5, widths=(8, 16)))
    save_model(tmp_path / "s.safetensors", model, voxel_size=0.4, class_names=NAMES)
    loaded = load_model(tmp_path / "s.safetensors")
    assert loaded.architecture == "SPVCNN"
    inp = loaded.prepare(scan.points)
    np.testing.assert_array_equal(loaded.predict(inp), np.array(mx.argmax(model(inp), axis=1)))


def test_declared_input_features(tmp_path, scan):
    """A model saved with occupancy,height,intensity: the features come back
    with it; prepare builds exactly those columns (voxel means of the
    points' values, against NumPy); a source without intensity is an error
    naming the feature and the source."""
    from mlx_lattice.data import HEIGHT_SCALE

    model = trained_like(MinkUNet(3, 5, widths=(8, 16)))
    path = tmp_path / "i.safetensors"
    save_model(path, model, voxel_size=0.5, class_names=NAMES, features="occupancy,height,intensity")
    loaded = load_model(path)
    assert loaded.features == ("occupancy", "height", "intensity")
    assert scan.intensity is not None and scan.intensity.shape == (len(scan.points),)
    inp = loaded.prepare(scan.points, {"intensity": scan.intensity}, source="scan.bin")
    batch = make_batch([scan], 0.5, features=loaded.features)
    assert mx.array_equal(inp.tensor.feats, batch.tensor.feats).item()
    # NumPy: per voxel, the mean of (1, z / HEIGHT_SCALE, intensity).
    cells = np.floor(scan.points.astype(np.float64) / 0.5).astype(np.int64)
    _, inverse = np.unique(cells, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    cols = np.stack([np.ones(len(cells)), scan.points[:, 2] / HEIGHT_SCALE, scan.intensity], 1)
    ref = np.stack([np.bincount(inverse, c) / np.bincount(inverse) for c in cols.T], 1)
    np.testing.assert_allclose(np.array(batch.tensor.feats), ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(inp.point_to_voxel, batch.point_to_voxel)
    with pytest.raises(mlx_lattice.MlxLatticeError, match=r"scan\.bin: has no 'intensity' feature"):
        loaded.prepare(scan.points, {}, source="scan.bin")
    with pytest.raises(ValueError, match="features has 2 names, the model takes 3"):
        save_model(path, model, voxel_size=0.5, class_names=NAMES)


def test_save_rejects_mismatches(tmp_path):
    model = MinkUNet(2, 5, widths=(8, 16))
    with pytest.raises(ValueError, match="class_names has 2 names, the model scores 5"):
        save_model(tmp_path / "m.safetensors", model, voxel_size=0.5, class_names=["a", "b"])
    with pytest.raises(ValueError, match=r"must end in .safetensors"):
        save_model(tmp_path / "m.npz", model, voxel_size=0.5, class_names=NAMES)
    with pytest.raises(ValueError, match="voxel_size must be a positive"):
        save_model(tmp_path / "m.safetensors", model, voxel_size=0.0, class_names=NAMES)
    mlx_lattice.quantize(model, RULES)
    with pytest.raises(ValueError, match="pass the rules"):
        save_model(tmp_path / "m.safetensors", model, voxel_size=0.5, class_names=NAMES)
    with pytest.raises(ValueError, match="does not match a fresh model quantized with these rules"):
        save_model(tmp_path / "m.safetensors", model, voxel_size=0.5, class_names=NAMES,
                   rules=[qr.Rule(op_names=("sparse_conv",), weight_qtype="int8", tile_size=32)])  # fmt: skip
    with pytest.raises(TypeError, match="MinkUNet or SPVCNN"):
        save_model(
            tmp_path / "m.safetensors",
            mlx_lattice.nn.Linear(2, 2),
            voxel_size=0.5,
            class_names=NAMES,
        )


def test_model_file_error_is_in_the_error_family(tmp_path):
    """Regression (fuzz): load_model's errors were plain ValueErrors, outside
    the package's MlxLatticeError family."""
    assert issubclass(ModelFileError, mlx_lattice.MlxLatticeError)
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(mlx_lattice.MlxLatticeError, match=r"empty\.safetensors: not a readable"):
        load_model(tmp_path / "empty.safetensors")


def test_load_rejects_damaged_and_edited_files(tmp_path):
    model = trained_like(MinkUNet(2, 5, widths=(8, 16)))
    path = tmp_path / "m.safetensors"
    save_model(path, model, voxel_size=0.5, class_names=NAMES)
    raw, n, header = read_header(path)

    with pytest.raises(ModelFileError, match=r"nothere.safetensors: no such file"):
        load_model(tmp_path / "nothere.safetensors")
    (tmp_path / "t.safetensors").write_bytes(raw[: len(raw) - 100])
    with pytest.raises(ModelFileError, match=r"t\.safetensors: not a readable"):
        load_model(tmp_path / "t.safetensors")
    mx.save_safetensors(
        str(tmp_path / "plain.safetensors"), dict(mlx_lattice.nn.Linear(2, 2).parameters())
    )
    with pytest.raises(ModelFileError, match="not an mlx_lattice model file"):
        load_model(tmp_path / "plain.safetensors")

    # Edited metadata (the voxel size), digest left as it was.
    config = json.loads(header["__metadata__"]["config"])
    config["voxel_size"] = 0.25
    edited = dict(
        header, __metadata__=dict(header["__metadata__"], config=json.dumps(config, sort_keys=True))
    )
    write_header(tmp_path / "e.safetensors", raw, n, edited)
    with pytest.raises(ModelFileError, match=r"e.safetensors: the digest does not match"):
        load_model(tmp_path / "e.safetensors")
    # A flipped byte in the arrays.
    flipped = bytearray(raw)
    flipped[-5] ^= 0xFF
    (tmp_path / "b.safetensors").write_bytes(bytes(flipped))
    with pytest.raises(ModelFileError, match=r"b.safetensors: the digest does not match"):
        load_model(tmp_path / "b.safetensors")


def resave(path, arrays, config):
    """A file as an editor that recomputes the digest would write it."""
    text = json.dumps(config, sort_keys=True)
    mx.save_safetensors(str(path), arrays, metadata={"format": model_files.FORMAT, "config": text,
                        "digest": model_files._digest(text, arrays)})  # fmt: skip


def test_load_rejects_consistent_but_mismatched_files(tmp_path):
    model = trained_like(MinkUNet(2, 5, widths=(8, 16)))
    mlx_lattice.quantize(model, RULES)
    path = tmp_path / "m.safetensors"
    save_model(path, model, voxel_size=0.5, class_names=NAMES, rules=RULES)
    arrays, meta = mx.load(str(path), return_metadata=True)
    config = json.loads(meta["config"])

    missing = {k: v for k, v in arrays.items() if k != "head.bias"}
    resave(tmp_path / "k.safetensors", missing, config)
    with pytest.raises(ModelFileError, match=r"k\.safetensors: arrays do not fit .*head\.bias"):
        load_model(tmp_path / "k.safetensors")

    wrong = dict(arrays, **{"head.weight": mx.zeros((5, 9))})
    resave(tmp_path / "s.safetensors", wrong, config)
    with pytest.raises(ModelFileError, match=r"s\.safetensors: arrays do not fit .*shape"):
        load_model(tmp_path / "s.safetensors")

    other = json.loads(meta["config"])
    other["quantization"]["rules"]["rules"][1]["weight_qtype"] = "int8"
    resave(tmp_path / "r.safetensors", arrays, other)
    with pytest.raises(
        ModelFileError, match="quantize the model differently from the saved report"
    ):
        load_model(tmp_path / "r.safetensors")

    other = json.loads(meta["config"])
    other["architecture"] = "PointNet"
    resave(tmp_path / "a.safetensors", arrays, other)
    with pytest.raises(ModelFileError, match="unknown architecture 'PointNet'"):
        load_model(tmp_path / "a.safetensors")

    other = json.loads(meta["config"])
    del other["voxel_size"]
    resave(tmp_path / "v.safetensors", arrays, other)
    with pytest.raises(ModelFileError, match=r"bad configuration .*voxel_size"):
        load_model(tmp_path / "v.safetensors")
