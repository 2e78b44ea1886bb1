"""The README's main job runs end to end on a small scene, with built-in and
file inputs."""

import contextlib
import io
import json

import numpy as np
import pytest

from examples import demo


def run(*args: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert demo.main(["--small", *args]) == 0
    return buf.getvalue()


def table(out: str, title: str) -> dict[str, list[str]]:
    lines = out.split(title, 1)[1].splitlines()[2:]
    rows = {}
    for line in lines:
        if not line.strip() or line.startswith("total"):
            break
        rows[line.split()[0]] = line.split()
    return rows


def test_demo_applies_one_rule_set_to_both_backends():
    out = run()
    dense = table(out, "dense JAX model")
    sparse = table(out, "sparse U-Net")
    assert list(dense) == ["mlp/fc1", "mlp/fc2", "head"]
    assert (
        "stem/conv" in sparse and "encoder/block1/conv" in sparse and "decoder/block2/up" in sparse
    )
    # The rules' decisions, as explain states them.
    assert "weight_qtype=int8," in " ".join(dense["mlp/fc1"]) and "disables" in " ".join(
        dense["head"]
    )
    assert "weight_qtype=int4," in " ".join(sparse["encoder/block1/conv"])
    assert "weight_qtype=int8," in " ".join(sparse["decoder/block1/conv"])
    assert float(sparse["stem/conv"][1]) == 0.0  # float layer, float input
    for name in ("encoder/block1/conv", "decoder/block1/conv"):
        err = float(sparse[name][1])
        assert 1e-4 < err < 0.3
        assert int(sparse[name][5]) < int(sparse[name][4])  # bytes shrink
    assert "relations:" in out and "shared" in out


def test_demo_reads_rules_and_point_files(tmp_path):
    rules = {"rules": [{"op_names": ["sparse_conv"], "weight_qtype": "int8", "tile_size": 64}]}
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(rules))
    rng = np.random.default_rng(0)
    points = np.concatenate(
        [rng.uniform(-5, 5, (3000, 2)), rng.uniform(0, 1, (3000, 1))], axis=1
    ).astype(np.float32)
    npy = tmp_path / "cloud.npy"
    np.save(npy, points)
    out = run("--rules", str(path), "--points", str(npy))
    sparse = table(out, "sparse U-Net")
    assert "weight_qtype=int8, tile_size=64" in " ".join(sparse["stem/conv"])
    assert "no rule matched" in " ".join(table(out, "dense JAX model")["mlp/fc1"])
    ply = tmp_path / "cloud.ply"
    header = f"ply\nformat binary_little_endian 1.0\nelement vertex {len(points)}\nproperty float x\nproperty float y\nproperty float z\nproperty uchar label\nend_header\n"
    body = np.zeros(len(points), dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("label", "u1")])
    for i, a in enumerate("xyz"):
        body[a] = points[:, i]
    ply.write_bytes(header.encode() + body.tobytes())
    np.testing.assert_array_equal(demo.read_points(ply), points)
    ascii_ply = tmp_path / "ascii.ply"
    ascii_ply.write_text(
        "ply\nformat ascii 1.0\nelement vertex 2\nproperty float x\nproperty float y\nproperty float z\nend_header\n1 2 3\n4 5 6\n"
    )
    np.testing.assert_array_equal(demo.read_points(ascii_ply), [[1, 2, 3], [4, 5, 6]])


def test_demo_rejects_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="unsupported point file"):
        demo.read_points(tmp_path / "cloud.txt")
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((4, 2)))
    with pytest.raises(ValueError, match=r"expected an \(M, >=3\) array"):
        demo.read_points(bad)
    with pytest.raises(SystemExit):
        demo.main(["--voxel-size", "0"])
