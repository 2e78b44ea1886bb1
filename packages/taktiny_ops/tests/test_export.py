"""jax.export artifacts, for PTQ int8 weight-only, int4 weight-only and w8a8
rule sets at two batch sizes.

- In this process, :func:`load_model` returns bit for bit what the model
  returns in one jitted program (same backend, same matmul precision).
- A fresh process that imports only JAX and NumPy (never taktiny_ops,
  quantrules, qwix or flax) loads the file with the documented loader on the
  CPU (``JAX_PLATFORMS=cpu``: a test process on a TPU holds the chip). Where
  this process runs on the CPU too, the outputs are bit for bit the same;
  elsewhere (exported on a TPU, run on the CPU) they are within the
  cross-backend bound of ``_cross_backend_bound`` (derived there).
- The committed artifact (written by an earlier version: CPU only, default
  precision) still loads; damaged files raise ArtifactError.
- A ``kernels='pallas'`` model exports for the TPU (from this CPU host too)
  with a symbolic batch; with 'cpu' among the platforms an ArtifactError
  names its Pallas layers.

Regenerate the committed artifact with ``python tests/test_export.py OUT``.
"""

import io
import json
import os
import pathlib
import subprocess
import sys
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

import quantrules as qr
import taktiny_ops as tk

SEED = 33
COMMITTED = pathlib.Path(__file__).parent / "data" / "small_head_int8.tkjax"
RULE_SETS = {
    "int8": [qr.Rule(weight_qtype="int8")],
    "int4": [qr.Rule(op_names=("conv_general_dilated",), weight_qtype="int8"),
             qr.Rule(weight_qtype="int4")],
    "w8a8": [qr.Rule(weight_qtype="int8", act_qtype="int8")],
}


class Head(nnx.Module):
    """A small head with each layer kind: input (batch, 8, 16)."""

    def __init__(self, rngs):
        self.fc = tk.Linear(16, 24, rngs=rngs)
        self.mix = nnx.Einsum("btd,dh->bth", (24, 16), (16,), rngs=rngs)
        self.conv = tk.Conv(16, 8, (3,), strides=2, rngs=rngs)
        self.out = nnx.Linear(8, 5, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.gelu(self.fc(x))
        h = self.conv(self.mix(h))
        return self.out(jax.nn.relu(h))


def small_model(rules, seed=SEED, kernels="qwix"):
    model = Head(nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and var.ndim == 1:  # non-zero biases
            var.set_value(jnp.asarray(rng.standard_normal(var.shape), jnp.float32))
    report = tk.quantize(model, rules, kernels=kernels)
    return model, report


def _inputs(batch, seed):
    rng = np.random.default_rng(seed)
    return np.asarray(rng.standard_normal((batch, 8, 16)), np.float32)


def _jit(model, x):
    """The model in one jitted program, at the precision export_model fixes."""
    with jax.default_matmul_precision("highest"):
        return np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(x)))


def _dequantized(layer):
    kernel = layer.kernel.get_value()
    return np.asarray(qwix.dequantize(kernel) if isinstance(kernel, qwix.QArray) else kernel,
                      np.float64)


# Each layer's activation absmax axes under Qwix's calibration: dot_general
# and einsum keep every non-contracting axis (per token: the absmax runs over
# the last, contracted axis); conv_general_dilated keeps only the batch axis
# (the absmax runs over width and features of NWC).
ACT_AXES = {"fc": (-1,), "mix": (-1,), "conv": (1, 2), "out": (-1,)}


def _cross_backend_bound(model, x, rules, bound, conv64):
    """Elementwise bound of |Head(x) in one program - Head(x) in another|
    (another backend, or op by op against one jitted program).

    Both run the same module on the same stored weights (so no weight
    rounding can differ), chained layer by layer with the conftest's
    two-program bound and the input error e each layer receives. A layer with
    activation quantization rounds an activation to another level only where
    a / s lies within a few ulps (plus e / s) of a rounding boundary, judged
    in float64 from this test's inputs (the bound's ``x_axes``: the derivation
    is the conftest's ``_moved``); each such value moves the layer's output by
    one step times |w|, every other value only by the scale's ulps, and every
    float32 sum may round differently (the accumulation term). Between the
    layers: relu is 1-Lipschitz; gelu's slope is at most 1.13 and the two
    backends' tanh-based gelu may differ by 2^-20 of its value (16 ulps).
    The biases add a rounding of half an ulp of |y|. The intermediates are
    this backend's, from one jitted program (itself within e of each program
    compared, which the window allows for)."""
    def parts(m, x):
        a1 = m.fc(x)
        a2 = m.mix(jax.nn.gelu(a1))
        a3 = m.conv(a2)
        return a1, a2, a3, m.out(jax.nn.relu(a3))

    with jax.default_matmul_precision("highest"):
        a1, a2, a3, _ = (np.asarray(a, np.float64) for a in nnx.jit(parts)(model, jnp.asarray(x)))
    x = np.asarray(x, np.float64)

    def act_only(path, op):
        res = qr.resolve(rules, module_path=path, op=op)
        rule = None if res is None or res.disabled else res.rule
        return qr.Rule(act_qtype=rule.act_qtype) if rule and rule.act_qtype else None

    def bias(layer):
        return 2**-23 * np.abs(np.asarray(layer.bias.get_value(), np.float64))

    e = bound(np.matmul, x, _dequantized(model.fc), act_only("fc", "dot_general"),
              x_axes=ACT_AXES["fc"]) + bias(model.fc)
    g = np.asarray(jax.nn.gelu(jnp.asarray(a1)), np.float64)
    e = 1.13 * e + 2**-20 * np.abs(g)
    e = bound(lambda a, b: np.einsum("btd,dh->bth", a, b), g, _dequantized(model.mix),
              act_only("mix", "einsum"), e, x_axes=ACT_AXES["mix"]) + bias(model.mix)
    e = bound(lambda a, b: conv64(a, b, (2,), ("NWC", "WIO", "NWC")), a2,
              _dequantized(model.conv), act_only("conv", "conv_general_dilated"), e,
              x_axes=ACT_AXES["conv"]) + bias(model.conv)
    return bound(np.matmul, np.maximum(a3, 0), _dequantized(model.out),
                 act_only("out", "dot_general"), e, x_axes=ACT_AXES["out"]) + bias(model.out)


CHILD = """
import sys
import numpy as np
{loader}
run = load(sys.argv[1])
for i, name in enumerate(sys.argv[2:]):
    np.save(name.replace(".in", ".out"), np.asarray(run(np.load(name))))
banned = [m for m in ("taktiny_ops", "quantrules", "qwix", "flax") if m in sys.modules]
assert not banned, f"the loader imported {{banned}}"
"""


def _load_elsewhere(path, inputs, tmp_path):
    """Run the documented loader in a fresh interpreter on each input."""
    names = []
    for i, x in enumerate(inputs):
        name = tmp_path / f"x{i}.in.npy"
        np.save(name, x)
        names.append(str(name))
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(loader=tk.LOADER))
    env = {k: v for k, v in os.environ.items() if k != "TAKTINY_OPS_EAGER_JIT"}
    env["JAX_PLATFORMS"] = "cpu"  # the test process may hold an accelerator
    done = subprocess.run([sys.executable, str(script), str(path), *names], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [np.load(name.replace(".in.npy", ".out.npy")) for name in names]


def _same_or_within(name, model, x, y, expected, bound, conv64):
    """Bit for bit on the same backend; within the cross-backend bound elsewhere."""
    assert y.dtype == expected.dtype and y.shape == expected.shape == (len(x), 4, 5)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(y, expected)
    else:
        limit = _cross_backend_bound(model, x, RULE_SETS[name], bound, conv64)
        err = np.abs(y.astype(np.float64) - expected)
        assert (err <= limit).all(), (float(err.max()), float((limit - err).min()))


@pytest.mark.parametrize("name", list(RULE_SETS))
def test_artifact_in_plain_jax_process_bitwise_equals_jit(name, tmp_path, cross_program_bound,
                                                          conv64):
    print(f"seed {SEED}")
    model, report = small_model(RULE_SETS[name])
    assert len(report.quantized) == 4
    path = tmp_path / f"head-{name}.tkjax"
    size = tk.export_model(model, _inputs(2, 0), path)
    assert size == path.stat().st_size
    inputs = [_inputs(3, 1), _inputs(11, 2)]
    outputs = _load_elsewhere(path, inputs, tmp_path)
    loaded = tk.load_model(path)
    for x, y in zip(inputs, outputs, strict=True):
        expected = _jit(model, x)
        # In this process (this backend) the artifact is the model's program.
        np.testing.assert_array_equal(np.asarray(loaded(x)), expected)
        # On the CPU, in a plain-JAX process.
        _same_or_within(name, model, x, y, expected, cross_program_bound, conv64)
        # The bound holds for any two programs: here the eager model (one
        # cached jit per layer) against the whole jitted one.
        with jax.default_matmul_precision("highest"):
            eager = np.asarray(model(jnp.asarray(x)), np.float64)
        limit = _cross_backend_bound(model, x, RULE_SETS[name], cross_program_bound, conv64)
        assert (np.abs(eager - expected) <= limit).all()


def test_cross_backend_bound_fails_on_one_planted_step(cross_program_bound):
    """The w8a8 bound grants a step only to activations near a rounding
    boundary: on the first layer (fc, whose input is exact in both programs)
    the op-by-op run passes, and one quantization step added to an output of
    a row with no near value (its absmax positive: the clip merges 127.5;
    Gaussian inputs put nothing else within ulps of a boundary) fails.

    Through the whole head the bound stays loose: a row whose absmax is
    negative lies exactly on the boundary -127.5 (-128 or -127), so fc's
    output may move by a step there, which widens every later layer's window."""
    model, _ = small_model(RULE_SETS["w8a8"])
    x = _inputs(11, 2)
    with jax.default_matmul_precision("highest"):
        expected = np.asarray(nnx.jit(lambda m, x: m.fc(x))(model, jnp.asarray(x)), np.float64)
        eager = np.asarray(model.fc(jnp.asarray(x)), np.float64)
    w = _dequantized(model.fc)
    limit = cross_program_bound(np.matmul, x, w, qr.Rule(act_qtype="int8"), x_axes=(-1,))
    limit = limit + 2**-23 * np.abs(np.asarray(model.fc.bias.get_value(), np.float64))
    assert (np.abs(eager - expected) <= limit).all()
    x64 = np.asarray(x, np.float64)
    rows = np.argwhere(x64.max(-1) > -x64.min(-1))  # absmax positive
    b, t = rows[0]
    step = np.abs(x64[b, t]).max() / 127.5 * np.abs(w[:, 0]).max()
    planted = eager.copy()
    planted[b, t, 0] += step
    assert np.abs(planted - expected)[b, t, 0] > limit[b, t, 0], (step, limit[b, t, 0])


def test_artifact_records_platforms_and_fixes_the_matmul_precision(tmp_path):
    model, _ = small_model(RULE_SETS["int8"])
    texts = {}
    for precision in ("highest", "default"):
        path = tmp_path / f"{precision}.tkjax"
        tk.export_model(model, _inputs(2, 0), path, matmul_precision=precision)
        with np.load(path) as z:
            meta = json.loads(z["meta"].tobytes())
            exported = jax.export.deserialize(bytearray(z["module"].tobytes()))
        assert meta["platforms"] == ["cpu", "tpu"] and meta["matmul_precision"] == precision
        assert tuple(exported.platforms) == ("cpu", "tpu")
        texts[precision] = exported.mlir_module()
    # The weight-only head's float matmuls carry the precision in the module.
    assert "precision HIGHEST" in texts["highest"]
    assert "precision HIGHEST" not in texts["default"]


def test_export_for_another_platform_only_and_bad_arguments(tmp_path):
    model, _ = small_model(RULE_SETS["w8a8"])
    other = "cpu" if jax.default_backend() != "cpu" else "tpu"
    path = tmp_path / "other.tkjax"
    tk.export_model(model, _inputs(2, 0), path, platforms=(other,))
    with pytest.raises(tk.ArtifactError, match=rf"lowered for {other}; this process runs"):
        tk.load_model(path)
    for bad in ("cpu", (), ("cpu", 3)):
        with pytest.raises(tk.TaktinyOpsError, match=r"^platforms: expected"):
            tk.export_model(model, _inputs(2, 0), path, platforms=bad)
    with pytest.raises(tk.TaktinyOpsError, match=r"^matmul_precision: expected one of"):
        tk.export_model(model, _inputs(2, 0), path, matmul_precision="fastest")


@pytest.mark.parametrize("name", ["int8", "w8a8"])
def test_a_pallas_model_exports_for_the_tpu_with_a_symbolic_batch(name, tmp_path):
    """kernels='pallas' layers lower to Mosaic on any host (jax.export lowers
    for the TPU without a chip; Mosaic compiles on the chip): the artifact
    keeps the batch symbolic and records the kernels' TPU custom calls. With
    'cpu' among the platforms the export says which layers cannot travel."""
    model, report = small_model(RULE_SETS[name], kernels="pallas")
    pallas = sorted(row.path for row in report.layers if row.kernel.startswith("pallas"))
    assert pallas, report
    path = tmp_path / "pallas.tkjax"
    assert tk.export_model(model, _inputs(2, 0), path, platforms=("tpu",)) > 0
    with np.load(path) as z:
        meta = json.loads(z["meta"].tobytes())
        exported = jax.export.deserialize(bytearray(z["module"].tobytes()))
    assert exported.platforms == ("tpu",) and meta["platforms"] == ["tpu"]
    assert sorted(layer["path"] for layer in meta["layers"]
                  if layer["kernel"].startswith("pallas")) == pallas
    (x_aval,), (y_aval,) = exported.in_avals[-1:], exported.out_avals
    assert (str(x_aval.shape), x_aval.dtype) == ("(batch, 8, 16)", jnp.float32)
    assert (str(y_aval.shape), y_aval.dtype) == ("(batch, 4, 5)", jnp.float32)
    text = exported.mlir_module()
    kernel = {"int8": "taktiny_weight_only_matmul", "w8a8": "taktiny_w8a8_matmul"}[name]
    assert text.count("stablehlo.custom_call @tpu_custom_call") >= len(pallas)
    assert kernel in text
    layers = ", ".join(f"{p} \\(pallas-[a-z0-9-]+\\)" for p in pallas)
    with pytest.raises(tk.ArtifactError, match=(
            rf"^platforms: cannot lower for cpu, tpu: layer\(s\) {layers} run a Pallas TPU "
            rf"kernel, which cannot lower for cpu .*export with platforms=\('tpu',\) or "
            rf"quantize with kernels='qwix'")):
        tk.export_model(model, _inputs(2, 0), tmp_path / "p.tkjax")


def test_artifact_holds_packed_quantized_weights(tmp_path):
    model, _ = small_model(RULE_SETS["int4"])
    path = tmp_path / "head.tkjax"
    tk.export_model(model, _inputs(2, 0), path)
    with np.load(path) as z:
        meta = json.loads(z["meta"].tobytes())
        weights = {w["name"]: w for w in meta["weights"]}
        packed = [w for w in weights.values() if w["encoding"] == "nibbles"]
        assert [w["dtype"] for w in packed] == ["int4"] * 3  # fc, mix, out kernels
        for w in packed:
            assert z[w["name"]].size == (int(np.prod(w["shape"])) + 1) // 2
        fc = model.fc.kernel.get_value()
        fc_spec = next(w for w in packed if w["shape"] == list(fc.qvalue.shape))
        unpacked = np.stack([z[fc_spec["name"]] & 15, z[fc_spec["name"]] >> 4], -1)
        values = ((unpacked.reshape(-1).astype(np.int8) ^ 8) - 8)[: fc.qvalue.size]
        np.testing.assert_array_equal(values.reshape(fc.qvalue.shape),
                                      np.asarray(fc.qvalue).astype(np.int8))
    assert meta["input"] == {"shape": [None, 8, 16], "dtype": "float32", "batch_axis": 0}
    assert [layer["path"] for layer in meta["layers"]] == ["conv", "fc", "mix", "out"]


def test_committed_artifact_loads_and_matches_the_model(tmp_path, cross_program_bound, conv64):
    """Written before artifacts named their platforms: CPU only, the CPU's
    float32 matmuls. The CPU runs it as the model; a TPU process is told."""
    assert COMMITTED.stat().st_size < 64 * 1024
    model, _ = small_model(RULE_SETS["int8"])
    x = _inputs(6, 3)
    (y,) = _load_elsewhere(COMMITTED, [x], tmp_path)
    _same_or_within("int8", model, x, y, _jit(model, x), cross_program_bound, conv64)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(tk.load_model(COMMITTED)(x)), y)
    else:
        with pytest.raises(tk.ArtifactError, match=r"lowered for cpu; this process runs"):
            tk.load_model(COMMITTED)


def _rewrite(src, dst, change):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = change(item.filename, zin.read(item.filename))
            if data is not None:
                zout.writestr(item, data)


def _meta_with(**fields):
    """A member rewrite that changes fields of the JSON in ``meta``."""

    def change(name, data):
        if name != "meta.npy":
            return data
        meta = json.loads(np.load(io.BytesIO(data)).tobytes())
        meta.update(fields)
        out = io.BytesIO()
        np.save(out, np.frombuffer(json.dumps(meta).encode(), np.uint8))
        return out.getvalue()

    return change


def test_damaged_files_raise_artifact_error(tmp_path):
    good = COMMITTED.read_bytes()
    cases = {
        "truncated": good[: len(good) // 2],
        "not a zip": b"hello" * 100,
        "empty": b"",
    }
    for member in (b"w1.npy", b"module.npy"):  # a byte inside each compressed member
        flipped = bytearray(good)
        flipped[good.index(member) + 120] ^= 0xFF
        cases[f"flipped byte in {member.decode()}"] = bytes(flipped)
    for label, data in cases.items():
        path = tmp_path / f"{label}.tkjax"
        path.write_bytes(data)
        with pytest.raises(tk.ArtifactError, match=r"damaged|not a taktiny_ops"):
            tk.load_model(path)
    version = tmp_path / "version.tkjax"
    _rewrite(COMMITTED, version, _meta_with(version=2))
    with pytest.raises(tk.ArtifactError, match=r"format version 2; this taktiny_ops reads version 1"):
        tk.load_model(version)
    foreign = tmp_path / "foreign.tkjax"
    _rewrite(COMMITTED, foreign, _meta_with(format="something.else"))
    with pytest.raises(tk.ArtifactError, match=r"not a taktiny_ops JAX artifact"):
        tk.load_model(foreign)
    missing = tmp_path / "missing.tkjax"
    _rewrite(COMMITTED, missing, lambda name, data: None if name == "w0.npy" else data)
    with pytest.raises(tk.ArtifactError, match=r"weight 'w0' is missing"):
        tk.load_model(missing)
    with pytest.raises(FileNotFoundError):
        tk.load_model(tmp_path / "nothing-here.tkjax")


def test_export_rejects_a_bad_batch_axis(tmp_path):
    model, _ = small_model(RULE_SETS["int8"])
    with pytest.raises(tk.TaktinyOpsError, match=r"^batch_axis: 3 is not an axis"):
        tk.export_model(model, _inputs(2, 0), tmp_path / "x.tkjax", batch_axis=3)


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    model, report = small_model(RULE_SETS["int8"])
    print(report)
    print(f"wrote {tk.export_model(model, _inputs(2, 0), out)} bytes to {out}")
