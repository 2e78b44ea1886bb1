"""The main job: one quantization rule set applied to two back-ends.

A seeded synthetic LiDAR scan (or ``--points FILE``, ``.npy`` or ``.ply``) is
voxelized and fed to

* a small dense JAX model (a per-voxel MLP) whose layers run through
  ``taktiny_ops.linear`` (op ``dot_general``), and
* a sparse U-Net whose convolutions run through ``mlx_lattice`` (op
  ``sparse_conv``), quantized by ``mlx_lattice.quantize``.

Both resolve the same ``quantrules`` rules (built in, or ``--rules
rules.json``) at their module paths. Per layer it prints: module path, the
rule chosen (``quantrules.explain``), error vs the float model, time, bytes.

Run with ``./bazelw run //examples:demo`` (``-- --help`` for options).
"""

from __future__ import annotations

import argparse
import itertools
import sys
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
    """``(M, 3)`` float32 points from ``.npy`` (first three columns) or ``.ply``."""
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


def run_dense(
    rules, feats: np.ndarray, hidden: int, classes: int, seed: int, progress: Progress
) -> list[tuple]:
    """The per-voxel MLP through taktiny_ops, float and quantized, layer by layer."""
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
    with progress.step("dense JAX model through taktiny_ops (float and quantized)") as step:
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


def run_sparse(
    rules, tensor, widths: Sequence[int], classes: int, seed: int, progress: Progress
) -> tuple[list[tuple], object]:
    """The sparse U-Net through mlx_lattice, float and quantized, layer by layer."""
    import mlx.core as mx

    import mlx_lattice
    import quantrules as qr
    from examples.sparse_unet import SparseUNet

    mx.random.seed(seed)
    model = SparseUNet(tensor.num_channels, classes, widths)
    model.eval()
    quantized = SparseUNet(tensor.num_channels, classes, widths)
    quantized.update(model.parameters())
    quantized.eval()
    with progress.step("warm-up pass: build and cache the kernel relations"):
        mx.eval(model(tensor).feats)
        built = tensor.manager.cached_relations
    with progress.step("sparse U-Net float forward"):
        float_trace: dict = {}
        model(tensor, float_trace)
    with progress.step("quantize the U-Net with the rules"):
        report = mlx_lattice.quantize(quantized, rules)
    with progress.step("sparse U-Net quantized forward (same relations)"):
        quant_trace: dict = {}
        quantized(tensor, quant_trace)
    if tensor.manager.cached_relations != built:
        raise RuntimeError("the quantized pass built new relations; they should be shared.")
    per_layer = {layer.path: layer for layer in report.layers}
    rows = []
    for path, (out_float, t_float) in float_trace.items():
        out_quant, t_quant = quant_trace[path]
        layer = per_layer.get(path)
        summary = (
            layer.rule if layer else qr.explain(rules, module_path=path, op="dot_general").summary
        )
        before = layer.bytes_before if layer else int(model.head.weight.nbytes)
        after = layer.bytes_after if layer else before
        rows.append(
            (path, summary, rel_error(out_quant, out_float), t_float, t_quant, before, after)
        )
    print(
        f"relations: {built} built once and shared by all {len(float_trace)} layers of both passes"
    )
    return rows, report


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
    totals = [sum(r[i] for r in rows) for i in (3, 4, 5, 6)]
    print(
        f"{'total':22s} {'':9s} {totals[0] * 1e3:9.2f} {totals[1] * 1e3:9.2f} {totals[2]:12d} {totals[3]:12d}",
        file=out,
    )
    print(
        "error: relative L2 error of the layer's output in the quantized model vs the float model",
        file=out,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", help="quantrules JSON file (default: the built-in rule set)")
    parser.add_argument(
        "--points", type=Path, help="point cloud .npy (M, >=3) or .ply (default: synthetic scan)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--voxel-size", type=float, default=0.1, help="metres (default 0.1)")
    parser.add_argument("--widths", default="16,32,64,96", help="U-Net widths per level")
    parser.add_argument("--small", action="store_true", help="a small scene and model (tests)")
    args = parser.parse_args(argv)
    if not args.voxel_size > 0:
        parser.error("--voxel-size must be > 0")

    import mlx_lattice
    import quantrules as qr
    from mlx_lattice.data import SceneConfig, synthetic_lidar_scan

    progress = Progress(total=7)
    rules = load_rules(args.rules)
    widths = tuple(int(w) for w in args.widths.split(","))
    with progress.step("point cloud"):
        if args.points:
            points = read_points(args.points)
            source = str(args.points)
        else:
            config = (
                SceneConfig(beams=16, azimuth_steps=256, buildings=4, cars=4, poles=4)
                if args.small
                else None
            )
            points = synthetic_lidar_scan(args.seed, config).points
            source = (
                f"synthetic 64-beam scan, seed {args.seed}"
                if not args.small
                else "small synthetic scan"
            )
    if args.small:
        widths = (8, 16, 16)
    height = (points[:, 2:3] - points[:, 2].mean()) / max(float(points[:, 2].std()), 1e-6)
    with progress.step("voxelize"):
        tensor = mlx_lattice.SparseTensor.from_points(
            points, args.voxel_size, features=np.concatenate([np.ones_like(height), height], axis=1)
        )
    print(
        f"input: {source}: {len(points)} points -> {tensor.num_points} voxels at {args.voxel_size} m"
    )
    print(f"rules: {args.rules or 'built-in'} ({len(qr.as_rules(rules)[0])} rules)")

    sparse_rows, report = run_sparse(rules, tensor, widths, 4, args.seed, progress)
    feats = np.concatenate(
        [np.array(tensor.coords[:, 1:]) * args.voxel_size / 50.0, np.array(tensor.feats)], axis=1
    )
    dense_rows = run_dense(rules, feats.astype(np.float32), 64, 4, args.seed, progress)

    print_table("dense JAX model (taktiny_ops, op dot_general)", dense_rows)
    print_table("sparse U-Net (mlx_lattice, op sparse_conv)", sparse_rows)
    print(
        f"\nU-Net conv weights: {report.bytes_before} -> {report.bytes_after} bytes "
        f"({len(report.quantized)} of {len(report.layers)} conv layers quantized)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
