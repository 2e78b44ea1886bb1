"""The segment command end to end: a tiny model trained on one synthetic scan
and saved with save_model labels a generated KITTI .bin scan; the labels are
the model's own voxel argmax per point, the stages are timed, the picture is
a PNG, and a damaged model or scan is an error message, not a traceback."""

import contextlib
import io

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest

from examples import segment
from mlx_lattice.data import CLASS_NAMES, SceneConfig, make_batch, synthetic_lidar_scan
from mlx_lattice.models import MinkUNet, save_model, train_step

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
    png = (tmp_path / "scan.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


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
