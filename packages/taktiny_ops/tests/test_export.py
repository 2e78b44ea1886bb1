"""jax.export artifacts: a fresh process that imports only JAX and NumPy
(never taktiny_ops, quantrules, qwix or flax) loads the file with the
documented loader and returns bitwise what the in-process jitted model
returns, for PTQ int8 weight-only, int4 weight-only and w8a8 rule sets at two
batch sizes; the committed artifact loads; damaged files raise ArtifactError.

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


def small_model(rules, seed=SEED):
    model = Head(nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and var.ndim == 1:  # non-zero biases
            var.set_value(jnp.asarray(rng.standard_normal(var.shape), jnp.float32))
    report = tk.quantize(model, rules)
    return model, report


def _inputs(batch, seed):
    rng = np.random.default_rng(seed)
    return np.asarray(rng.standard_normal((batch, 8, 16)), np.float32)


def _jit(model, x):
    return np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(x)))


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
    done = subprocess.run([sys.executable, str(script), str(path), *names], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [np.load(name.replace(".in.npy", ".out.npy")) for name in names]


@pytest.mark.parametrize("name", list(RULE_SETS))
def test_artifact_in_plain_jax_process_bitwise_equals_jit(name, tmp_path):
    print(f"seed {SEED}")
    model, report = small_model(RULE_SETS[name])
    assert len(report.quantized) == 4
    path = tmp_path / f"head-{name}.tkjax"
    size = tk.export_model(model, _inputs(2, 0), path)
    assert size == path.stat().st_size
    inputs = [_inputs(3, 1), _inputs(11, 2)]
    outputs = _load_elsewhere(path, inputs, tmp_path)
    for x, y in zip(inputs, outputs, strict=True):
        expected = _jit(model, x)
        assert y.dtype == expected.dtype and y.shape == expected.shape == (len(x), 4, 5)
        np.testing.assert_array_equal(y, expected)
    # load_model (the same loader, with checks) agrees in this process too.
    np.testing.assert_array_equal(np.asarray(tk.load_model(path)(inputs[1])), outputs[1])


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


def test_committed_artifact_loads_and_matches_the_model(tmp_path):
    assert COMMITTED.stat().st_size < 64 * 1024
    model, _ = small_model(RULE_SETS["int8"])
    x = _inputs(6, 3)
    (y,) = _load_elsewhere(COMMITTED, [x], tmp_path)
    np.testing.assert_array_equal(y, _jit(model, x))
    np.testing.assert_array_equal(np.asarray(tk.load_model(COMMITTED)(x)), y)


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
