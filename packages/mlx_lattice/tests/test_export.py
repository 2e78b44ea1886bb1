"""mlx_lattice.export: a trained MinkUNet saved, loaded in a fresh process
that never imports the model classes, and run on other coordinates with the
same bits as the model itself; what MLX's own export does with the
extension's primitives; malformed artifacts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest

from mlx_lattice import export, ops
from mlx_lattice._native import ext
from mlx_lattice.core import build_kernel_relation
from mlx_lattice.models import MinkUNet, train_step
from mlx_lattice.tensor import SparseTensor

# Runs in a child Python: loads the artifact, runs it on the saved input,
# writes the output's bits and the modules it imported.
_CHILD = """
import sys
import numpy as np
import mlx.core as mx
from mlx_lattice import export
from mlx_lattice.tensor import SparseTensor

net = export.load(sys.argv[1])
case = np.load(sys.argv[2])
out = net(SparseTensor(mx.array(case["coords"]), mx.array(case["feats"])))
mx.eval(out.feats)
np.savez(
    sys.argv[3],
    bits=np.array(out.feats.view(mx.uint32)),
    coords=np.array(out.coords),
    models_imported=any(m.startswith("mlx_lattice.models") for m in sys.modules),
    metadata=net.metadata["trained"],
)
"""


def _scan(rng: np.random.Generator, n: int, extent: int) -> tuple[np.ndarray, np.ndarray]:
    coords = np.unique(
        np.concatenate([rng.integers(0, 2, (n, 1)), rng.integers(0, extent, (n, 3))], axis=1),
        axis=0,
    ).astype(np.int32)
    feats = rng.standard_normal((len(coords), 3)).astype(np.float32)
    return coords, feats


def _trained(rng: np.random.Generator) -> MinkUNet:
    model = MinkUNet(3, 4, widths=(8, 16, 16), depths=(1, 2, 1))
    opt = optim.SGD(learning_rate=0.05)
    coords, feats = _scan(rng, 600, 12)
    labels = mx.array(rng.integers(0, 4, len(coords)).astype(np.int32))
    x = SparseTensor(mx.array(coords), mx.array(feats))
    model.train()
    for _ in range(3):
        train_step(model, opt, x, labels)
    return model.eval()


def test_artifact_runs_in_a_fresh_process_bit_for_bit(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    model = _trained(rng)
    path = tmp_path / "minkunet.safetensors"
    export.export_model(model, path, metadata={"trained": "3 SGD steps"})
    # Other coordinates than the training batch: relations are rebuilt.
    coords, feats = _scan(rng, 900, 16)
    np.savez(tmp_path / "case.npz", coords=coords, feats=feats)
    expected = model(SparseTensor(mx.array(coords), mx.array(feats))).feats
    subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(path),
            str(tmp_path / "case.npz"),
            str(tmp_path / "out.npz"),
        ],
        check=True,
    )
    with np.load(tmp_path / "out.npz") as out:
        assert not bool(out["models_imported"])
        assert str(out["metadata"]) == "3 SGD steps"
        assert np.array_equal(out["coords"], coords)
        assert np.array_equal(out["bits"], np.array(expected.view(mx.uint32)))
    # In this process too, and with every node of the vocabulary present.
    graph = export.load(path).graph
    assert {n["op"] for n in graph["nodes"]} == {
        "subm_conv",
        "conv",
        "conv_transpose",
        "batch_norm",
        "cat",
        "linear",
    }


def test_artifact_half_precision_features(tmp_path: Path, rng: np.random.Generator) -> None:
    """float16 features (float32 weights) take the same bits through the
    artifact as through the model (its half-precision skip fork included)."""
    model = _trained(rng)
    path = tmp_path / "net.safetensors"
    export.export_model(model, path)
    coords, feats = _scan(rng, 700, 14)
    half = mx.array(feats).astype(mx.float16)
    expected = model(SparseTensor(mx.array(coords), half)).feats
    got = export.load(path)(SparseTensor(mx.array(coords), half)).feats
    assert got.dtype == mx.float16
    assert np.array_equal(np.array(got.view(mx.uint16)), np.array(expected.view(mx.uint16)))


def test_mlx_export_function_cannot_carry_the_extension(tmp_path: Path) -> None:
    """What mx.export_function (MLX 0.32.4) does with the extension: the
    native convolution's graph (over a prebuilt relation) and the ops
    layer's both stop at a primitive MLX cannot serialise: the Contiguous
    the extension's ops insert, which plain MLX cannot export either."""
    coords = mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32)
    relation = build_kernel_relation(coords)
    weight = mx.ones((27, 2, 1))

    def conv(feats: mx.array) -> mx.array:
        return ext.sparse_conv_features(feats, weight, relation)

    def layer(feats: mx.array) -> mx.array:
        return ops.subm_conv3d(SparseTensor(coords, feats), mx.ones((1, 3, 3, 3, 2))).feats

    assert conv(mx.ones((2, 2))).tolist() == [[4.0], [4.0]]
    for name, fn in (
        ("conv", conv),
        ("layer", layer),
        ("contiguous", lambda a: mx.contiguous(a.T)),
    ):
        with pytest.raises(ValueError, match="Unable to serialize primitive"):
            mx.export_function(str(tmp_path / f"{name}.mlxfn"), fn, mx.ones((2, 2)))
    # An MLX-only function exports and imports (the mechanism itself works).
    mx.export_function(str(tmp_path / "plain.mlxfn"), lambda a: mx.exp(a) * 2, mx.ones((2, 2)))
    (out,) = mx.import_function(str(tmp_path / "plain.mlxfn"))(mx.zeros((2, 2)))
    assert out.tolist() == [[2.0, 2.0], [2.0, 2.0]]


def test_export_rejects_models_outside_the_vocabulary(tmp_path: Path) -> None:
    from mlx_lattice.models import SPVCNN

    path = tmp_path / "unused.safetensors"
    with pytest.raises(export.ExportError, match="must be a MinkUNet, got SPVCNN"):
        export.export_model(SPVCNN(), path)
    model = MinkUNet(2, 3, widths=(4, 8))
    model.stem.conv = model.stem.conv.to_quantized(bits=4, group_size=32)
    with pytest.raises(export.ExportError, match=r"stem\.conv: QuantizedConv"):
        export.export_model(model, path)
    assert not path.exists()


def _rewrite(path: Path, out: Path, edit) -> Path:
    tensors, meta = mx.load(str(path), return_metadata=True)
    graph = json.loads(meta[export.FORMAT])
    tensors, graph = edit(tensors, graph)
    mx.save_safetensors(str(out), tensors, metadata={export.FORMAT: json.dumps(graph)})
    return out


def test_load_rejects_malformed_artifacts(tmp_path: Path) -> None:
    path = tmp_path / "net.safetensors"
    export.export_model(MinkUNet(2, 3, widths=(4, 8)), path)

    def unknown_op(t: dict, g: dict) -> tuple[dict, dict]:
        g["nodes"][1]["op"] = "attention"
        return t, g

    def missing_tensor(t: dict, g: dict) -> tuple[dict, dict]:
        del t["head.weight"]
        return t, g

    def version(t: dict, g: dict) -> tuple[dict, dict]:
        g["version"] = 99
        return t, g

    def dangling(t: dict, g: dict) -> tuple[dict, dict]:
        g["nodes"][0]["inputs"] = ["nowhere"]
        return t, g

    cases = [
        (unknown_op, "node 1 has op 'attention'"),
        (missing_tensor, "needs tensor 'head.weight'"),
        (version, "version 99"),
        (dangling, "reads 'nowhere' before"),
    ]
    for i, (edit, match) in enumerate(cases):
        bad = _rewrite(path, tmp_path / f"bad{i}.safetensors", edit)
        with pytest.raises(export.ExportError, match=match):
            export.load(bad)
    plain = tmp_path / "plain.safetensors"
    mx.save_safetensors(str(plain), {"w": mx.ones(2)})
    with pytest.raises(export.ExportError, match=r"no 'mlx_lattice\.graph' metadata"):
        export.load(plain)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(export.ExportError, match="cannot read"):
        export.load(tmp_path / "junk.safetensors")
    with pytest.raises(export.ExportError, match="reserved"):
        export.export_model(MinkUNet(2, 3, widths=(4, 8)), path, metadata={export.FORMAT: "x"})
