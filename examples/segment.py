"""Run a saved segmentation model on one scan.

``./bazelw run //examples:segment -- --model model.safetensors --points scan.bin
--out labels.npy [--picture scan.png]``

The model file (``mlx_lattice.models.save_model``; the demo's ``--save``)
carries the architecture, voxel size and class names, so no other flag is
needed. Any file ``mlx_lattice.io.read_points`` reads works as ``--points``.
``--out`` gets one int32 class index per point (into the model's class
names; ``.npy``). Prints the time of each stage: read, voxelize, forward,
write.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def _user_path(arg: str) -> Path:
    """``arg`` relative to where ``bazel run`` was started (it changes the cwd)."""
    path = Path(arg)
    if not path.is_absolute() and "BUILD_WORKING_DIRECTORY" in os.environ:
        path = Path(os.environ["BUILD_WORKING_DIRECTORY"]) / path
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model file (.safetensors, from save_model)")
    parser.add_argument(
        "--points", required=True, help="point cloud (.bin .ply .las .laz .pcd .npy .npz)"
    )
    parser.add_argument("--out", required=True, help="per-point class indices (.npy)")
    parser.add_argument("--picture", help="a top-down PNG of the predicted classes")
    args = parser.parse_args(argv)
    out = _user_path(args.out)
    if out.suffix != ".npy":
        parser.error("--out must be a .npy path")

    import mlx.core as mx

    from mlx_lattice.io import PointCloudFormatError, read_points
    from mlx_lattice.models import ModelFileError, load_model

    times: dict[str, float] = {}
    try:
        start = time.perf_counter()
        saved = load_model(_user_path(args.model))
        times["load model"] = time.perf_counter() - start
        start = time.perf_counter()
        cloud = read_points(_user_path(args.points))
        times["read"] = time.perf_counter() - start
    except (ModelFileError, PointCloudFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(cloud) == 0:
        print(f"error: {args.points}: the scan has no points", file=sys.stderr)
        return 2
    start = time.perf_counter()
    inp = saved.prepare(cloud.points)
    tensor = inp.tensor
    mx.eval(tensor.coords, tensor.feats)
    times["voxelize"] = time.perf_counter() - start
    start = time.perf_counter()
    labels = saved.predict(inp)
    times["forward"] = time.perf_counter() - start
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, labels.astype(np.int32))
    times["write"] = time.perf_counter() - start

    print(
        f"model: {saved.architecture} widths {saved.model.widths}, voxel size {saved.voxel_size} m, "
        f"{len(saved.class_names)} classes"
        + (f", quantized ({len(saved.report.quantized)} layers)" if saved.report else "")
    )
    print(f"scan: {args.points}: {len(cloud)} points, {tensor.num_points} voxels")
    for stage, took in times.items():
        print(f"  {stage:12s} {took * 1e3:9.1f} ms")
    counts = np.bincount(labels, minlength=len(saved.class_names))
    print("points per class: " + ", ".join(
        f"{name} {c}" for name, c in zip(saved.class_names, counts, strict=True) if c
    ))  # fmt: skip
    print(f"labels: {out}")
    if args.picture:
        from examples.pictures import top_down_png

        extent = float(np.percentile(np.abs(cloud.points[:, :2]), 98)) or 1.0
        png = top_down_png(
            _user_path(args.picture),
            cloud.points,
            [("prediction", labels)],
            saved.class_names,
            extent=extent,
        )
        print(f"picture: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
