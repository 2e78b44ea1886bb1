"""mlx_lattice.export: MinkUNet and SPVCNN, float and in every form
mlx_lattice.quantize produces, exported, loaded in a fresh process that never
imports the model classes, and run on other points with the same bits as the
model itself; predict_points; paths; the committed version-2 artifact; what
MLX's own export does with the extension's primitives; malformed artifacts.

Regenerate the committed artifact (only when the format's version changes,
as a new file beside the old one): ``python tests/test_export.py`` from
``packages/mlx_lattice`` with the package importable.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest

import quantrules as qr
from mlx_lattice import calibrate_activation_scales, export, ops, quantize
from mlx_lattice._native import ext
from mlx_lattice.core import build_kernel_relation
from mlx_lattice.models import SPVCNN, MinkUNet, point_cloud_input, train_step
from mlx_lattice.tensor import SparseTensor

_spec = importlib.util.spec_from_file_location(
    "data", Path(__file__).with_name("inference_data.py")
)
data = importlib.util.module_from_spec(_spec)  # the shared tests/inference_data.py
_spec.loader.exec_module(data)
DATA, GOLDEN, GOLDEN_EXPECTED = data.DATA, data.GOLDEN, data.GOLDEN_EXPECTED
VOXEL, FORMS = data.VOXEL, data.FORMS

# Runs in a child Python: loads each artifact, scores its case's points (and
# for voxel models its sparse tensor), writes the outputs' bits and whether
# any module of mlx_lattice.models was imported.
_CHILD = """
import sys
import numpy as np
import mlx.core as mx
from mlx_lattice import export
from mlx_lattice.tensor import SparseTensor

out = {}
for i in range(1, len(sys.argv) - 1, 2):
    net = export.load(sys.argv[i])
    case = np.load(sys.argv[i + 1])
    key = case["key"].item()
    for dtype in ("float32", "float16"):
        feats = mx.array(case["feats"]).astype(getattr(mx, dtype))
        scores = net.predict_points(case["points"], feats)
        mx.eval(scores)
        out[f"{key}/{dtype}/points"] = np.array(scores.view(mx.uint8))
        if net.model_type == "MinkUNet":
            y = net(SparseTensor(mx.array(case["coords"]), mx.array(case["vfeats"]).astype(
                getattr(mx, dtype))))
            mx.eval(y.feats)
            out[f"{key}/{dtype}/voxels"] = np.array(y.feats.view(mx.uint8))
out["models_imported"] = np.array(any(m.startswith("mlx_lattice.models") for m in sys.modules))
np.savez(sys.argv[-1], **out)
"""


def _expected(model, arch: str, pts: np.ndarray, feats: np.ndarray, dtype) -> dict:
    inp = data.cloud(pts, feats, dtype)
    if arch == "SPVCNN":
        return {"points": model(inp)}
    scores = model(inp.tensor).feats
    # The child's sparse tensor: the float32 voxel means cast to dtype.
    f32 = data.cloud(pts, feats).tensor
    voxels = model(f32.replace(f32.feats.astype(dtype))).feats
    return {"points": mx.take(scores, inp.voxels.point_to_voxel, axis=0), "voxels": voxels}


def test_every_model_and_form_bit_for_bit_in_a_fresh_process(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """Each (model x quantization form) artifact, in a child process that
    never imports mlx_lattice.models, gives the bits of the in-process
    eval() model for float32 and float16 features (new points, not the
    calibration ones)."""
    calib_pts, calib_feats = data.points(rng, 900, 4.0)
    pts, feats = data.points(rng, 1500, 5.0)
    expected: dict[str, np.ndarray] = {}
    argv: list[str] = []
    for arch in ("MinkUNet", "SPVCNN"):
        for form in FORMS:
            key = f"{arch}-{form}"
            model = data.model(arch, form, rng, (calib_pts, calib_feats))
            path = tmp_path / f"{key}.mlxl"
            export.export_model(model, path, voxel_size=VOXEL)
            vox = data.cloud(pts, feats).tensor
            np.savez(
                tmp_path / f"{key}.npz",
                key=key,
                points=pts,
                feats=feats,
                coords=np.array(vox.coords),
                vfeats=np.array(vox.feats),
            )
            argv += [str(path), str(tmp_path / f"{key}.npz")]
            for dtype in (mx.float32, mx.float16):
                want = _expected(model, arch, pts, feats, dtype)
                for what, array in want.items():
                    # SPVCNN's point branch and head run in float32.
                    want_dtype = mx.float32 if arch == "SPVCNN" else dtype
                    assert array.dtype == want_dtype, (key, what, array.dtype)
                    expected[f"{key}/{dtype_name(dtype)}/{what}"] = np.array(array.view(mx.uint8))
    subprocess.run([sys.executable, "-c", _CHILD, *argv, str(tmp_path / "out.npz")], check=True)
    with np.load(tmp_path / "out.npz") as out:
        assert not bool(out["models_imported"])
        assert set(out.files) - {"models_imported"} == set(expected)
        differ = [k for k, v in expected.items() if not np.array_equal(out[k], v)]
    assert not differ, f"outputs differ from the model's: {differ}"


def dtype_name(dtype) -> str:
    return "float16" if dtype == mx.float16 else "float32"


def test_quantized_weights_stored_packed(tmp_path: Path) -> None:
    """An int4 MinkUNet artifact holds packed codes: at most 0.45x the float
    one (the issue's bound; group 32 int4 with float32 scales and biases is
    6 bits per weight against 32)."""
    model = MinkUNet(4, 20)
    float_path, int4_path = tmp_path / "float.mlxl", tmp_path / "int4.mlxl"
    export.export_model(model, float_path)
    quantize(model, [qr.Rule(weight_qtype="int4", tile_size=32)])
    export.export_model(model, int4_path)
    ratio = int4_path.stat().st_size / float_path.stat().st_size
    assert ratio <= 0.45, ratio
    graph = export.load(int4_path).graph
    packed = [n for n in graph["nodes"] if "quant" in n]
    assert packed and all(n["quant"]["bits"] == 4 for n in packed)
    tensors = export.load(int4_path).tensors
    assert all(tensors[n["weight"]].dtype == mx.uint32 for n in packed)


def test_predict_points_voxel_size_and_features(tmp_path: Path, rng: np.random.Generator) -> None:
    """predict_points: the stored voxel size or the one passed; a MinkUNet's
    points get their voxel's scores; declared features and classes."""
    model = MinkUNet(2, 3, widths=(4, 8)).eval()
    data.randomize_norms(model, rng)
    pts, feats = data.points(rng, 300, 3.0)
    feats = feats[:, :2]
    stored = tmp_path / "stored"
    export.export_model(
        model, stored, voxel_size=0.5, features="occupancy,height", class_names=["a", "b", "c"]
    )
    net = export.load(stored)
    assert net.features == ("occupancy", "height") and net.class_names == ("a", "b", "c")
    got = net.predict_points(pts, feats)
    # Independent voxel assignment: floor(p / size) (exact: the size is a
    # power of two), NumPy's unique rows, the points' means in float64.
    cells = np.floor(pts / 0.5).astype(np.int32)
    uniq, inverse, counts = np.unique(cells, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    sums, abs_sums = np.zeros((len(uniq), 2)), np.zeros((len(uniq), 2))
    np.add.at(sums, inverse, feats)
    np.add.at(abs_sums, inverse, np.abs(feats))
    # The voxels predict_points scores: those cells (in its own row order),
    # each the float32 mean of its m points, within gamma_{m+1} sum|x| / m of
    # the exact mean (m - 1 additions and a division, one rounding each; one
    # more where it multiplies by a rounded 1 / m).
    vox = point_cloud_input(pts, feats, 0.5).tensor
    row = {tuple(c): i for i, c in enumerate(uniq.tolist())}
    cell_of = np.array([row[tuple(c)] for c in np.array(vox.coords)[:, 1:].tolist()])
    assert sorted(cell_of) == list(range(len(uniq))) and not np.array(vox.coords)[:, 0].any()
    m = counts[cell_of][:, None]
    gamma = (m + 1) * 2.0**-24 / (1 - (m + 1) * 2.0**-24)
    err = np.abs(np.array(vox.feats, np.float64) - sums[cell_of] / m)
    assert (err <= gamma * abs_sums[cell_of] / m).all()
    # Each point gets its voxel's scores: the model's on those voxels, to the bit.
    voxel_of = np.empty(len(uniq), np.int64)
    voxel_of[cell_of] = np.arange(len(uniq))
    assert np.array_equal(np.array(got), np.array(model(vox).feats)[voxel_of[inverse]])
    assert mx.array_equal(net.predict_points(pts, feats, voxel_size=0.5), got)
    with pytest.raises(export.ExportError, match=r"exported for voxel size 0\.5, got 0\.25"):
        net.predict_points(pts, feats, voxel_size=0.25)
    with pytest.raises(
        export.ExportError, match=r"features has 3 feature channels.*occupancy,height"
    ):
        net.predict_points(pts, np.ones((300, 3), np.float32))
    with pytest.raises(export.ExportError, match=r"features must be \(300, C\)"):
        net.predict_points(pts, feats[:10])
    bare = tmp_path / "bare.mlxl"
    export.export_model(model, bare)
    assert export.load(bare).voxel_size is None
    with pytest.raises(export.ExportError, match="stores none; pass voxel_size"):
        export.load(bare).predict_points(pts, feats)
    assert mx.array_equal(export.load(bare).predict_points(pts, feats, voxel_size=0.5), got)
    spv = tmp_path / "spv.mlxl"
    export.export_model(SPVCNN(2, 3, widths=(4, 8)).eval(), spv, voxel_size=0.5)
    with pytest.raises(export.ExportError, match="scores points; call predict_points"):
        export.load(spv)(vox)
    with pytest.raises(export.ExportError, match="features has 3 names, the model has 2"):
        export.export_model(model, bare, features=["a", "b", "c"])


def test_any_path_is_written_where_asked(tmp_path: Path) -> None:
    model = MinkUNet(2, 3, widths=(4, 8))
    for name in ("net.mlxl", "net", "net.safetensors", "dir.d/net.v2"):
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        export.export_model(model, str(path) if name == "net" else path)
        assert path.is_file(), name
        assert export.load(path).model_type == "MinkUNet"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dir.d",
        "net",
        "net.mlxl",
        "net.safetensors",
    ]
    with pytest.raises(export.ExportError, match="is a directory"):
        export.export_model(model, tmp_path / "dir.d")
    with pytest.raises(export.ExportError, match="does not exist"):
        export.export_model(model, tmp_path / "missing" / "net.mlxl")
    with pytest.raises(export.ExportError, match="does not exist"):
        export.export_model(model, tmp_path / "net.mlxl" / "inside")
    with pytest.raises(export.ExportError, match="is not a file"):
        export.load(tmp_path / "dir.d")
    with pytest.raises(export.ExportError, match="is not a file"):
        export.load(tmp_path / "absent.mlxl")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_unwritable_directory(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(export.ExportError, match="not writable"):
            export.export_model(MinkUNet(2, 3, widths=(4, 8)), locked / "net.mlxl")
    finally:
        locked.chmod(0o700)


def _golden_model() -> tuple[SPVCNN, np.ndarray, np.ndarray]:
    """A small SPVCNN with every kind of layer and several quantized forms:
    w8a8 static convolutions in the encoder, int4 weight-only elsewhere,
    w8a8 dynamic point MLPs, a float head."""
    rng = np.random.default_rng(20261204)
    mx.random.seed(20261204)
    model = SPVCNN(3, 4, widths=(8, 16), depths=1)
    data.randomize_norms(model, rng)
    model.eval()
    rules = [
        qr.Rule(module_path="head", weight_qtype=None),
        qr.Rule(
            module_path="encoder/.*",
            weight_qtype="int8",
            act_qtype="int8",
            act_static_scale=True,
            tile_size=32,
        ),
        qr.Rule(module_path="point/.*", weight_qtype="int8", act_qtype="int8", tile_size=32),
        qr.Rule(weight_qtype="int4", tile_size=32),
    ]
    quantize(model, rules, allow_growth=True)
    pts = rng.uniform(0, 2.0, (120, 3)).astype(np.float32)
    feats = rng.standard_normal((120, 3)).astype(np.float32)
    calibrate_activation_scales(model, [point_cloud_input(pts, feats, VOXEL)])
    return model, pts, feats


def _write_golden() -> None:
    model, pts, feats = _golden_model()
    DATA.mkdir(exist_ok=True)
    export.export_model(
        model,
        GOLDEN,
        voxel_size=VOXEL,
        features="occupancy,height,intensity",
        class_names=["road", "car", "tree", "other"],
        metadata={"written_by": "mlx_lattice export format version 2"},
    )
    scores = model(point_cloud_input(pts, feats, VOXEL))
    np.savez(GOLDEN_EXPECTED, points=pts, feats=feats, scores=np.array(scores))


def test_committed_version_2_artifact() -> None:
    """The artifact written by format version 2 (committed) still loads and
    scores its stored points as recorded. Tolerance, not bits: the values
    were recorded on one host, and other hosts' kernels (AMX, other SIMD
    widths) may round the sums differently."""
    assert GOLDEN.stat().st_size < 64_000
    net = export.load(GOLDEN)
    assert net.graph["version"] == 2 and net.model_type == "SPVCNN"
    assert net.features == ("occupancy", "height", "intensity")
    assert net.class_names == ("road", "car", "tree", "other") and net.voxel_size == VOXEL
    assert net.metadata == {"written_by": "mlx_lattice export format version 2"}
    forms = {
        (n["quant"]["bits"], n["quant"]["act_bits"], n["quant"]["act_static"])
        for n in net.graph["nodes"]
        if "quant" in n
    }
    assert forms == {(4, None, False), (8, 8, True), (8, 8, False)}
    with np.load(GOLDEN_EXPECTED) as case:
        got = np.array(net.predict_points(case["points"], case["feats"]))
        np.testing.assert_allclose(got, case["scores"], rtol=1e-4, atol=1e-4)
        assert np.abs(case["scores"]).max() > 0.1  # not a degenerate all-zero reference


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


def test_trained_model_round_trip(tmp_path: Path, rng: np.random.Generator) -> None:
    """A MinkUNet after a few training steps (running statistics updated)
    and its artifact agree bit for bit on other coordinates."""
    model = MinkUNet(3, 4, widths=(8, 16, 16), depths=(1, 2, 1))
    opt = optim.SGD(learning_rate=0.05)
    pts, feats = data.points(rng, 600, 3.0)
    inp = point_cloud_input(pts, feats, VOXEL)
    labels = mx.array(rng.integers(0, 4, inp.tensor.num_points).astype(np.int32))
    model.train()
    for _ in range(3):
        train_step(model, opt, inp.tensor, labels)
    model.eval()
    path = tmp_path / "trained.mlxl"
    export.export_model(model, path, metadata={"trained": "3 SGD steps"})
    net = export.load(path)
    assert net.metadata == {"trained": "3 SGD steps"}
    x = point_cloud_input(*data.points(rng, 900, 4.0), VOXEL).tensor
    got, want = net(x), model(x)
    assert np.array_equal(np.array(got.coords), np.array(want.coords))
    assert np.array_equal(np.array(got.feats.view(mx.uint32)), np.array(want.feats.view(mx.uint32)))


def test_export_rejects_layers_outside_the_vocabulary(tmp_path: Path) -> None:
    from mlx_lattice import nn

    path = tmp_path / "unused.mlxl"
    model = MinkUNet(2, 3, widths=(4, 8))
    model.stem.conv = nn.NormalizedSubMConv3d(2, 4, bias=False)
    with pytest.raises(export.ExportError, match=r"stem\.conv: NormalizedSubMConv3d is not in"):
        export.export_model(model, path)
    with pytest.raises(export.ExportError, match="must be a MinkUNet or an SPVCNN, got Linear"):
        export.export_model(nn.Linear(2, 3), path)
    model = MinkUNet(32, 3, widths=(32, 32))
    quantize(
        model,
        qr.Rule(
            weight_qtype="int8",
            act_qtype="int8",
            act_static_scale=True,
            tile_size=32,
            op_names=("sparse_conv",),
        ),
    )
    with pytest.raises(export.ExportError, match=r"stem\.conv: its static activation scale"):
        export.export_model(model, path)
    assert not path.exists()
    assert not list(tmp_path.iterdir())  # no temporary file left behind


def _rewrite(path: Path, out: Path, edit, *, digest: bool = True) -> Path:
    """``path`` with ``edit(tensors, graph)`` applied, written to ``out``
    (a ``.safetensors`` name: MLX's writer appends the suffix otherwise),
    with a matching digest unless ``digest`` is false."""
    tensors, meta = mx.load(str(path), format="safetensors", return_metadata=True)
    graph = json.loads(meta[export.FORMAT])
    tensors, graph = edit(tensors, graph)
    text = json.dumps(graph)
    meta = {export.FORMAT: text}
    if digest:
        meta[export.DIGEST_KEY] = export._digest(text, tensors)
    mx.save_safetensors(str(out), tensors, metadata=meta)
    return out


def test_load_rejects_malformed_artifacts(tmp_path: Path) -> None:
    path = tmp_path / "net.mlxl"
    model = SPVCNN(2, 3, widths=(32, 32))
    quantize(model, qr.Rule(weight_qtype="int4", tile_size=32), allow_growth=True)
    export.export_model(model, path)
    graph = export.load(path).graph
    first_quant = next(i for i, n in enumerate(graph["nodes"]) if "quant" in n)
    first_add = next(i for i, n in enumerate(graph["nodes"]) if n["op"] == "add")

    def edit_node(i, **changes):
        def edit(t: dict, g: dict) -> tuple[dict, dict]:
            g["nodes"][i].update(changes)
            return t, g

        return edit

    def missing_tensor(t: dict, g: dict) -> tuple[dict, dict]:
        del t["head.weight"]
        return t, g

    def version(t: dict, g: dict) -> tuple[dict, dict]:
        g["version"] = 99
        return t, g

    def bits(t: dict, g: dict) -> tuple[dict, dict]:
        g["nodes"][first_quant]["quant"]["bits"] = 8
        return t, g

    def short_weight(t: dict, g: dict) -> tuple[dict, dict]:
        t["stem.conv.weight"] = t["stem.conv.weight"][:, :1]
        return t, g

    def wrong_width(t: dict, g: dict) -> tuple[dict, dict]:
        n = g["nodes"][2]  # the stem's norm
        for key in ("weight", "bias", "running_mean", "running_var"):
            t[n[key]] = t[n[key]][:-1]
        n["num_features"] -= 1
        return t, g

    cases = [
        (edit_node(1, op="attention"), "node 1 has op 'attention'"),
        (missing_tensor, "needs tensor 'head.weight'"),
        (version, "graph version 99; this mlx_lattice reads versions 1, 2"),
        (edit_node(0, inputs=["nowhere"]), "reads 'nowhere' before"),
        (bits, r"tensor 'stem\.conv\.weight' \(weight\) has shape"),
        (short_weight, r"has shape \(27, 1, 4\), expected \(27, 32, 4\)"),
        (wrong_width, r"node 2 \(batch_norm\): reads 32 channels, its tensors take 31"),
        (
            edit_node(first_add, inputs=[graph["nodes"][first_add]["inputs"][0], "v2"]),
            "reads voxels, expected points",
        ),
        (edit_node(1, kernel_size=[3, 3, 9]), "kernel_size"),
    ]
    for i, (edit, match) in enumerate(cases):
        bad = _rewrite(path, tmp_path / f"bad{i}.safetensors", edit)
        with pytest.raises(export.ExportError, match=match):
            export.load(bad)
    # A changed graph or tensor without a matching digest: damaged or edited.
    bad = _rewrite(path, tmp_path / "edited.safetensors", edit_node(2, eps=0.5), digest=False)
    with pytest.raises(export.ExportError, match="digest does not match"):
        export.load(bad)
    data = path.read_bytes()
    (tmp_path / "flipped.mlxl").write_bytes(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])
    with pytest.raises(export.ExportError, match="digest does not match"):
        export.load(tmp_path / "flipped.mlxl")
    (tmp_path / "cut.mlxl").write_bytes(data[: len(data) // 2])
    with pytest.raises(export.ExportError, match="cannot read"):
        export.load(tmp_path / "cut.mlxl")
    plain = tmp_path / "plain.safetensors"
    mx.save_safetensors(str(plain), {"w": mx.ones(2)})
    with pytest.raises(export.ExportError, match=r"no 'mlx_lattice\.graph' metadata"):
        export.load(plain)
    (tmp_path / "junk.mlxl").write_bytes(b"not a file")
    with pytest.raises(export.ExportError, match="cannot read"):
        export.load(tmp_path / "junk.mlxl")
    for key in (export.FORMAT, export.DIGEST_KEY):
        with pytest.raises(export.ExportError, match="reserved"):
            export.export_model(MinkUNet(2, 3, widths=(4, 8)), path, metadata={key: "x"})


def test_reads_version_1_files(tmp_path: Path, rng: np.random.Generator) -> None:
    """A version 1 graph (float MinkUNet, no digest, no channel counts) as
    the previous release wrote it still loads and runs."""
    model = MinkUNet(2, 3, widths=(4, 8)).eval()
    path = tmp_path / "v2.mlxl"
    export.export_model(model, path)

    def as_v1(t: dict, g: dict) -> tuple[dict, dict]:
        for key in (
            "input_kind",
            "in_channels",
            "num_classes",
            "voxel_size",
            "features",
            "class_names",
        ):
            del g[key]
        for n in g["nodes"]:
            n.pop("in_channels", None)
            n.pop("out_channels", None)
        g["version"] = 1
        return t, g

    v1 = _rewrite(path, tmp_path / "v1.safetensors", as_v1, digest=False)
    pts, feats = data.points(rng, 200, 2.0)
    x = point_cloud_input(pts, feats[:, :2], VOXEL).tensor
    assert mx.array_equal(export.load(v1)(x).feats, model(x).feats)


if __name__ == "__main__":
    _write_golden()
