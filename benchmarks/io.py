"""Benchmark: point-cloud I/O, as ratios measured in one run.

Coders (``mlx_lattice.coding``):

* one table, 10^6 symbols drawn from a 256-symbol table (rANS and range
  coder): encode/decode MB/s of int32 symbols and of the coded stream,
  bits per symbol against the entropy of the quantized table, and the same
  against zlib (level 6) and LZMA (preset 6) on the symbols as bytes;
* one CDF row per symbol (64 quantized discretised Gaussians picked by
  index, as a compression model's entropy bottleneck produces): the same
  figures against the information of the coded sequence;
* octree occupancy of the built-in LiDAR scan's voxels (10 cm and 5 cm):
  encode/decode time, bits per voxel, against zlib and LZMA on the sorted
  int32 coordinates.

Readers (``mlx_lattice.io``): rows per second reading a 10^6-point scan
written as KITTI ``.bin``, binary PLY and binary PCD, against NumPy's
``fromfile`` on the same bytes; LAS and LAZ against ``laspy.read``.

The segment command's write stage against its forward: the demo's model
(MinkUNet widths 16-96, occupancy and height, 5 classes, 0.15 m voxels) as
an artifact on an 88k-point 64-beam scan; the write is the ``.npy`` of the
labels and the PLY with class colours and labels (target: under a tenth
of the forward).
"""

from __future__ import annotations

import lzma
import math
import os
import tempfile
import zlib

import numpy as np

from benchmarks.host_class import host_class_line, kernel_names, print_targets
from benchmarks.timing import median_s
from examples.palette import colour_columns
from mlx_lattice import coding, io
from mlx_lattice.data import CLASS_NAMES, SceneConfig, synthetic_lidar_scan
from mlx_lattice.geometry import quantize_points

N_SYMBOLS = 1_000_000


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def _entropy(freqs: np.ndarray) -> float:
    q = freqs[freqs > 0] / float(1 << coding.PRECISION_BITS)
    return float(-np.sum(q * np.log2(q)))


def _line(name: str, n: int, coded: int, t_enc: float, t_dec: float, bound_bits: float) -> None:
    bps = 8 * coded / n
    print(
        f"{name:<26} enc {_rate(4 * n, t_enc):7.1f} MB/s ({n / t_enc / 1e6:5.1f} Msym/s)"
        f"  dec {_rate(4 * n, t_dec):7.1f} MB/s ({n / t_dec / 1e6:5.1f} Msym/s)"
        f"  {bps:.4f} bits/sym  / bound {bps / bound_bits:.5f}"
    )


def _general(name: str, raw: bytes, n: int, bound_bits: float) -> None:
    for label, compress in (("zlib-6", lambda b: zlib.compress(b, 6)), ("lzma-6", lzma.compress)):
        t = median_s(lambda c=compress: c(raw), repeats=3)
        bps = 8 * len(compress(raw)) / n
        print(
            f"{name + ' ' + label:<26} enc {_rate(4 * n, t):7.1f} MB/s"
            f"{'':17}  {'':27}  {bps:.4f} bits/sym  / bound {bps / bound_bits:.5f}"
        )


def table_coders(rng: np.random.Generator) -> None:
    probs = rng.dirichlet(np.full(256, 0.3))
    freqs = coding.quantize_probabilities(probs)
    symbols = rng.choice(256, N_SYMBOLS, p=freqs / float(1 << coding.PRECISION_BITS))
    h = _entropy(freqs)
    print(f"one table: {N_SYMBOLS} symbols, 256-symbol table, entropy {h:.4f} bits/sym")
    for name, enc, dec in (
        ("rans", coding.rans_encode, coding.rans_decode),
        ("range", coding.range_encode, coding.range_decode),
    ):
        data = enc(symbols, probs)
        assert np.array_equal(dec(data, probs, N_SYMBOLS), symbols)
        t_enc = median_s(lambda e=enc: e(symbols, probs), repeats=5)
        t_dec = median_s(lambda d=dec, b=data: d(b, probs, N_SYMBOLS), repeats=5)
        _line(name, N_SYMBOLS, len(data), t_enc, t_dec, h)
    _general("bytes", symbols.astype(np.uint8).tobytes(), N_SYMBOLS, h)


def _gaussian_cdfs(rows: int, alphabet: int) -> np.ndarray:
    """Quantized CDFs of discretised Gaussians of growing scale, centred."""
    x = np.arange(alphabet) - alphabet // 2
    out = np.empty((rows, alphabet + 1), np.int32)
    for r, scale in enumerate(np.geomspace(0.3, 12.0, rows)):
        upper = 0.5 * (1 + np.vectorize(math.erf)((x + 0.5) / (scale * math.sqrt(2))))
        lower = 0.5 * (1 + np.vectorize(math.erf)((x - 0.5) / (scale * math.sqrt(2))))
        f = coding.quantize_probabilities(np.maximum(upper - lower, 1e-12))
        out[r] = np.concatenate([[0], np.cumsum(f)])
    return out


def cdf_coders(rng: np.random.Generator) -> None:
    alphabet = 64
    cdfs = _gaussian_cdfs(64, alphabet)
    indexes = rng.integers(0, len(cdfs), N_SYMBOLS)
    widths = np.diff(cdfs, axis=1).astype(np.float64)
    u = rng.random(N_SYMBOLS) * (1 << coding.PRECISION_BITS)
    symbols = np.array(
        [np.searchsorted(cdfs[r], v, side="right") - 1 for r, v in zip(indexes, u, strict=True)]
    )
    info = float(np.sum(coding.PRECISION_BITS - np.log2(widths[indexes, symbols])))
    bound = info / N_SYMBOLS
    print(
        f"CDF per symbol: {N_SYMBOLS} symbols, 64 rows of {alphabet}, information {bound:.4f} bits/sym"
    )
    for method in ("rans", "range"):
        data = coding.encode_with_cdfs(symbols, cdfs, indexes=indexes, method=method)
        assert np.array_equal(
            coding.decode_with_cdfs(data, cdfs, indexes=indexes, method=method), symbols
        )
        t_enc = median_s(
            lambda m=method: coding.encode_with_cdfs(symbols, cdfs, indexes=indexes, method=m),
            repeats=5,
        )
        t_dec = median_s(
            lambda m=method, b=data: coding.decode_with_cdfs(b, cdfs, indexes=indexes, method=m),
            repeats=5,
        )
        _line(method + " cdfs", N_SYMBOLS, len(data), t_enc, t_dec, bound)
    _general("bytes", symbols.astype(np.uint8).tobytes(), N_SYMBOLS, bound)


def occupancy() -> None:
    pts = synthetic_lidar_scan(seed=0).points.astype(np.float64)
    for voxel in (0.1, 0.05):
        coords = np.array(quantize_points(pts, voxel).coords)
        n = len(coords)
        data = coding.encode_occupancy(coords)
        assert np.array_equal(coding.decode_occupancy(data), coords)
        t_enc = median_s(lambda c=coords: coding.encode_occupancy(c), repeats=5)
        t_dec = median_s(lambda b=data: coding.decode_occupancy(b), repeats=5)
        raw = coords.tobytes()
        z = len(zlib.compress(raw, 6))
        xz = len(lzma.compress(raw))
        print(
            f"occupancy {voxel * 100:.0f} cm: {n} voxels  enc {t_enc * 1e3:7.2f} ms"
            f" ({n / t_enc / 1e6:5.2f} Mvox/s)  dec {t_dec * 1e3:7.2f} ms"
            f"  {8 * len(data) / n:.3f} bits/voxel"
            f"  zlib-6 {8 * z / n:.2f} ({z / len(data):.1f}x)  lzma-6 {8 * xz / n:.2f}"
            f" ({xz / len(data):.1f}x)"
        )


def _ply_bytes(fields: np.ndarray) -> bytes:
    header = ["ply", "format binary_little_endian 1.0", f"element vertex {len(fields)}"]
    header += [f"property float {name}" for name in fields.dtype.names]
    return ("\n".join([*header, "end_header"]) + "\n").encode() + fields.tobytes()


def _pcd_bytes(fields: np.ndarray) -> bytes:
    names = fields.dtype.names
    n = len(fields)
    header = [
        "VERSION 0.7",
        "FIELDS " + " ".join(names),
        "SIZE " + " ".join("4" for _ in names),
        "TYPE " + " ".join("F" for _ in names),
        "COUNT " + " ".join("1" for _ in names),
        f"WIDTH {n}",
        "HEIGHT 1",
        "VIEWPOINT 0 0 0 1 0 0 0",
        f"POINTS {n}",
        "DATA binary",
    ]
    return ("\n".join(header) + "\n").encode() + fields.tobytes()


def readers(rng: np.random.Generator, folder: str) -> None:
    """Rows per second of ``mlx_lattice.io``'s readers on one 10^6-point
    scan (x, y, z, intensity as float32), each against NumPy's ``fromfile``
    reading the same bytes as a structured array (the record layout given,
    the header skipped): the price of parsing the header, validating and
    building the ``PointCloud``. LAS/LAZ are read through laspy, so their
    reference is ``laspy.read`` itself."""
    n = N_SYMBOLS
    dtype = np.dtype([("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("intensity", "<f4")])
    fields = np.empty(n, dtype)
    for name in dtype.names:
        fields[name] = rng.normal(0.0, 20.0, n).astype(np.float32)
    files = {
        "kitti .bin": ("scan.bin", fields.tobytes(), 0),
        "ply binary": ("scan.ply", _ply_bytes(fields), None),
        "pcd binary": ("scan.pcd", _pcd_bytes(fields), None),
    }
    for name, (file, data, offset) in files.items():
        path = os.path.join(folder, file)
        with open(path, "wb") as f:
            f.write(data)
        offset = len(data) - n * dtype.itemsize if offset is None else offset
        cloud = io.read_points(path)
        assert np.array_equal(cloud.points[:, 2], fields["z"])
        t_ours = median_s(lambda p=path: io.read_points(p), repeats=5)
        t_ref = median_s(lambda p=path, o=offset: np.fromfile(p, dtype, offset=o), repeats=5)
        print(
            f"read {name:11s} {n / t_ours / 1e6:6.1f} Mrows/s  np.fromfile {n / t_ref / 1e6:6.1f}"
            f" Mrows/s  ours/fromfile time {t_ours / t_ref:5.2f}"
        )
    try:
        import laspy
    except ImportError:
        print("read las/laz: laspy is not installed (the wheel's las extra)")
        return
    header = laspy.LasHeader(point_format=3, version="1.4")
    header.scales = np.array([0.001, 0.001, 0.001])
    las = laspy.LasData(header)
    las.x, las.y, las.z = fields["x"], fields["y"], fields["z"]
    for suffix in ("las", "laz"):
        path = os.path.join(folder, "scan." + suffix)
        las.write(path)
        t_ours = median_s(lambda p=path: io.read_points(p), repeats=3)
        t_ref = median_s(lambda p=path: laspy.read(p), repeats=3)
        print(
            f"read {suffix:11s} {n / t_ours / 1e6:6.1f} Mrows/s  laspy.read {n / t_ref / 1e6:6.1f}"
            f" Mrows/s  ours/laspy time {t_ours / t_ref:5.2f}"
        )


def segment_write(folder: str) -> float:
    """The segment command's write stage over its forward on the demo's
    model and an 88k-point scan (the forward as the command times it for an
    artifact: voxelize, network, argmax per point); returns the ratio."""
    import mlx.core as mx

    from mlx_lattice import export
    from mlx_lattice.models import MinkUNet

    mx.random.seed(0)
    model = MinkUNet(2, len(CLASS_NAMES), (16, 32, 64, 96)).eval()  # the demo's FULL widths
    path = os.path.join(folder, "demo.mlxl")
    export.export_model(model, path, voxel_size=0.15, features="occupancy,height",
                        class_names=CLASS_NAMES)  # fmt: skip
    net = export.load(path)
    points = synthetic_lidar_scan(3, SceneConfig(beams=64, azimuth_steps=1400)).points
    feats = np.stack([np.ones(len(points)), points[:, 2] / 4.0], 1).astype(np.float32)

    def forward() -> np.ndarray:
        return np.array(mx.argmax(net.predict_points(points, feats), axis=1)).astype(np.int32)

    labels = forward()
    npy = os.path.join(folder, "labels.npy")

    def write() -> None:  # as examples/segment.py writes --out and --ply-out, over the last ones
        if os.path.exists(npy):
            os.unlink(npy)
        np.save(npy, labels)
        colours = colour_columns(labels, len(CLASS_NAMES))
        io.write_ply(os.path.join(folder, "scan.ply"), points, {**colours, "label": labels})

    t_forward = median_s(forward, repeats=7)
    t_write = median_s(write, repeats=7)
    ratio = t_write / t_forward
    print(
        f"segment: {len(points)} points, forward {t_forward * 1e3:7.1f} ms (MinkUNet widths "
        f"16-96 artifact), write {t_write * 1e3:6.1f} ms (.npy + PLY with colours and labels):"
        f" write/forward {ratio:.3f}"
    )
    return ratio


def main() -> None:
    from mlx_lattice._native import ext

    print(host_class_line(kernel_names(ext)))
    rng = np.random.default_rng(0)
    table_coders(rng)
    cdf_coders(rng)
    occupancy()
    with tempfile.TemporaryDirectory() as folder:
        readers(rng, folder)
        ratio = segment_write(folder)
    print_targets("targets (issue 55):", {"segment": [("write / forward", ratio, "<=", 0.1)]})


if __name__ == "__main__":
    main()
