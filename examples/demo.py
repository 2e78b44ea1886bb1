"""The main job: train a sparse segmenter, then apply one quantization rule
set to two back-ends.

1. A small MinkUNet (``mlx_lattice.models``) is trained for ``--steps`` steps
   on the built-in labelled LiDAR scans (seeded synthetic streets: ground,
   building, car, pole, vegetation), with a progress bar of loss and steps/s.
   It reports validation mIoU and per-class IoU, and writes a PNG loss curve
   and a top-down PNG of one validation scan (prediction next to ground truth).
2. One ``quantrules`` rule set (built in, or ``--rules rules.json``) is
   applied with ``mlx_lattice.quantize``: as written, and with its weight
   qtypes set to int8 and to int4. Side by side with the float model: mIoU,
   per-layer error, weight bytes and time (``--points FILE`` runs the
   per-layer comparison on your own ``.npy``/``.ply`` cloud instead).
3. The same rule set drives a small dense JAX head (a per-voxel MLP on the
   U-Net's features) through ``taktiny_ops.linear`` (op ``dot_general``).

Run with ``./bazelw run //examples:demo`` (``-- --help`` for options;
``-- --quick`` for a seconds-long run).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

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


class Progress:
    """Step lines on stderr with elapsed time (a live counter on a terminal)."""

    def __init__(self, total: int, stream=None) -> None:
        stream = stream or sys.stderr
        self.total, self.count, self.stream = total, 0, stream
        self.live = stream.isatty()

    def step(self, text: str):
        self.count += 1
        progress = self

        class _Step:
            def __enter__(self_inner):
                self_inner.start = time.perf_counter()
                end = "" if progress.live else "\n"
                progress.stream.write(f"[{progress.count}/{progress.total}] {text} ...{end}")
                progress.stream.flush()
                return self_inner

            def update(self_inner, detail: str) -> None:
                if progress.live:
                    progress.stream.write(
                        f"\r[{progress.count}/{progress.total}] {text} ... {detail}   "
                    )
                    progress.stream.flush()

            def __exit__(self_inner, *exc) -> None:
                took = time.perf_counter() - self_inner.start
                prefix = "\r" if progress.live else ""
                progress.stream.write(
                    f"{prefix}[{progress.count}/{progress.total}] {text} done in {took:.2f} s\n"
                )
                progress.stream.flush()

        return _Step()


def read_points(path: Path) -> np.ndarray:
    """``(M, 3)`` float32 points from ``.npy`` (first three columns) or ``.ply``.

    A file that cannot be read as points is a ValueError naming the file.
    """
    try:
        return _read_points(path)
    except ValueError as err:
        if str(path) in str(err):
            raise
        raise ValueError(f"{path}: cannot read points: {err}") from None
    except Exception as err:
        # NumPy's .npy header parser alone raises EOFError, SyntaxError,
        # tokenize.TokenError and TypeError on damaged files; the PLY header
        # parser KeyError, IndexError and StopIteration.
        raise ValueError(f"{path}: cannot read points: {type(err).__name__}: {err}") from None


def _read_points(path: Path) -> np.ndarray:
    if path.suffix == ".npy":
        data = np.load(path)
        if data.ndim != 2 or data.shape[1] < 3:
            raise ValueError(f"{path}: expected an (M, >=3) array, got shape {data.shape}.")
        return data[:, :3].astype(np.float32)
    if path.suffix == ".ply":
        return _read_ply(path)
    raise ValueError(f"{path}: unsupported point file (use .npy or .ply).")


def _read_ply(path: Path) -> np.ndarray:
    raw = path.read_bytes()
    end = raw.find(b"end_header")
    if not raw.startswith(b"ply") or end < 0:
        raise ValueError(f"{path}: not a PLY file.")
    header = raw[:end].decode("ascii", "replace").splitlines()
    body = raw[raw.index(b"\n", end) + 1 :]
    fmt = next(line.split()[1] for line in header if line.startswith("format"))
    count, props, in_vertex = 0, [], False
    types = {"float": "f4", "float32": "f4", "double": "f8", "float64": "f8", "uchar": "u1", "uint8": "u1",
             "char": "i1", "int8": "i1", "short": "i2", "int16": "i2", "ushort": "u2", "uint16": "u2",
             "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4"}  # fmt: skip
    for line in header:
        parts = line.split()
        if parts[:2] == ["element", "vertex"]:
            count, in_vertex = int(parts[2]), True
        elif parts and parts[0] == "element":
            in_vertex = False
        elif in_vertex and parts[:1] == ["property"]:
            if parts[1] == "list":
                raise ValueError(f"{path}: list properties in vertices are not supported.")
            props.append((parts[2], types[parts[1]]))
    names = [n for n, _ in props]
    if not {"x", "y", "z"} <= set(names):
        raise ValueError(f"{path}: vertices need x, y, z properties.")
    if fmt == "ascii":
        rows = np.loadtxt(body.decode("ascii").splitlines()[:count], ndmin=2)
        return rows[:, [names.index(a) for a in "xyz"]].astype(np.float32)
    order = "<" if fmt == "binary_little_endian" else ">"
    dtype = np.dtype([(n, order + t) for n, t in props])
    verts = np.frombuffer(body, dtype=dtype, count=count)
    return np.stack([verts[a] for a in "xyz"], axis=1).astype(np.float32)


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


def run_dense(rules, feats: np.ndarray, hidden: int, classes: int, seed: int, step) -> list[tuple]:
    """A per-voxel MLP head (seeded weights) through taktiny_ops, float and
    quantized, layer by layer; ``step`` shows the layer being run."""
    import jax
    import jax.numpy as jnp

    import quantrules as qr
    import taktiny_ops as tk

    rng = np.random.default_rng(seed)
    sizes = [feats.shape[1], hidden, hidden, classes]
    names = ["mlp/fc1", "mlp/fc2", "head"]
    weights = [
        jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32)
        for a, b in itertools.pairwise(sizes)
    ]
    rows = []
    x_float = x_quant = jnp.asarray(feats)
    for i, (name, w) in enumerate(zip(names, weights, strict=True)):
        step.update(name)
        layer = jax.jit(
            lambda x, w, quant, name=name: tk.linear(x, w, quant=quant, module_path=name),
            static_argnums=2,
        )
        layer(x_float, w, None).block_until_ready()  # compile outside the timing
        layer(x_quant, w, rules).block_until_ready()
        start = time.perf_counter()
        y_float = jax.block_until_ready(layer(x_float, w, None))
        t_float = time.perf_counter() - start
        start = time.perf_counter()
        y_quant = jax.block_until_ready(layer(x_quant, w, rules))
        t_quant = time.perf_counter() - start
        res = qr.resolve(rules, module_path=name, op="dot_general")
        summary = qr.explain(rules, module_path=name, op="dot_general").summary
        bits = (
            qr.get_qtype(res.rule.weight_qtype).bits
            if res and not res.disabled and res.rule.weight_qtype
            else 32
        )
        stored = w.size * bits // 8 + (4 * w.shape[1] if bits < 32 else 0)
        rows.append(
            (
                name,
                summary,
                rel_error(y_quant, y_float),
                t_float,
                t_quant,
                int(w.nbytes),
                int(stored),
            )
        )
        if i < len(names) - 1:
            x_float, x_quant = jax.nn.relu(y_float), jax.nn.relu(y_quant)
    return rows


class TrainingBar:
    """A progress bar of steps, loss and steps/s on stderr (a line every
    tenth of the run when stderr is not a terminal)."""

    def __init__(self, total: int, stream=None) -> None:
        self.total, self.stream = total, stream or sys.stderr
        self.live = self.stream.isatty()
        self.start = time.perf_counter()
        self.every = max(1, total // 10)

    def update(self, step: int, loss: float, avg: float) -> None:
        rate = step / max(time.perf_counter() - self.start, 1e-9)
        filled = int(30 * step / self.total)
        line = (
            f"[{'#' * filled}{'-' * (30 - filled)}] step {step}/{self.total} "
            f"loss {loss:.4f} (mean of last 10: {avg:.4f}) {rate:.1f} steps/s"
        )
        if self.live:
            self.stream.write("\r" + line + ("\n" if step == self.total else ""))
        elif step % self.every == 0 or step == self.total:
            self.stream.write(line + "\n")
        self.stream.flush()


def train(model, batches, setup: Setup, seed: int) -> list[float]:
    """Adam on the training scans in turn; returns the loss per step."""
    import mlx.core as mx
    import mlx.optimizers as optim

    from mlx_lattice.models import class_weights, train_step

    mx.random.seed(seed)
    optimizer = optim.Adam(learning_rate=setup.learning_rate)
    weights = class_weights(np.concatenate([np.array(b.labels) for b in batches]), NUM_CLASSES)
    model.train()
    bar = TrainingBar(setup.steps)
    losses: list[float] = []
    for step in range(setup.steps):
        batch = batches[step % len(batches)]
        losses.append(train_step(model, optimizer, batch.tensor, batch.labels, weights=weights))
        bar.update(step + 1, losses[-1], float(np.mean(losses[-10:])))
    model.eval()
    return losses


def score(model, batches) -> tuple[float, np.ndarray, list[np.ndarray]]:
    """mIoU and per-class IoU over the points of ``batches``, and each batch's point predictions."""
    from mlx_lattice.data import confusion_matrix, iou_per_class, mean_iou
    from mlx_lattice.models import predict

    cm = np.zeros((NUM_CLASSES, NUM_CLASSES), np.int64)
    preds = []
    for b in batches:
        pred = predict(model, b.tensor)[b.point_to_voxel]
        preds.append(pred)
        cm += confusion_matrix(pred, b.point_labels, NUM_CLASSES)
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
            copy = MinkUNet(2, NUM_CLASSES, setup.widths)
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


def print_summary(results: dict, class_names: Sequence[str], out=None) -> None:
    out = out or sys.stdout
    print("\nsparse MinkUNet (mlx_lattice, op sparse_conv) on the validation scans", file=out)
    print(f"{'':14s}" + "".join(f"{v:>10s}" for v in VARIANTS), file=out)
    print(f"{'mIoU':14s}" + "".join(f"{results[v]['miou']:10.3f}" for v in VARIANTS), file=out)
    for k, name in enumerate(class_names):
        cells = "".join(f"{results[v]['ious'][k]:10.3f}" for v in VARIANTS)
        print(f"{'IoU ' + name:14s}{cells}", file=out)
    print(f"{'bytes':14s}" + "".join(f"{results[v]['bytes']:10d}" for v in VARIANTS), file=out)
    print(f"{'forward ms':14s}" + "".join(f"{results[v]['ms']:10.1f}" for v in VARIANTS), file=out)
    print(
        "float: trained weights; int8/int4: the rule set with every weight qtype set to it; "
        "rules: the rule set as written. bytes: all weights, norms and the head.",
        file=out,
    )


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


def output_dir(arg: str | None) -> Path:
    """``--out-dir``, else a folder in the system's temporary directory."""
    path = Path(arg) if arg else Path(tempfile.gettempdir()) / "mlx_lattice_demo"
    if arg and not path.is_absolute() and "BUILD_WORKING_DIRECTORY" in os.environ:
        path = Path(os.environ["BUILD_WORKING_DIRECTORY"]) / path  # `bazel run` changes cwd
    path.mkdir(parents=True, exist_ok=True)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", help="quantrules JSON file (default: the built-in rule set)")
    parser.add_argument(
        "--points",
        type=Path,
        help="point cloud .npy (M, >=3) or .ply for the per-layer comparison "
        "(default: the first validation scan)",
    )
    parser.add_argument("--steps", type=int, help=f"training steps (default {FULL.steps})")
    parser.add_argument(
        "--save", type=Path, help="save the float and quantized weights (.safetensors)"
    )
    parser.add_argument("--out-dir", help="where the PNGs go (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small scene, model and run (tests)")
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    if args.steps is not None:
        if args.steps < 1:
            parser.error("--steps must be >= 1")
        setup = dataclasses.replace(setup, steps=args.steps)
    if args.save is not None and args.save.suffix not in (".safetensors", ".npz"):
        parser.error("--save needs a .safetensors or .npz path")

    import quantrules as qr
    from examples.pictures import loss_curve_png, top_down_png
    from mlx_lattice.data import CLASS_NAMES, LidarScan, SceneConfig, labelled_scans, make_batch
    from mlx_lattice.models import MinkUNet

    rules = load_rules(args.rules)
    out_dir = output_dir(args.out_dir)
    progress = Progress(total=4 + len(VARIANTS) + 1)
    with progress.step("labelled scans: seeded synthetic streets, voxelized"):
        config = SceneConfig(beams=setup.beams, azimuth_steps=setup.azimuth_steps)
        data = labelled_scans(setup.n_train, setup.n_validation, seed=args.seed, config=config)
        train_batches = [make_batch([s], setup.voxel_size) for s in data.train]
        val_batches = [make_batch([s], setup.voxel_size) for s in data.validation]
    print(
        f"data: {setup.n_train} training scans (seeds {data.train_seeds}), {setup.n_validation} "
        f"validation scans (seeds {data.validation_seeds}); {setup.beams} beams, voxels of "
        f"{setup.voxel_size} m: {train_batches[0].tensor.num_points} voxels in the first scan; "
        f"classes: {', '.join(CLASS_NAMES)}"
    )
    import mlx.core as mx

    import mlx_lattice

    # Freed arrays stay in the process for the next step: without this, glibc
    # maps (and page-faults) every large array of every step anew.
    mlx_lattice.retain_freed_memory()
    mx.random.seed(args.seed)
    model = MinkUNet(2, NUM_CLASSES, setup.widths)
    with progress.step(f"train MinkUNet widths {setup.widths} for {setup.steps} steps"):
        start = time.perf_counter()
        losses = train(model, train_batches, setup, args.seed)
        took = time.perf_counter() - start
    print(
        f"training: loss {np.mean(losses[:10]):.4f} -> {np.mean(losses[-10:]):.4f} (mean of the "
        f"first / last 10 steps), {setup.steps / took:.1f} steps/s"
    )
    if args.points:
        with progress.step(f"read {args.points}"):
            points = read_points(args.points)
            # Unlabelled: the zero labels only fill the batch; no mIoU is computed on it.
            eval_tensor = make_batch(
                [LidarScan(points, np.zeros(len(points), np.int32))], setup.voxel_size
            ).tensor
        source = f"{args.points} ({len(points)} points, {eval_tensor.num_points} voxels)"
    else:
        with progress.step("per-layer input: the first validation scan"):
            eval_tensor = val_batches[0].tensor
        source = (
            f"validation scan seed {data.validation_seeds[0]} ({eval_tensor.num_points} voxels)"
        )
    results = compare_variants(model, rules, eval_tensor, val_batches, setup, progress)
    with progress.step("dense JAX head through taktiny_ops (float and quantized)") as step:
        feats = np.array(model.features(eval_tensor).feats).astype(np.float32)
        dense_rows = run_dense(rules, feats, 64, NUM_CLASSES, args.seed, step)

    print(f"rules: {args.rules or 'built-in'} ({len(qr.as_rules(rules)[0])} rules)")
    print(f"per-layer input: {source}")
    print_summary(results, CLASS_NAMES)
    print_layers(results, rules)
    print_table("dense JAX head on the U-Net features (taktiny_ops, op dot_general)", dense_rows)
    report = results["rules"]["report"]
    print(
        f"\nrules: conv weights {report.bytes_before} -> {report.bytes_after} bytes "
        f"({len(report.quantized)} of {len(report.layers)} conv layers quantized)"
    )

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
        CLASS_NAMES,
        extent=30.0,
    )
    print(f"\nloss curve: {loss_png}\nvalidation scan, top-down: {view_png}")
    if args.save:
        q_path = args.save.with_name(args.save.stem + "-quantized" + args.save.suffix)
        model.save_weights(str(args.save))
        results["rules"]["model"].save_weights(str(q_path))
        print(
            f"saved: {args.save} (float) and {q_path} (quantized by the rules; load it into "
            "a MinkUNet quantized with the same rules)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
