"""Benchmark: exported artifacts (mlx_lattice.export) against the in-process models.

One run, one machine, the built-in LiDAR scan (~136k points). For MinkUNet
and SPVCNN, float and in every form ``mlx_lattice.quantize`` produces
(int8 and int4 weight-only, w8a8 and w4a8 with dynamic activation scales,
w8a8 with calibrated static scales), per artifact:

* its size in bytes (and as a share of the float artifact of that model);
* load time (``export.load``: read, digest, checks, layers built), median;
* run time of the artifact's interpreter against the in-process ``eval()``
  model on the same input, as the overhead ``artifact / model - 1`` (goal:
  at most 5%). ``points``: a new point set each call (voxelization, the
  point-voxel maps and every kernel relation built in the call), the
  artifact's ``predict_points`` against ``point_cloud_input`` and the
  model; ``voxels`` (MinkUNet): the same sparse tensor again (relations
  cached), ``net(x)`` against ``model(x)``. The overhead is the median of
  ``--pairs`` ratios, each of a model call and an artifact call run back
  to back (alternating which goes first), so a change of machine speed
  between pairs cancels; the times shown are medians;
* ``dispatch``: the interpreter's own cost, the time to build the lazy
  graph through the artifact minus through the model (relations cached, no
  kernel runs), as a share of the model's evaluated call: the overhead the
  artifact adds without the load noise of the kernels it shares with the
  model;
* whether the outputs are the same bits;
* the compiled graph (``export.load(path, compiled=True)``, see
  :func:`mlx_lattice.compile`: norms folded into the layers, bias and ReLU
  as one epilogue): its load time and its ``points`` call against the
  model's, as a speed-up ``model / compiled`` (median of ``--pairs``
  back-to-back ratios, as the overhead).

Pass ``--quick`` for a small scan and model (a smoke run).
"""

from __future__ import annotations

import itertools
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
from absl import flags

import mlx_lattice
import quantrules as qr
from benchmarks.host_class import host_class_line
from benchmarks.timing import median_s
from examples import cli
from mlx_lattice import export
from mlx_lattice.data import HEIGHT_SCALE, SceneConfig, labelled_scans
from mlx_lattice.models import SPVCNN, MinkUNet, point_cloud_input

WIDTHS = (32, 64, 96, 128)
VOXEL = 0.05
CLASSES = 5
_STATIC = qr.Rule(
    op_names=("sparse_conv",),
    weight_qtype="int8",
    act_qtype="int8",
    act_static_scale=True,
    tile_size=32,
)
FORMS: dict[str, list[qr.Rule] | None] = {
    "float": None,
    "int8": [qr.Rule(weight_qtype="int8", tile_size=32)],
    "int4": [qr.Rule(weight_qtype="int4", tile_size=32)],
    "w8a8": [qr.Rule(weight_qtype="int8", act_qtype="int8", tile_size=32)],
    "w4a8": [qr.Rule(weight_qtype="int4", act_qtype="int8", tile_size=32)],
    "w8a8-static": [_STATIC, qr.Rule(weight_qtype="int8", act_qtype="int8", tile_size=32)],
}

_QUICK = flags.DEFINE_boolean("quick", False, "a small scan and model (smoke run)")
_PAIRS = flags.DEFINE_integer(
    "pairs", 9, "timed (model, artifact) pairs per case, back to back", lower_bound=1
)
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed loads per median", lower_bound=1)
_MODELS = flags.DEFINE_string("models", "MinkUNet,SPVCNN", "comma-separated models to run")
_FORMS = flags.DEFINE_string("forms", ",".join(FORMS), "comma-separated quantization forms")


def _features(points: np.ndarray) -> np.ndarray:
    """Occupancy and height, as the saved models take them."""
    return np.stack([np.ones(len(points)), points[:, 2] / HEIGHT_SCALE], 1).astype(np.float32)


def _paired(model_fn: Callable[[], object], artifact_fn: Callable[[], object], pairs: int
            ) -> tuple[float, float, float]:
    """Median model and artifact seconds, and the median of the per-pair
    ratios artifact / model: each pair runs the two back to back (in
    alternating order), so a change of machine speed between pairs moves
    both of a pair and cancels in its ratio."""
    model_fn(), artifact_fn()  # warm-up
    tm, ta, ratios = [], [], []
    for i in range(pairs):
        order = (model_fn, artifact_fn) if i % 2 == 0 else (artifact_fn, model_fn)
        took = {}
        for fn in order:
            start = time.perf_counter()
            fn()
            took[fn] = time.perf_counter() - start
        tm.append(took[model_fn])
        ta.append(took[artifact_fn])
        ratios.append(took[artifact_fn] / took[model_fn])
    return statistics.median(tm), statistics.median(ta), statistics.median(ratios)


def _dispatch(model_fn: Callable[[], mx.array], artifact_fn: Callable[[], mx.array]) -> float:
    """The interpreter's own cost: the time to build the lazy graph (relations
    and point-voxel maps cached, so no kernel runs) through the artifact minus
    through the model, as a share of the model's whole evaluated call. The
    kernels are the same (the outputs are the same bits), so this is the
    overhead the artifact adds, measured without the kernels' load noise."""
    mx.eval(model_fn())
    mx.eval(artifact_fn())
    build_m, build_a, whole = [], [], []
    for _ in range(7):
        start = time.perf_counter()
        out = model_fn()
        build_m.append(time.perf_counter() - start)
        mx.eval(out)
        whole.append(time.perf_counter() - start)
        start = time.perf_counter()
        out = artifact_fn()
        build_a.append(time.perf_counter() - start)
        mx.eval(out)
    diff = statistics.median(build_a) - statistics.median(build_m)
    return diff / statistics.median(whole)


def _same_bits(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b))


def main(argv: Sequence[str] | None = None) -> None:
    cli.parsed(argv)
    print(host_class_line())
    quick = _QUICK.value
    mlx_lattice.retain_freed_memory()
    widths = (8, 16, 16) if quick else WIDTHS
    voxel = 0.25 if quick else VOXEL
    config = SceneConfig(beams=16, azimuth_steps=512) if quick else None
    scans = labelled_scans(3, 0, seed=0, config=config).train
    calib, *runs = [s.points.astype(np.float32) for s in scans]
    load = os.getloadavg()
    print(
        f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores; "
        f"load average {load[0]:.2f}; {len(runs[0])} points, voxel {voxel} m, widths {widths}"
    )
    models = [m.strip() for m in _MODELS.value.split(",") if m.strip()]
    forms = [f.strip() for f in _FORMS.value.split(",") if f.strip()]
    for name in forms:
        if name not in FORMS:
            raise SystemExit(f"--forms: unknown form {name!r}; known: {', '.join(FORMS)}")
    header = (
        f"{'model':9s} {'form':12s} {'bytes':>10s} {'vs float':>8s} {'load ms':>8s} "
        f"{'points: model ms':>16s} {'artifact':>8s} {'overhead':>8s} "
        f"{'voxels: model ms':>16s} {'overhead':>8s} {'dispatch':>9s} {'same bits':>9s} "
        f"{'compiled: load ms':>17s} {'ms':>7s} {'speed-up':>8s}"
    )
    print(header)
    tmp = Path(tempfile.mkdtemp(prefix="deploy_bench_"))
    for arch in models:
        cls = {"MinkUNet": MinkUNet, "SPVCNN": SPVCNN}.get(arch)
        if cls is None:
            raise SystemExit(f"--models: unknown model {arch!r} (MinkUNet, SPVCNN)")
        float_bytes = None
        for form in forms:
            mx.random.seed(0)
            model = cls(2, CLASSES, widths).eval()
            if FORMS[form] is not None:
                mlx_lattice.quantize(model, FORMS[form])
            if form.endswith("static"):
                inp = point_cloud_input(calib, _features(calib), voxel)
                mlx_lattice.calibrate_activation_scales(
                    model, [inp if arch == "SPVCNN" else inp.tensor]
                )
            path = tmp / f"{arch}-{form}.mlxl"
            export.export_model(model, path, voxel_size=voxel, features="occupancy,height")
            size = path.stat().st_size
            float_bytes = float_bytes or (size if form == "float" else None)
            load_s = median_s(lambda path=path: export.load(path), _REPEATS.value)
            net = export.load(path)
            calls = itertools.count()

            def fresh(calls=calls) -> tuple[np.ndarray, np.ndarray]:
                # A new point set each call: another scan, moved by a few mm.
                k = next(calls)
                pts = runs[k % len(runs)] + np.float32(1e-3 * (k % 7))
                return pts, _features(pts)

            def in_process(model=model, arch=arch, fresh=fresh) -> mx.array:
                pts, feats = fresh()
                inp = point_cloud_input(pts, feats, voxel)
                if arch == "SPVCNN":
                    out = model(inp)
                else:
                    out = mx.take(model(inp.tensor).feats, inp.voxels.point_to_voxel, axis=0)
                mx.eval(out)
                return out

            def artifact(net=net, fresh=fresh) -> mx.array:
                pts, feats = fresh()
                out = net.predict_points(pts, feats)
                mx.eval(out)
                return out

            t_model, t_artifact, ratio_points = _paired(in_process, artifact, _PAIRS.value)
            pts0 = runs[0]
            same = _same_bits(
                net.predict_points(pts0, _features(pts0)),
                model(point_cloud_input(pts0, _features(pts0), voxel))
                if arch == "SPVCNN"
                else _gather(model, pts0, voxel),
            )
            inp0 = point_cloud_input(pts0, _features(pts0), voxel)
            if arch == "MinkUNet":
                dispatch = _dispatch(
                    lambda model=model, x=inp0.tensor: model(x).feats,
                    lambda net=net, x=inp0.tensor: net(x).feats,
                )
            else:  # the artifact's graph on the same prepared input
                dispatch = _dispatch(
                    lambda model=model, inp=inp0: model(inp),
                    lambda net=net, inp=inp0: net._run(inp),
                )
            warm = f"{'-':>16s} {'-':>8s}"
            if arch == "MinkUNet":
                x = point_cloud_input(pts0, _features(pts0), voxel).tensor
                same = same and _same_bits(net(x).feats, model(x).feats)
                t_warm, _, ratio_warm = _paired(
                    lambda model=model, x=x: mx.eval(model(x).feats),
                    lambda net=net, x=x: mx.eval(net(x).feats),
                    _PAIRS.value,
                )
                warm = f"{t_warm * 1e3:16.1f} {ratio_warm - 1:+8.1%}"
            compiled_load_s = median_s(
                lambda path=path: export.load(path, compiled=True), _REPEATS.value
            )
            compiled = export.load(path, compiled=True)
            _, t_compiled, ratio_compiled = _paired(
                in_process, lambda net=compiled, fresh=fresh: artifact(net, fresh), _PAIRS.value
            )
            ratio = f"{size / float_bytes:8.2f}" if float_bytes else f"{'-':>8s}"
            print(
                f"{arch:9s} {form:12s} {size:10d} {ratio} {load_s * 1e3:8.1f} "
                f"{t_model * 1e3:16.1f} {t_artifact * 1e3:8.1f} "
                f"{ratio_points - 1:+8.1%} {warm} {dispatch:+9.3%} {'yes' if same else 'NO':>9s} "
                f"{compiled_load_s * 1e3:17.1f} {t_compiled * 1e3:7.1f} "
                f"{1 / ratio_compiled:8.2f}",
                flush=True,
            )
            path.unlink()
    tmp.rmdir()


def _gather(model: MinkUNet, pts: np.ndarray, voxel: float) -> mx.array:
    inp = point_cloud_input(pts, _features(pts), voxel)
    return mx.take(model(inp.tensor).feats, inp.voxels.point_to_voxel, axis=0)


if __name__ == "__main__":
    cli.run(main)
