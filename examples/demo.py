"""The main job: train a sparse segmenter, then apply one quantization rule
set to two back-ends.

1. A small MinkUNet (``mlx_lattice.models``) is trained for ``--steps`` steps
   on the built-in labelled LiDAR scans (seeded synthetic streets: ground,
   building, car, pole, vegetation), with a progress bar of loss and steps/s
   (tqdm, on a terminal). It reports validation mIoU and per-class IoU, and
   draws with matplotlib a PNG loss curve and a top-down PNG of one
   validation scan (prediction next to ground truth, a class legend).
2. One ``quantrules`` rule set (built in, or ``--rules rules.json``) is
   applied with ``mlx_lattice.quantize``: as written, and with its weight
   qtypes set to int8 and to int4. Side by side with the float model: mIoU,
   per-layer error, weight bytes and time (``--points FILE`` runs the
   per-layer comparison on your own point file instead).
3. The same rule set quantizes a small dense JAX head (a per-voxel MLP on the
   U-Net's features, a Flax NNX model: ``examples/jax_head.py``) with
   ``taktiny_ops.quantize``; both models' layers are listed side by side with
   the rule each got, and the quantized head is written as a ``jax.export``
   artifact that plain JAX loads.

Run with ``./bazelw run //examples:demo`` (``-- --help`` for options,
``-- --flagfile=FILE`` to read them from a file; ``-- --quick`` for a
seconds-long run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from absl import flags
from tqdm import tqdm

from examples import cli

DEFAULT_RULES = {
    "provider": None,
    "rules": [
        {"module_path": "head"},
        {"module_path": "stem/.*"},
        {
            "module_path": "encoder/.*",
            "op_names": ["sparse_conv"],
            "weight_qtype": "int4",
            "tile_size": 32,
        },
        {"op_names": ["sparse_conv"], "weight_qtype": "int8", "tile_size": 32},
        {
            "module_path": "mlp/.*",
            "op_names": ["dot_general"],
            "weight_qtype": "int8",
            "act_qtype": "int8",
        },
    ],
}

NUM_CLASSES = 5
#: The model variants compared: float, the rule set with every weight qtype
#: replaced by int8 / int4, and the rule set as written.
VARIANTS = ("float", "int8", "int4", "rules")
#: The compiled static-int8 network: int8 weights and int8 activations with
#: static scales calibrated on a few training scans (``mlx_lattice.calibrate``),
#: run as the inference graph of ``mlx_lattice.compile`` (norms folded).
COMPILED = "static i8"
#: The columns of the score table: the variants, then the compiled network.
SCORED = (*VARIANTS, COMPILED)
#: Training scans the static activation scales are calibrated on.
CALIBRATION_SCANS = 2


@dataclasses.dataclass(frozen=True)
class Setup:
    """Scene, split, model and training size of a run."""

    beams: int
    azimuth_steps: int
    voxel_size: float
    widths: tuple[int, ...]
    n_train: int
    n_validation: int
    steps: int
    learning_rate: float


FULL = Setup(64, 1024, 0.15, (16, 32, 64, 96), 8, 2, 300, 5e-3)
QUICK = Setup(16, 512, 0.25, (8, 16, 16), 3, 1, 40, 1e-2)

_RULES = flags.DEFINE_string(
    "rules", None, "quantrules JSON file (default: the built-in rule set)"
)
_POINTS = flags.DEFINE_string(
    "points",
    None,
    "point cloud (.bin .ply .las .laz .pcd .npy .npz) for the per-layer comparison "
    "(default: the first validation scan)",
)
_STEPS = flags.DEFINE_integer(
    "steps", None, f"training steps (default {FULL.steps})", lower_bound=1
)
_SAVE = flags.DEFINE_string(
    "save",
    None,
    "save the float model and the one quantized by the rules (.safetensors, with their "
    "configuration: examples/segment.py runs them)",
)
flags.register_validator(
    "save",
    lambda path: path is None or Path(path).suffix == ".safetensors",
    message="--save needs a .safetensors path",
)
_DATA = flags.DEFINE_string(
    "data",
    None,
    "train on labelled scans on disk instead of the built-in streets (see --layout)",
)
_LAYOUT = flags.DEFINE_enum(
    "layout",
    "semantickitti",
    ["semantickitti", "folder"],
    "--data's layout: a SemanticKITTI tree (sequences/NN/velodyne, labels) or a folder "
    "of labelled .ply/.las/.laz/.pcd/.npz files",
)
_OUT_DIR = flags.DEFINE_string("out-dir", None, "where the PNGs go (default: a temporary folder)")
_RESULTS = flags.DEFINE_string(
    "results",
    None,
    "where the scores go as a reStructuredText table (default: results.inc in the --out-dir "
    "folder; the docs include docs/results/demo.inc)",
)
_SEED = flags.DEFINE_integer("seed", 0, "seed of the scans, the split, the weights and the training")
_QUICK = flags.DEFINE_boolean("quick", False, "a small scene, model and run (tests)")
_FEATURES = flags.DEFINE_string(
    "features",
    "occupancy,height",
    "the model's input features, in order (occupancy, height, intensity, or a field of the "
    "point files such as r,g,b); saved and exported with the model",
)


def _check_features(spec: str) -> bool:
    from mlx_lattice import MlxLatticeError
    from mlx_lattice.data import parse_features

    try:
        parse_features(spec)
    except MlxLatticeError:
        return False
    return True


flags.register_validator(
    "features", _check_features, message="--features must be distinct names separated by commas"
)


class Progress:
    """The demo's stages on stderr, one tqdm line each with its detail and
    elapsed time (silent when stderr is not a terminal)."""

    def __init__(self, total: int) -> None:
        self.total, self.count = total, 0

    @contextlib.contextmanager
    def step(self, text: str) -> Iterator[_Stage]:
        self.count += 1
        with tqdm(desc=f"[{self.count}/{self.total}] {text}", bar_format="{desc}{postfix} [{elapsed}]",
                  disable=None, file=sys.stderr) as bar:  # fmt: skip
            yield _Stage(bar)


class _Stage:
    """A running stage of :class:`Progress`: ``update(detail)`` shows what it is doing."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar

    def update(self, detail: str) -> None:
        self.bar.set_postfix_str(detail)


def read_points(path: Path) -> np.ndarray:
    """``(M, 3)`` float32 points of any file :func:`mlx_lattice.io.read_points`
    reads (.bin, .ply, .las, .laz, .pcd, .npy, .npz)."""
    from mlx_lattice.io import read_points as read

    return read(path).points


def read_scan(path: Path):
    """An unlabelled LidarScan of any point file (its intensity, if any)."""
    from mlx_lattice.data import LidarScan
    from mlx_lattice.io import read_points as read

    cloud = read(path)
    intensity = None
    if cloud.features is not None and "intensity" in cloud.feature_names:
        intensity = cloud.features[:, cloud.feature_names.index("intensity")].astype(np.float32)
    # The zero labels only fill the batch; no mIoU is computed on it.
    return LidarScan(cloud.points, np.zeros(len(cloud.points), np.int32), intensity)


def dataset_scans(root: Path, layout: str, setup: Setup, seed: int):
    """Labelled scans on disk, split (seeded) into training and validation
    scans (at most ``setup.n_train`` / ``setup.n_validation``); returns them
    as a LabelledScans, the class names and the ignored label."""
    from mlx_lattice.data import LabelledScans
    from mlx_lattice.io import folder_dataset, semantickitti_dataset

    if layout == "semantickitti":
        present = sorted(p.name for p in (root / "sequences").glob("*") if (p / "labels").is_dir())
        ds = semantickitti_dataset(root, present)
    else:
        ds = folder_dataset(root)
    if len(ds) < 2:
        raise SystemExit(f"{root}: need at least 2 labelled scans (one for validation), found {len(ds)}.")
    fraction = setup.n_validation / (setup.n_train + setup.n_validation)
    train_set, val_set = ds.split(fraction, seed=seed)
    train_scans = tuple(train_set.scan(i) for i in range(min(len(train_set), setup.n_train)))
    val_scans = tuple(val_set.scan(i) for i in range(min(len(val_set), setup.n_validation)))
    data = LabelledScans(train_scans, val_scans, (), (), ds.class_names)
    return data, ds.class_names, ds.ignore_label


def load_rules(path: str | None):
    import quantrules as qr

    return (
        qr.load_rules(path)
        if path
        else qr.rules_from_config(DEFAULT_RULES, source="built-in rules")
    )


def rel_error(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))




def train(model, batches, setup: Setup, seed: int, ignore: int | None = None) -> list[float]:
    """Adam on the training scans in turn; returns the loss per step. Labels
    equal to ``ignore`` (unlabeled points of a dataset) add no loss."""
    import mlx.core as mx
    import mlx.optimizers as optim

    from mlx_lattice.models import class_weights, train_step

    mx.random.seed(seed)
    optimizer = optim.Adam(learning_rate=setup.learning_rate)
    weights = class_weights(
        np.concatenate([np.array(b.labels) for b in batches]), model.num_classes
    )
    model.train()
    losses: list[float] = []
    # A bar of steps, steps/s and the loss on a terminal; silent otherwise.
    bar = tqdm(range(setup.steps), desc="training", unit="step", leave=False, disable=None,
               file=sys.stderr)  # fmt: skip
    for step in bar:
        batch = batches[step % len(batches)]
        losses.append(
            train_step(
                model, optimizer, batch.tensor, batch.labels, weights=weights, ignore_index=ignore
            )
        )
        bar.set_postfix(loss=f"{losses[-1]:.4f}", mean10=f"{np.mean(losses[-10:]):.4f}",
                        refresh=False)  # fmt: skip
    model.eval()
    return losses


def score(model, batches, num_classes: int | None = None) -> tuple[float, np.ndarray, list[np.ndarray]]:
    """mIoU and per-class IoU over the labelled points of ``batches`` (labels
    past the last class are unlabeled and not scored), and each batch's
    point predictions. ``model`` is a model or a compiled graph (then
    ``num_classes`` is given)."""
    from mlx_lattice.data import confusion_matrix, iou_per_class, mean_iou
    from mlx_lattice.models import predict

    k = model.num_classes if num_classes is None else num_classes
    cm = np.zeros((k, k), np.int64)
    preds = []
    for b in batches:
        pred = predict(model, b.tensor)[b.point_to_voxel]
        preds.append(pred)
        keep = b.point_labels < k
        cm += confusion_matrix(pred[keep], b.point_labels[keep], k)
    return mean_iou(cm), iou_per_class(cm), preds


def variant_rules(rules, variant: str):
    """The rule set for a variant: as written, or with every weight qtype replaced."""
    import quantrules as qr

    if variant == "rules":
        return rules
    if variant == "float":
        return None
    out = []
    for rule in qr.as_rules(rules)[0]:
        out.append(dataclasses.replace(rule, weight_qtype=variant) if rule.weight_qtype else rule)
    return out


def module_at(model, path: str):
    node = model
    for part in path.split("/"):
        node = node[part]
    return node


def module_bytes(module) -> int:
    """Bytes of a module's arrays (packed weights, scales, biases, norms)."""
    from mlx.utils import tree_flatten

    return int(sum(a.nbytes for _, a in tree_flatten(module.parameters())))


def forward_ms(model, tensor, repeats: int = 3) -> float:
    import mlx.core as mx

    mx.eval(model(tensor).feats)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(model(tensor).feats)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def compare_variants(model, rules, eval_tensor, val_batches, setup: Setup, progress) -> dict:
    """Each variant's quantization report, trace, mIoU, bytes and time."""
    import mlx.core as mx

    import mlx_lattice
    from mlx_lattice.models import MinkUNet

    results = {}
    for variant in VARIANTS:
        with progress.step(f"{variant}: quantize, score, trace"):
            copy = MinkUNet(model.in_channels, model.num_classes, setup.widths)
            copy.update(model.parameters())
            report = None
            quant = variant_rules(rules, variant)
            if quant is not None:
                report = mlx_lattice.quantize(copy, quant)
            copy.eval()
            miou, ious, preds = score(copy, val_batches)
            mx.eval(copy(eval_tensor).feats)  # relations are cached: time the layers alone
            trace: dict = {}
            copy(eval_tensor, trace)
            results[variant] = {
                "model": copy,
                "report": report,
                "miou": miou,
                "ious": ious,
                "preds": preds,
                "trace": trace,
                "bytes": module_bytes(copy),
                "ms": forward_ms(copy, eval_tensor),
            }
    return results


def compiled_static_int8(model, train_batches, val_batches, eval_tensor, setup: Setup,
                         progress) -> dict:  # fmt: skip
    """The float model quantized to int8 weights and static int8 activations
    (every convolution but the 2-channel stem; the head stays float),
    calibrated on the first training scans and compiled: its mIoU, bytes
    and forward time."""
    import mlx_lattice
    import quantrules as qr
    from mlx_lattice.models import MinkUNet

    with progress.step(f"{COMPILED}: quantize, calibrate, compile, score"):
        copy = MinkUNet(model.in_channels, model.num_classes, setup.widths)
        copy.update(model.parameters())
        rules = [
            qr.Rule(module_path="stem/.*"),
            qr.Rule(
                op_names=("sparse_conv",),
                weight_qtype="int8",
                act_qtype="int8",
                act_static_scale=True,
                tile_size=32,
            ),
        ]
        mlx_lattice.quantize(copy, rules)
        mlx_lattice.calibrate(copy, train_batches[:CALIBRATION_SCANS])
        net = mlx_lattice.compile(copy.eval())
        miou, ious, preds = score(net, val_batches, model.num_classes)
        return {
            "model": net,
            "source": copy,  # the calibrated quantized model, exported as an artifact
            "miou": miou,
            "ious": ious,
            "preds": preds,
            "bytes": module_bytes(copy),
            "ms": forward_ms(net, eval_tensor),
        }


def print_summary(results: dict, class_names: Sequence[str], out=None) -> None:
    out = out or sys.stdout
    print("\nsparse MinkUNet (mlx_lattice, op sparse_conv) on the validation scans", file=out)
    print(f"{'':14s}" + "".join(f"{v:>10s}" for v in SCORED), file=out)
    print(f"{'mIoU':14s}" + "".join(f"{results[v]['miou']:10.3f}" for v in SCORED), file=out)
    for k, name in enumerate(class_names):
        cells = "".join(f"{results[v]['ious'][k]:10.3f}" for v in SCORED)
        print(f"{'IoU ' + name:14s}{cells}", file=out)
    print(f"{'bytes':14s}" + "".join(f"{results[v]['bytes']:10d}" for v in SCORED), file=out)
    print(f"{'forward ms':14s}" + "".join(f"{results[v]['ms']:10.1f}" for v in SCORED), file=out)
    print(
        "float: trained weights; int8/int4: the rule set with every weight qtype set to it; "
        f"rules: the rule set as written; {COMPILED}: int8 weights and static int8 activations "
        f"(every convolution but the stem), calibrated on {CALIBRATION_SCANS} training scans "
        "(mlx_lattice.calibrate), run as the compiled graph (mlx_lattice.compile). bytes: all "
        "weights, norms and the head.",
        file=out,
    )
    drop = results["float"]["miou"] - results[COMPILED]["miou"]
    print(f"{COMPILED} mIoU drop against float: {drop:.4f}", file=out)


def print_layers(results: dict, rules, out=None) -> None:
    """Per layer: the rule (as written), error, bytes and time of each variant."""
    import quantrules as qr

    out = out or sys.stdout
    quantized = [v for v in VARIANTS if v != "float"]
    print(
        "\nper layer (error: relative L2 error of the layer's output vs the float model)", file=out
    )
    print(
        f"{'module path':22s}"
        + "".join(f"{'err ' + v:>10s}" for v in quantized)
        + "".join(f"{'B ' + v:>9s}" for v in VARIANTS)
        + "".join(f"{'ms ' + v:>9s}" for v in VARIANTS)
        + "  rule (quantrules.explain)",
        file=out,
    )
    float_trace = results["float"]["trace"]
    for path, (out_float, _) in float_trace.items():
        errs = "".join(
            f"{rel_error(results[v]['trace'][path][0], out_float):10.2e}" for v in quantized
        )
        sizes = "".join(
            f"{module_bytes(module_at(results[v]['model'], path)):9d}" for v in VARIANTS
        )
        times = "".join(f"{results[v]['trace'][path][1] * 1e3:9.2f}" for v in VARIANTS)
        op = "dot_general" if path == "head" else "sparse_conv"
        summary = qr.explain(rules, module_path=path, op=op).summary
        print(f"{path:22s}{errs}{sizes}{times}  {summary}", file=out)


def print_table(title: str, rows: list[tuple], out=None) -> None:
    """Rows: (path, rule, error, float s, quantized s, bytes float, bytes quantized)."""
    out = out or sys.stdout
    print(f"\n{title}", file=out)
    print(
        f"{'module path':22s} {'error':>9s} {'float ms':>9s} {'quant ms':>9s} {'bytes float':>12s} "
        f"{'bytes quant':>12s}  rule (quantrules.explain)",
        file=out,
    )
    for path, rule, err, t_float, t_quant, before, after in rows:
        print(
            f"{path:22s} {err:9.2e} {t_float * 1e3:9.2f} {t_quant * 1e3:9.2f} {before:12d} {after:12d}  {rule}",
            file=out,
        )
    print(
        "error: relative L2 error of the layer's output in the quantized model vs the float model",
        file=out,
    )


def host_class() -> str:
    """The CPU this run used, in words: model name, cores, vector extensions."""
    import platform

    model, flags = platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == platform.machine():
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    isa = [name for name, flag in (("AVX-512F", "avx512f"), ("AVX512_VNNI", "avx512_vnni"),
                                   ("AVX512_BF16", "avx512_bf16"), ("AMX", "amx_tile"))
           if flag in flags]  # fmt: skip
    return f"{model}, {os.cpu_count()} cores" + (f", {', '.join(isa)}" if isa else "")


def write_results(path: Path, results: dict, class_names: Sequence[str], setup: Setup,
                  steps_per_s: float, data: str) -> Path:  # fmt: skip
    """The scores of this run as a reStructuredText fragment the docs include
    (``docs/results/demo.inc``): a table of mIoU, per-class IoU and weight
    bytes per variant, under a line naming the run (date, host, load)."""
    import datetime

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    rows = [["mIoU", *(f"{results[v]['miou']:.3f}" for v in SCORED)]]
    rows += [[f"IoU {name}", *(f"{results[v]['ious'][k]:.3f}" for v in SCORED)]
             for k, name in enumerate(class_names)]  # fmt: skip
    rows.append(["weights (MB)", *(f"{results[v]['bytes'] / 1e6:.2f}" for v in SCORED)])
    lines = [
        ".. Written by examples/demo.py (--results); refresh with",
        ".. ./bazelw run //examples:demo -- --results docs/results/demo.inc",
        "",
        f"Run of {when}: ``{setup.steps}`` training steps on {data} at {steps_per_s:.1f} steps/s, "
        f"host {host_class()}, load average {load:.1f}.",
        "",
        ".. list-table::",
        "   :header-rows: 1",
        "",
        "   * - score",
        *(f"     - {v}" for v in SCORED),
    ]
    for row in rows:
        lines.append(f"   * - {row[0]}")
        lines.extend(f"     - {cell}" for cell in row[1:])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def output_dir(arg: str | None) -> Path:
    """``--out-dir``, else a folder in the system's temporary directory."""
    path = Path(arg) if arg else Path(tempfile.gettempdir()) / "mlx_lattice_demo"
    if arg and not path.is_absolute() and "BUILD_WORKING_DIRECTORY" in os.environ:
        path = Path(os.environ["BUILD_WORKING_DIRECTORY"]) / path  # `bazel run` changes cwd
    path.mkdir(parents=True, exist_ok=True)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """The demo with the flags ``argv`` (without the program name; ``None``:
    the command line)."""
    cli.parsed(argv)
    setup = QUICK if _QUICK.value else FULL
    if _STEPS.value is not None:
        setup = dataclasses.replace(setup, steps=_STEPS.value)
    data_dir = Path(_DATA.value) if _DATA.value is not None else None
    points_path = Path(_POINTS.value) if _POINTS.value is not None else None
    seed = _SEED.value

    import quantrules as qr
    from examples import jax_head
    from examples.pictures import loss_curve_png, top_down_png
    from mlx_lattice.data import (
        CLASS_NAMES,
        SceneConfig,
        labelled_scans,
        make_batch,
        parse_features,
    )
    from mlx_lattice.models import MinkUNet

    features = parse_features(_FEATURES.value)
    rules = load_rules(_RULES.value)
    out_dir = output_dir(_OUT_DIR.value)
    progress = Progress(total=4 + len(SCORED) + 2)
    if data_dir is not None:
        with progress.step(f"labelled scans: {_LAYOUT.value} data in {data_dir}, voxelized"):
            data, class_names, ignore = dataset_scans(data_dir, _LAYOUT.value, setup, seed)
            train_batches = [make_batch([s], setup.voxel_size, features) for s in data.train]
            val_batches = [make_batch([s], setup.voxel_size, features) for s in data.validation]
        print(
            f"data: {data_dir} ({_LAYOUT.value}): {len(data.train)} training scans, "
            f"{len(data.validation)} validation scans (seeded split); voxels of "
            f"{setup.voxel_size} m: {train_batches[0].tensor.num_points} voxels in the first "
            f"scan; classes: {', '.join(class_names)}"
        )
    else:
        with progress.step("labelled scans: seeded synthetic streets, voxelized"):
            config = SceneConfig(beams=setup.beams, azimuth_steps=setup.azimuth_steps)
            data = labelled_scans(setup.n_train, setup.n_validation, seed=seed, config=config)
            train_batches = [make_batch([s], setup.voxel_size, features) for s in data.train]
            val_batches = [make_batch([s], setup.voxel_size, features) for s in data.validation]
            class_names, ignore = CLASS_NAMES, None
        print(
            f"data: {setup.n_train} training scans (seeds {data.train_seeds}), {setup.n_validation} "
            f"validation scans (seeds {data.validation_seeds}); {setup.beams} beams, voxels of "
            f"{setup.voxel_size} m: {train_batches[0].tensor.num_points} voxels in the first "
            f"scan; classes: {', '.join(CLASS_NAMES)}"
        )
    import mlx.core as mx

    import mlx_lattice

    # Freed arrays stay in the process for the next step: without this, glibc
    # maps (and page-faults) every large array of every step anew.
    mlx_lattice.retain_freed_memory()
    mx.random.seed(seed)
    model = MinkUNet(len(features), len(class_names), setup.widths)
    with progress.step(f"train MinkUNet widths {setup.widths} for {setup.steps} steps"):
        start = time.perf_counter()
        losses = train(model, train_batches, setup, seed, ignore)
        took = time.perf_counter() - start
    print(
        f"training: loss {np.mean(losses[:10]):.4f} -> {np.mean(losses[-10:]):.4f} (mean of the "
        f"first / last 10 steps), {setup.steps / took:.1f} steps/s"
    )
    if points_path:
        with progress.step(f"read {points_path}"):
            eval_scan = read_scan(points_path)
            eval_tensor = make_batch([eval_scan], setup.voxel_size, features).tensor
        source = f"{points_path} ({len(eval_scan.points)} points, {eval_tensor.num_points} voxels)"
    else:
        with progress.step("per-layer input: the first validation scan"):
            eval_tensor = val_batches[0].tensor
        first = data.validation_seeds[0] if data.validation_seeds else "on disk"
        source = f"validation scan {first} ({eval_tensor.num_points} voxels)"
    results = compare_variants(model, rules, eval_tensor, val_batches, setup, progress)
    results[COMPILED] = compiled_static_int8(
        model, train_batches, val_batches, eval_tensor, setup, progress
    )
    with progress.step("dense JAX head: an NNX model quantized by the rules") as step:
        feats = np.array(model.features(eval_tensor).feats).astype(np.float32)
        head, head_report, dense_rows = jax_head.run_head(
            rules, feats, 64, model.num_classes, seed, step)

    print(f"rules: {_RULES.value or 'built-in'} ({len(qr.as_rules(rules)[0])} rules)")
    print(f"per-layer input: {source}")
    print_summary(results, class_names)
    print_layers(results, rules)
    print_table("dense JAX head on the U-Net features (NNX, taktiny_ops.quantize)", dense_rows)
    report = results["rules"]["report"]
    print(
        f"\nrules: conv weights {report.bytes_before} -> {report.bytes_after} bytes "
        f"({len(report.quantized)} of {len(report.layers)} conv layers quantized)"
    )
    jax_head.side_by_side(rules, report, head_report, sys.stdout)

    with progress.step("pictures (matplotlib): loss curve, validation scan from above"):
        loss_png = loss_curve_png(
            out_dir / "loss_curve.png", losses, title=f"MinkUNet training loss, {setup.steps} steps"
        )
        scan = data.validation[0]
        view_png = top_down_png(
            out_dir / "validation_scan.png",
            scan.points,
            [
                (
                    f"prediction (float, mIoU {results['float']['miou']:.2f})",
                    results["float"]["preds"][0],
                ),
                ("ground truth", scan.labels),
            ],
            class_names,
            extent=30.0,
        )
    results_path = Path(_RESULTS.value) if _RESULTS.value else out_dir / "results.inc"
    if not results_path.is_absolute() and "BUILD_WORKING_DIRECTORY" in os.environ:
        results_path = Path(os.environ["BUILD_WORKING_DIRECTORY"]) / results_path  # `bazel run`
    data_name = f"{data_dir} ({_LAYOUT.value})" if data_dir is not None else "the built-in streets"
    write_results(results_path, results, class_names, setup, setup.steps / took, data_name)
    print(f"\nloss curve: {loss_png}\nvalidation scan, top-down: {view_png}\nscores: {results_path}")
    with progress.step("export the float, the quantized and the static int8 model"):
        from mlx_lattice import export

        artifacts = {}
        for variant, stem, key in (
            ("float", "minkunet", "model"),
            ("rules", "minkunet-quantized", "model"),
            (COMPILED, "minkunet-static-int8", "source"),
        ):
            artifacts[variant] = out_dir / f"{stem}.mlxl"
            export.export_model(
                results[variant][key],
                artifacts[variant],
                voxel_size=setup.voxel_size,
                features=features,
                class_names=class_names,
                metadata={"steps": str(setup.steps), "seed": str(seed)},
            )
    float_bytes = artifacts["float"].stat().st_size
    quant_bytes = artifacts["rules"].stat().st_size
    static_bytes = artifacts[COMPILED].stat().st_size
    print(
        f"artifacts (export_model; //examples:segment --model runs them without the model "
        f"classes, as the compiled graph): float {float_bytes} bytes, quantized by the rules "
        f"{quant_bytes} bytes ({quant_bytes / float_bytes:.2f}x), {COMPILED} (calibrated) "
        f"{static_bytes} bytes ({static_bytes / float_bytes:.2f}x): {artifacts['float']}, "
        f"{artifacts['rules']}, {artifacts[COMPILED]}"
    )
    if _SAVE.value:
        from mlx_lattice.models import save_model

        save_path = Path(_SAVE.value)
        if not save_path.is_absolute() and "BUILD_WORKING_DIRECTORY" in os.environ:
            save_path = Path(os.environ["BUILD_WORKING_DIRECTORY"]) / save_path
        q_path = save_path.with_name(save_path.stem + "-quantized" + save_path.suffix)
        info = {"steps": setup.steps, "seed": seed, "data": str(data_dir or "built-in")}
        save_model(save_path, model, voxel_size=setup.voxel_size, class_names=class_names,
                   metadata=info, features=features)  # fmt: skip
        save_model(q_path, results["rules"]["model"], voxel_size=setup.voxel_size,
                   class_names=class_names, rules=rules, metadata=info,
                   features=features)  # fmt: skip
        print(
            f"saved: {save_path} (float) and {q_path} (quantized by the rules), each with its "
            "configuration: run one with //examples:segment"
        )
    head_path = (q_path.with_name(save_path.stem + "-jax-head.tkjax") if _SAVE.value
                 else out_dir / "jax_head.tkjax")
    size = jax_head.export_head(head, feats, head_path)
    shown = f"{size} bytes" if isinstance(size, int) else size
    print(f"JAX head (jax.export, loads with plain JAX): {head_path}, {shown}")
    return 0


if __name__ == "__main__":
    cli.run(main)
