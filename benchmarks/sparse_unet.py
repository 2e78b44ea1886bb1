"""Benchmark: sparse segmentation networks end to end on the built-in LiDAR scan.

One run, one machine, ~100k voxels:

* training step time (forward + backward + Adam update; the fastest of
  ``--rounds`` interleaved rounds) of MinkUNet and
  SPVCNN (per-point scores) for float32, float16 (mixed precision: float32
  weights and Adam state, float16 features; each convolution reads its
  weight rounded to float16 and returns a float32 weight gradient; the
  norms' native kernels keep their statistics in float32), the previous
  all-float16 variant (``float16 weights``: float16 weights and Adam state),
  bfloat16 (mixed precision as float16's, with bfloat16 features) and int8
  weights, with relations cached (``warm``, the same
  scan again) and built in the step (``cold``, a new coordinate set, as when
  every step sees a new scan);
* the share of a cold step spent outside the convolutions (norms,
  activations, concatenation, loss, update and relation building): one minus
  the summed time of every convolution layer's forward and backward run alone
  on its recorded input, taken per round against that round's step (the
  median and range over the rounds: the host's speed drifts between rounds);
  and a second share that also counts the point-wise
  linear layers (SPVCNN's per-point MLPs and the heads: GEMMs like a 1x1x1
  convolution), timed the same way;
* the same steps through the previous, unfused layer paths (``mlx.nn``
  BatchNorm then ReLU, ``mx.matmul`` point layers, a scatter-add gradient for
  SPVCNN's voxel rows), timed in the same rounds;
* forward throughput (voxels/s) of MinkUNet in eval mode for float32,
  float16, bfloat16, int8 and int4 weights (weight-only: float activations),
  and w8a8 (int8 weights and activations on the integer kernels, with dynamic
  per-row scales or one calibrated scale per layer, ``w8a8 static``) in
  ``--rounds`` interleaved rounds, each
  against float32's in the same round (``--forward-only`` skips the
  training rows), and the share of a cold forward spent building kernel
  relations, timed directly around each build the coordinate manager makes
  (relations are built natively and eagerly, so the wall time of the call
  is the build's); then issue 35's network lines on this host, each value
  with its target and verdict (no kind slower than float32, int8 at 2.5x
  on AMX hosts, relations at most 15% of a cold forward);
* the compiled inference graph (:func:`mlx_lattice.compile`: norms folded
  into the convolutions, bias and ReLU as one epilogue) of the float32 and
  the static w8a8 models, as their own rows (``compiled float32``,
  ``compiled w8a8 static``), and for those four rows the share of the warm
  forward spent outside the convolutions: one minus the summed time of
  every convolution of the graph run alone on its recorded input, against
  the warm forward of the same round (median over the rounds; the head,
  norms, ReLUs, epilogues and concatenations are outside); then issue 55's
  lines (compiled static w8a8 at 2.0x float32 on AVX-512-VNNI hosts, 1.5x
  on AVX2-only ones; compiled float32 at 1.15x; no compiled row slower than
  compiled float32).

``--threads=1,2,4,8,all`` runs a thread sweep instead of the rows above
(issue 55): the float32 eval forward and the compiled static w8a8 graph of
MinkUNet on the built-in scene made denser until it has at least
``--sweep-voxels`` voxels (400k by default), timed at each kernel thread
count (:func:`mlx_lattice.set_num_threads`, restored after; ``all`` is the
CPUs of the process's affinity mask, counts above it are skipped) in
``--rounds`` interleaved rounds; per count the best round's ms and voxels/s,
the speed-up over one thread and the efficiency (speed-up / threads), then
the issue's line (at least 0.75x linear at 8 threads on hosts with 8 or
more cores).

The run first calls :func:`mlx_lattice.retain_freed_memory` (``--no-retain``
leaves glibc's malloc as it is): without it every large array of a step is a
fresh, page-faulted mapping.

Pass ``--quick`` for a small scan (a smoke run).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as mlx_nn
import mlx.optimizers as optim
import numpy as np
from absl import flags
from tqdm import tqdm

import mlx_lattice
import quantrules as qr
from benchmarks.host_class import host_class_line, kernel_names, print_targets
from benchmarks.timing import median_s
from examples import cli
from mlx_lattice import SparseTensor, export, geometry, nn
from mlx_lattice import tensor as lattice_tensor
from mlx_lattice._native import ext
from mlx_lattice.core import KernelRelation
from mlx_lattice.data import HEIGHT_SCALE, SceneConfig, labelled_scans, make_batch
from mlx_lattice.inference import _is_static
from mlx_lattice.models import (
    SPVCNN,
    MinkUNet,
    PointBranch,
    PointCloudInput,
    cross_entropy,
    point_cloud_input,
)
from mlx_lattice.nn import is_sparse_conv

WIDTHS = (32, 64, 96, 128)
VOXEL = 0.05
CLASSES = 5

_QUICK = flags.DEFINE_boolean("quick", False, "a small scan and model (smoke run)")
_ROUNDS = flags.DEFINE_integer(
    "rounds", 3, "interleaved timing rounds (training rows and forward rows)", lower_bound=1
)
_NO_FORWARD = flags.DEFINE_boolean("no-forward", False, "training steps only")
_FORWARD_ONLY = flags.DEFINE_boolean("forward-only", False, "forward throughput only")
_MODELS = flags.DEFINE_string("models", "MinkUNet,SPVCNN", "comma-separated training rows to run")
flags.register_validator(
    "models",
    lambda value: {m.strip().lower() for m in value.split(",")} <= {"minkunet", "spvcnn"},
    message="--models: choose from MinkUNet, SPVCNN",
)
_NO_RETAIN = flags.DEFINE_boolean(
    "no-retain",
    False,
    "leave glibc's malloc as it is (by default the run calls "
    "mlx_lattice.retain_freed_memory(), as a training process should)",
)
_CACHE_LIMIT_MB = flags.DEFINE_integer(
    "cache-limit-mb",
    None,
    "mx.set_cache_limit for the run (default: MLX's own, printed at the start; "
    "arrays larger than the cache are fresh allocations each time)",
)


def _model(kind: str, widths: tuple[int, ...], cls: type = MinkUNet) -> MinkUNet:
    mx.random.seed(0)
    model = cls(2, CLASSES, widths)
    # float16: mixed precision, float32 weights (and so Adam state) with
    # float16 features; nothing to convert here. "float16 weights": every
    # parameter float16 too (MLX's CPU float16 Adam update took several
    # times the float32 one on this model).
    if kind == "float16 weights":
        model.apply(lambda p: p.astype(mx.float16))
    elif kind in ("int8", "int4"):
        rules = [
            qr.Rule(module_path="stem/.*"),  # Cin=2: packing would grow it
            qr.Rule(op_names=("sparse_conv",), weight_qtype=kind, tile_size=32),
        ]
        mlx_lattice.quantize(model, rules)
    elif kind in ("w8a8", "w8a8 static"):
        # int8 weights and int8 activations: the integer kernels (dynamic
        # per-row scales, or one calibrated scale per layer).
        rules = [
            qr.Rule(module_path="stem/.*"),
            qr.Rule(
                op_names=("sparse_conv",),
                weight_qtype="int8",
                act_qtype="int8",
                act_static_scale=kind == "w8a8 static",
                tile_size=32,
            ),
        ]
        mlx_lattice.quantize(model, rules)
    model.train()
    return model


class _Recorder(mlx_nn.Module):
    """Stands in for a conv layer for one pass and records its input."""

    def __init__(self, inner: mlx_nn.Module, log: list) -> None:
        super().__init__()
        self.inner = inner
        self._record = log.append  # a method, not a list: kept out of the parameter tree

    def __call__(self, x: SparseTensor) -> SparseTensor:
        self._record((self.inner, x))
        return self.inner(x)


def _conv_inputs(model: mlx_nn.Module, x: object) -> list:
    """(layer, input) for every convolution of one forward pass."""
    return _layer_inputs(model, x, is_sparse_conv)


def _layer_inputs(model: mlx_nn.Module, x: object, select: Callable[[object], bool]) -> list:
    """(layer, input) for every layer ``select`` picks, in one forward pass."""
    log: list = []
    swapped = []
    for name, module in model.named_modules():
        if name and select(module):
            *parent, last = name.split(".")
            node = model
            for part in parent:
                node = node[part]
            swapped.append((node, last, module))
    for node, last, module in swapped:
        setattr(node, last, _Recorder(module, log))
    try:
        out = model(x)
        mx.eval(out.feats if isinstance(out, SparseTensor) else out)
    finally:
        for node, last, module in swapped:
            setattr(node, last, module)
    return log


def _conv_call(layer: mlx_nn.Module, x: SparseTensor) -> object:
    """Forward and backward (input and, when trainable, weight gradients) of
    one layer, as a call to time."""
    params = layer.trainable_parameters()

    def loss(feats: mx.array, p: dict) -> mx.array:
        # A plain sum: its cotangent is a broadcast of ones, so no elementwise
        # op is timed with the layer (a float16 product with a ones array took
        # several times the float32 one, charging MLX's slow CPU half-precision
        # arithmetic to the float16 convolutions).
        layer.update(p)
        return layer(x.replace(feats)).feats.sum()

    grad = mx.value_and_grad(loss, argnums=(0, 1) if params else 0)
    return lambda: mx.eval(grad(x.feats, params))


def _linear_inputs(model: mlx_nn.Module, x: object) -> list:
    """(layer, input) for every point-wise linear layer (``nn.Linear``, on
    sparse features or plain per-point arrays) of one forward pass."""
    return _layer_inputs(model, x, lambda m: isinstance(m, nn.Linear))


def _linear_call(layer: mlx_nn.Module, x: object) -> object:
    """Forward and backward (input and weight gradients) of one linear layer
    on its recorded input (features or a plain array), as a call to time."""
    if isinstance(x, SparseTensor):
        return _conv_call(layer, x)
    params = layer.trainable_parameters()

    def loss(feats: mx.array, p: dict) -> mx.array:
        layer.update(p)
        return layer(feats).sum()

    grad = mx.value_and_grad(loss, argnums=(0, 1))
    return lambda: mx.eval(grad(x, params))


def _train_step(model: MinkUNet, optimizer: optim.Optimizer, x: object, labels: mx.array) -> None:
    def loss(m: MinkUNet) -> mx.array:
        out = m(x)
        return cross_entropy(out.feats if isinstance(out, SparseTensor) else out, labels)

    value, grads = mlx_nn.value_and_grad(model, loss)(model)
    optimizer.update(model, grads)
    mx.eval(value, model.parameters(), optimizer.state)


class _UnfusedNorm(nn.BatchNorm):
    """The previous norm path: ``mlx.nn.BatchNorm`` on float32 features, then
    ReLU, then the cast back (reference rows only)."""

    def _forward(self, x: SparseTensor, relu: bool) -> SparseTensor:
        y = mlx_nn.BatchNorm.__call__(self, x.feats.astype(mx.float32))
        return x.replace((mx.maximum(y, 0) if relu else y).astype(x.dtype))


class _MatmulLinear(nn.Linear):
    """Plain arrays through ``mx.matmul`` (``mlx.nn.Linear``), as before."""

    def __call__(self, x: object) -> object:  # type: ignore[override]
        if isinstance(x, SparseTensor):
            return super().__call__(x)
        return mlx_nn.Linear.__call__(self, x)


class _UnfusedPointBranch(PointBranch):
    def __call__(self, z: mx.array) -> mx.array:
        y = self.linear(z)
        return mx.maximum(mlx_nn.BatchNorm.__call__(self.norm, y.astype(mx.float32)), 0).astype(
            z.dtype
        )


class _GatherInput(PointCloudInput):
    def to_voxels(self, x: SparseTensor, point_feats: mx.array) -> SparseTensor:
        vox, inverse, _ = self.level(x)
        return x.replace(geometry.voxelize(point_feats, vox, "mean")[inverse])


def _unfuse(model: mlx_nn.Module) -> None:
    """Swap in the previous (unfused) layer paths, in place."""
    for _, module in model.named_modules():
        if isinstance(module, nn.BatchNorm):
            module.__class__ = _UnfusedNorm
        elif isinstance(module, PointBranch):
            module.__class__ = _UnfusedPointBranch
        elif isinstance(module, nn.Linear):
            module.__class__ = _MatmulLinear


def _seconds(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def _train_rows(name: str, cls: type, widths: tuple, make_input: object, target: mx.array,
                rounds: int) -> None:
    """Every variant's warm and cold step and its convolutions, timed round
    robin (one call of each per round): load that drifts during the run hits
    every variant alike. Times are the best round; shares and ratios are per
    round, median and range."""
    kinds = (
        "float32", "float32 unfused", "float16", "float16 weights", "float16 unfused",
        "bfloat16", "int8",
    )
    setups = {}
    for kind in kinds:
        model = _model(kind.replace(" unfused", ""), widths, cls)
        dtype = (
            mx.float16 if kind.startswith("float16")
            else mx.bfloat16 if kind == "bfloat16"
            else mx.float32
        )
        unfused = kind.endswith("unfused")
        if unfused:
            _unfuse(model)

        def make(d=dtype, u=unfused, f=make_input) -> object:
            x = f(d)  # type: ignore[operator]
            if u and isinstance(x, PointCloudInput):
                x.__class__ = _GatherInput
            return x

        opt = optim.Adam(learning_rate=1e-3)
        warm_x = make()

        def step(m=model, o=opt, x=warm_x) -> None:
            _train_step(m, o, x, target)

        def cold(m=model, o=opt, mk=make) -> None:
            _train_step(m, o, mk(), target)

        step()
        convs = [] if unfused else [
            _conv_call(layer, x) for layer, x in _conv_inputs(model, warm_x)
        ]
        # The point-wise linear layers (GEMMs like a 1x1x1 convolution), timed
        # the same way for the second share column.
        linears = [] if unfused else [
            _linear_call(layer, x) for layer, x in _linear_inputs(model, warm_x)
        ]
        setups[kind] = (step, cold, convs + linears, len(convs))
    rows: dict[str, list[list[float]]] = {k: [] for k in setups}
    # A bar of rounds on a terminal (between the timed calls; silent otherwise).
    for r in tqdm(range(rounds + 1), desc=f"{name}: rounds (round 0 warms up)", unit="round",
                  leave=False, disable=None):  # fmt: skip
        for kind, (step, cold, calls, _) in setups.items():
            times = [_seconds(step), _seconds(cold)] + [_seconds(c) for c in calls]
            if r:  # round 0 warms up
                rows[kind].append(times)
    best = {k: np.min(np.array(v), axis=0) for k, v in rows.items()}
    base = np.array(rows["float32"])[:, :2]
    for kind in kinds:
        warm, cold = best[kind][:2]
        conv_kind = kind.replace(" unfused", "")
        n_convs = setups[conv_kind][3]
        convs = sum(best[conv_kind][2 : 2 + n_convs])
        linears = sum(best[conv_kind][2 + n_convs :])
        # Shares and ratios per round (each step against the layers and the
        # float32 step of its own round, so that the host's speed drifting
        # between rounds cancels), then their median and range.
        mine, ref = np.array(rows[kind]), np.array(rows[conv_kind])
        conv_r = ref[:, 2 : 2 + n_convs].sum(axis=1)
        both_r = ref[:, 2:].sum(axis=1)
        print(
            f"{name + ' ' + kind:<25}{warm * 1e3:>9.1f}{cold * 1e3:>9.1f}{convs * 1e3:>10.1f}"
            f"{_spread(1 - conv_r / mine[:, 1], '.0%'):>17}{linears * 1e3:>12.1f}"
            f"{_spread(1 - both_r / mine[:, 1], '.0%'):>17}"
            f"{_spread(mine[:, 1] / base[:, 1], '.2f'):>18}"
            f"{_spread(mine[:, 0] / base[:, 0], '.2f'):>18}",
            flush=True,
        )


def _spread(values: np.ndarray, fmt: str) -> str:
    """The median of per-round values and their range: ``35% (31-38%)``."""
    lo, mid, hi = np.min(values), np.median(values), np.max(values)
    return f"{mid:{fmt}} ({lo:{fmt}}-{hi:{fmt}})".replace("%-", "-")


def main(argv: Sequence[str] | None = None) -> None:
    cli.parsed(argv)
    print(host_class_line(kernel_names(ext)))
    chosen = {m.strip().lower() for m in _MODELS.value.split(",")}
    if _CACHE_LIMIT_MB.value is not None:
        mx.set_cache_limit(_CACHE_LIMIT_MB.value << 20)
    retained = False if _NO_RETAIN.value else mlx_lattice.retain_freed_memory()
    widths = (8, 16, 16) if _QUICK.value else WIDTHS
    config = SceneConfig(beams=16, azimuth_steps=512) if _QUICK.value else None
    scan = labelled_scans(1, 0, seed=0, config=config).train[0]
    voxel = 0.25 if _QUICK.value else VOXEL
    batch = make_batch([scan], voxel)
    base, labels = batch.tensor, batch.labels
    n = base.num_points
    point_feats = np.stack([np.ones(len(scan.points)), scan.points[:, 2] / HEIGHT_SCALE], axis=1)
    point_labels = mx.array(scan.labels)

    def fresh(dtype: mx.Dtype) -> SparseTensor:
        return SparseTensor(base.coords, base.feats.astype(dtype), check=False)

    def fresh_points(dtype: mx.Dtype) -> object:
        feats = mx.array(point_feats.astype(np.float32)).astype(dtype)
        return point_cloud_input(scan.points, feats, voxel)

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; mlx_lattice threads "
        f"{mlx_lattice.get_num_threads()}, micro-kernel {ext.gemm_isa()}"
    )
    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    print(
        f"MLX buffer cache limit {limit >> 20} MB; freed memory retained (retain_freed_memory): "
        f"{'yes' if retained else 'no'}; load average {os.getloadavg()[0]:.1f}"
    )
    if _THREADS.value is not None:
        _thread_sweep(widths, _QUICK.value, _SWEEP_VOXELS.value, _ROUNDS.value)
        return
    print(
        f"scan: {n} voxels ({len(scan.points)} points); widths {widths}, 2 input channels, "
        f"{CLASSES} classes"
    )

    if not _FORWARD_ONLY.value:
        _training(widths, fresh, fresh_points, labels, point_labels, chosen)
    if not _NO_FORWARD.value:
        _forward(widths, fresh, n, _ROUNDS.value)


def _training(widths: tuple, fresh: object, fresh_points: object, labels: mx.array,
              point_labels: mx.array, chosen: set) -> None:
    print(f"\ntraining step (forward + backward + Adam update; {_ROUNDS.value} interleaved rounds)")
    print(
        f"{'model':<25}{'warm ms':>9}{'cold ms':>9}{'convs ms':>10}{'outside convs':>17}"
        f"{'linears ms':>12}{'outside both':>17}{'cold / float32':>18}{'warm / float32':>18}"
    )
    cases = (
        ("MinkUNet", MinkUNet, fresh, labels),
        ("SPVCNN", SPVCNN, fresh_points, point_labels),
    )
    for name, cls, make_input, target in cases:
        if name.lower() not in chosen:
            continue
        _train_rows(name, cls, widths, make_input, target, _ROUNDS.value)
    print(
        "warm, cold, convs, linears: the best round; cold: relations (and SPVCNN's point-voxel "
        "maps) built inside the step, as for a new scan each step;\noutside convs: 1 - convs / "
        "cold, convs = every conv layer's forward + backward timed alone on its input;\nlinears: "
        "the same for every point-wise nn.Linear (SPVCNN's point MLPs, both heads); outside "
        "both: 1 - (convs + linears) / cold;\nshares, cold / float32 and warm / float32 (against "
        "the float32 row's step): per round, median (range) over the rounds;\n"
        "'unfused': the previous path, timed in the same "
        "rounds (mlx.nn BatchNorm + ReLU, mx.matmul point layers, a scatter-add voxel-row "
        "gradient; convs as the fused row)"
    )


class _RelationClock:
    """Sums the wall time of the kernel relations the coordinate manager
    makes while active: it wraps the builder ``mlx_lattice.tensor`` calls
    and :meth:`KernelRelation.transposed`, which the manager calls for a
    transposed convolution's relation when it built the forward one."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def _timed(self, fn: Callable) -> Callable:
        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def __enter__(self) -> _RelationClock:
        self._build = lattice_tensor.build_kernel_relation
        self._transposed = KernelRelation.transposed
        lattice_tensor.build_kernel_relation = self._timed(self._build)
        KernelRelation.transposed = self._timed(self._transposed)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        lattice_tensor.build_kernel_relation = self._build
        KernelRelation.transposed = self._transposed  # type: ignore[method-assign]


def _conv_seconds(net: export.ExportedModel, x: SparseTensor) -> float:
    """The summed warm time of every convolution of ``net``'s graph run
    alone on the input the graph gave it: without its epilogue pass, or,
    where the compiled graph runs the fused int8 convolution, that op with
    the epilogue it carries."""
    values = net._values(x)
    mx.eval([v.feats for v in values.values() if isinstance(v, SparseTensor)])
    fused = "int8_values" in net.graph and hasattr(ext, "sparse_quantized_conv_fused")
    total = 0.0
    for node, step in zip(net.graph["nodes"], net._steps, strict=True):
        if node["op"] in export._CONV_OPS:
            layer = step if fused and _is_static(node) else export._conv_layer(node, net.tensors)
            inp = values[node["inputs"][0]]
            total += median_s(lambda layer=layer, inp=inp: mx.eval(layer(inp).feats), repeats=3)
    return total


#: The forward rows whose share outside the convolutions is measured.
_SHARE_KINDS = ("float32", "compiled float32", "w8a8 static", "compiled w8a8 static")


def _forward(widths: tuple, fresh: object, n: int, rounds: int) -> None:
    print(f"\nforward (MinkUNet, eval mode; {rounds} interleaved rounds)")
    print(
        f"{'model':<22}{'forward vox/s':>15}{'warm / float32':>20}{'cold fwd ms':>13}"
        f"{'warm fwd ms':>13}{'relations':>11}{'outside convs':>15}"
    )
    kinds = (
        "float32",
        "compiled float32",
        "float16",
        "bfloat16",
        "int8",
        "int4",
        "w8a8",
        "w8a8 static",
        "compiled w8a8 static",
    )
    runs, graphs = {}, {}
    for kind in kinds:
        base = kind.removeprefix("compiled ")
        model = _model(base, widths)
        model.eval()
        if base == "w8a8 static":
            # Calibrated on the scan itself: the scales are what a deployment
            # would record, and the timing does not depend on their values.
            mlx_lattice.calibrate(model, [fresh(mx.float32)])
        dtype = {"float16": mx.float16, "bfloat16": mx.bfloat16}.get(kind, mx.float32)
        if kind.startswith("compiled "):
            net = mlx_lattice.compile(model)

            def forward(x: SparseTensor, net: export.ExportedModel = net) -> None:
                mx.eval(net(x).feats)

            graphs[kind] = net
        else:

            def forward(x: SparseTensor, model: MinkUNet = model) -> None:
                mx.eval(model(x).feats)

            if kind in _SHARE_KINDS:  # the eval forward's graph, op for op (the same kernels)
                graph, tensors = export.lower(model)
                graphs[kind] = export.ExportedModel(graph=graph, tensors=tensors, metadata={})
        runs[kind] = (dtype, forward, fresh(dtype))
    # Per round and kind: (cold, warm) medians of 3, and the relations' share
    # of each cold forward; the host's speed drifts between rounds, so ratios
    # are taken within a round.
    times = np.zeros((rounds, len(kinds), 2))
    outside_shares: dict[str, list[float]] = {}
    shares = np.zeros((rounds, len(kinds), 3))
    for r in range(rounds):
        for k, kind in enumerate(kinds):
            dtype, forward, warm_input = runs[kind]
            colds = []
            for i in range(3):
                with _RelationClock() as clock:
                    start = time.perf_counter()
                    forward(fresh(dtype))
                    colds.append(time.perf_counter() - start)
                shares[r, k, i] = clock.seconds / colds[-1]
            times[r, k, 0] = np.median(colds)
            times[r, k, 1] = median_s(lambda f=forward, x=warm_input: f(x), repeats=3)
            if kind in _SHARE_KINDS:  # against this round's forward: the load drifts
                outside_shares.setdefault(kind, []).append(
                    1.0 - _conv_seconds(graphs[kind], warm_input) / times[r, k, 1]
                )
    outside = {kind: float(np.median(values)) for kind, values in outside_shares.items()}
    ratios, relation_shares = {}, {}
    for k, kind in enumerate(kinds):
        cold, warm = times[:, k, 0].min(), times[:, k, 1].min()
        share = relation_shares[kind] = float(np.median(shares[:, k]))
        ratios[kind] = times[:, 0, 1] / times[:, k, 1]
        ratio = _spread(ratios[kind], ".2f")
        out = f"{outside[kind]:>15.1%}" if kind in outside else f"{'-':>15}"
        print(
            f"{kind:<22}{n / warm:>15,.0f}{ratio:>20}{cold * 1e3:>13.1f}"
            f"{warm * 1e3:>13.1f}{share:>10.0%}{out}"
        )
    print(
        "forward vox/s, cold, warm: the best round; relations: share of a cold forward (fresh "
        "coordinate manager) spent building kernel relations, median over every cold "
        "forward;\nwarm / float32: voxels/s against "
        "float32's warm forward of the same round, median (range) over the rounds;\ncompiled: "
        "mlx_lattice.compile (norms folded, bias + ReLU epilogue); outside convs: 1 - the summed "
        "time of every convolution run alone on its recorded input / that round's warm forward, "
        "median over the rounds"
    )
    amx = ext.isa_supported("amx-int8")
    median = {kind: float(np.median(values)) for kind, values in ratios.items()}
    sections = {"x float32, never below 1": [(kind, median[kind], ">=", 1.0) for kind in kinds[1:]]}
    if amx:
        sections["x float32 on AMX hosts"] = [
            (kind, median[kind], ">=", 2.5) for kind in ("int8", "w8a8", "w8a8 static")
        ]
    sections["relations, share of a cold forward"] = [
        (kind, relation_shares[kind], "<=", 0.15) for kind in kinds
    ]
    where = "an AMX host" if amx else "a host without AMX"
    print_targets(f"targets (issue 35) on {where}:", sections)
    # The class of the int8 kernel that ran (a capped ISA counts as the
    # host class it stands in for).
    floor = 2.0 if ext.int8_isa() in ("amx-int8", "avx512-vnni") else 1.5
    compiled = {kind: float(np.median(ratios[kind])) for kind in kinds if "compiled" in kind}
    issue55 = {
        "x float32 (today's eval forward)": [
            ("compiled w8a8 static", compiled["compiled w8a8 static"], ">=", floor),
            ("compiled float32", compiled["compiled float32"], ">=", 1.15),
        ],
        "x compiled float32, never below 1": [
            (
                "compiled w8a8 static",
                compiled["compiled w8a8 static"] / compiled["compiled float32"],
                ">=",
                1.0,
            )
        ],
    }
    kind_of_host = (
        "an AVX-512-VNNI host" if floor == 2.0 else f"a host without AVX-512-VNNI ({ext.int8_isa()})"
    )
    print_targets(f"targets (issue 55) on {kind_of_host}:", issue55)


# The thread sweep (issue 55, item 6).
_THREADS = flags.DEFINE_string(
    "threads",
    None,
    "comma-separated kernel thread counts, integers >= 1 or 'all' (the CPUs of the affinity "
    "mask), e.g. 1,2,4,8,all: the run is then a thread sweep of the float32 eval forward and "
    "the compiled static w8a8 graph on a scan of at least --sweep-voxels voxels (1 thread, the "
    "baseline, is always timed; counts above the host's CPUs are skipped)",
)
_SWEEP_VOXELS = flags.DEFINE_integer(
    "sweep-voxels",
    400_000,
    "with --threads: the least number of voxels of the sweep's scan (the built-in scene made "
    "denser until it has them)",
    lower_bound=1,
    upper_bound=2_000_000,
)


def _parse_threads(value: str) -> list[int | str]:
    """The items of ``--threads``: ints >= 1 and ``"all"``; ValueError otherwise."""
    items: list[int | str] = []
    for item in value.split(","):
        item = item.strip().lower()
        if item == "all":
            items.append(item)
        elif not item.isdigit() or int(item) < 1:
            raise ValueError(item)
        else:
            items.append(int(item))
    return items


def _valid_threads(value: str | None) -> bool:
    try:
        return value is None or bool(_parse_threads(value))
    except ValueError:
        return False


flags.register_validator(
    "threads",
    _valid_threads,
    message="--threads: comma-separated integers >= 1 or 'all', e.g. 1,2,4,8,all",
)


def _affinity_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _sweep_scan(min_voxels: int, quick: bool) -> tuple[SparseTensor, int, float]:
    """The benchmark's scene (``--quick``'s when quick), each step 1.5x the
    beams and azimuth steps and 0.8x the voxel edge, until its voxelization
    has at least ``min_voxels`` voxels (from the full scene: 100k, 202k,
    421k, ...): the tensor, the scan's points and the voxel edge."""
    beams, steps, voxel = (16, 512, 0.25) if quick else (64, 2200, VOXEL)
    for _ in range(12):
        config = SceneConfig(beams=beams, azimuth_steps=steps)
        scan = labelled_scans(1, 0, seed=0, config=config).train[0]
        tensor = make_batch([scan], voxel).tensor
        if tensor.num_points >= min_voxels:
            return tensor, len(scan.points), voxel
        beams, steps, voxel = beams * 3 // 2, steps * 3 // 2, voxel * 0.8
    raise ValueError(f"--sweep-voxels={min_voxels}: the scene reached {tensor.num_points} voxels")


def _thread_sweep(widths: tuple, quick: bool, min_voxels: int, rounds: int) -> None:
    """Times the float32 eval forward and the compiled static w8a8 graph at
    each ``--threads`` count (warm: relations cached), in interleaved rounds
    (every count and model once per round), and prints the best round per
    count with its speed-up over one thread and the efficiency."""
    cpus = _affinity_cpus()
    asked = {cpus if t == "all" else t for t in _parse_threads(_THREADS.value)}
    counts = sorted({1} | {t for t in asked if t <= cpus})
    skipped = sorted(t for t in asked if t > cpus)
    tensor, points, voxel = _sweep_scan(min_voxels, quick)
    n = tensor.num_points
    print(
        f"\nthread sweep (MinkUNet, eval mode; {n} voxels, {points} points, voxel {voxel:.3g} m; "
        f"{rounds} interleaved rounds; affinity mask {cpus} CPUs)"
    )
    if skipped:
        print(f"skipped: {', '.join(map(str, skipped))} threads (above this host's {cpus} CPUs)")
    float_model = _model("float32", widths)
    float_model.eval()
    static_model = _model("w8a8 static", widths)
    static_model.eval()
    # Calibrated on the scan itself, as in the forward rows.
    mlx_lattice.calibrate(static_model, [tensor])
    net = mlx_lattice.compile(static_model)
    calls = {
        "float32": lambda: mx.eval(float_model(tensor).feats),
        "compiled w8a8 static": lambda: mx.eval(net(tensor).feats),
    }
    previous = mlx_lattice.get_num_threads()
    times = np.zeros((rounds, len(counts), len(calls)))
    read_back = {}
    try:
        for r in range(rounds):
            for i, count in enumerate(counts):
                mlx_lattice.set_num_threads(count)
                read_back[count] = mlx_lattice.get_num_threads()
                for k, call in enumerate(calls.values()):
                    times[r, i, k] = median_s(call, repeats=3)
    finally:
        mlx_lattice.set_num_threads(previous)
    best = times.min(axis=0) * 1e3  # ms, the best round
    print(f"{'model':<22}{'threads':>8}{'ms':>12}{'voxels/s':>14}{'speed-up':>10}{'efficiency':>12}")
    speedups: dict[str, dict[int, float]] = {}
    for k, kind in enumerate(calls):
        # From the printed (rounded) times, so a reader can redo the division.
        base = round(best[0, k], 2)
        for i, count in enumerate(counts):
            ms = round(best[i, k], 2)
            speedup = speedups.setdefault(kind, {})[count] = base / ms
            print(
                f"{kind:<22}{read_back[count]:>8}{ms:>12.2f}{n / ms * 1e3:>14,.0f}"
                f"{speedup:>10.2f}{speedup / count:>12.2f}"
            )
    print(
        "ms, voxels/s: the best round's warm forward (median of 3 after one warm-up; relations "
        "cached); speed-up: the 1-thread ms / this ms; efficiency: speed-up / threads;\n"
        "threads: mlx_lattice.get_num_threads() after set_num_threads (the native kernels; "
        f"MLX's own ops thread as they do); restored to {mlx_lattice.get_num_threads()} after"
    )
    target = "at least 0.75x linear speed-up at 8 threads (hosts with >= 8 cores)"
    if cpus < 8:
        print(f"target (issue 55): {target}: not measurable here ({cpus} CPUs)")
    elif 8 not in counts:
        print(f"target (issue 55): {target}: 8 threads not in --threads")
    else:
        rows = [(kind, s[8] / 8, ">=", 0.75) for kind, s in speedups.items()]
        print_targets(
            f"targets (issue 55) on a host with {cpus} CPUs:",
            {"efficiency at 8 threads (speed-up / 8)": rows},
        )


if __name__ == "__main__":
    cli.run(main)
