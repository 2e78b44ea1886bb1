"""Point cloud readers against files written by independent writers: NumPy
(.bin, .label, .npy, .npz), laspy (LAS, LAZ through lazrs) and byte-level
PLY and PCD writers below that follow the published formats; truncated files
and wrong headers raise PointCloudFormatError naming the file."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from mlx_lattice.io import (
    PointCloudFormatError,
    read_kitti,
    read_las,
    read_npy,
    read_npz,
    read_pcd,
    read_ply,
    read_points,
)


def cloud(rng, n=50):
    pts = rng.uniform(-20, 20, (n, 3)).astype(np.float32)
    intensity = rng.uniform(0, 1, n).astype(np.float32)
    labels = rng.integers(0, 7, n)
    return pts, intensity, labels


# --- KITTI -------------------------------------------------------------------


def test_kitti_bin_and_label(tmp_path, rng):
    pts, intensity, labels = cloud(rng)
    inst = rng.integers(0, 1000, len(pts))
    np.concatenate([pts, intensity[:, None]], axis=1).astype("<f4").tofile(tmp_path / "0.bin")
    ((inst.astype(np.uint32) << 16) | labels.astype(np.uint32)).astype("<u4").tofile(
        tmp_path / "0.label"
    )
    c = read_points(tmp_path / "0.bin", label_path=tmp_path / "0.label")
    np.testing.assert_array_equal(c.points, pts)
    np.testing.assert_array_equal(c.features[:, 0], intensity)
    np.testing.assert_array_equal(c.labels, labels)
    np.testing.assert_array_equal(c.instances, inst)
    assert c.labels.dtype == np.int64 and c.points.dtype == np.float32
    no_labels = read_kitti(tmp_path / "0.bin")
    assert no_labels.labels is None and no_labels.instances is None


def test_kitti_truncated_and_mismatched(tmp_path, rng):
    pts, intensity, labels = cloud(rng)
    raw = np.concatenate([pts, intensity[:, None]], axis=1).astype("<f4").tobytes()
    (tmp_path / "t.bin").write_bytes(raw[:-3])
    with pytest.raises(PointCloudFormatError, match=r"t\.bin: .*16-byte"):
        read_kitti(tmp_path / "t.bin")
    (tmp_path / "ok.bin").write_bytes(raw)
    labels[:-1].astype("<u4").tofile(tmp_path / "short.label")
    with pytest.raises(PointCloudFormatError, match=r"short\.label: holds 49 labels .* 50 points"):
        read_kitti(tmp_path / "ok.bin", tmp_path / "short.label")
    (tmp_path / "odd.label").write_bytes(b"\0" * 7)
    with pytest.raises(PointCloudFormatError, match=r"odd.label"):
        read_kitti(tmp_path / "ok.bin", tmp_path / "odd.label")
    with pytest.raises(PointCloudFormatError, match=r"missing.bin: cannot read"):
        read_kitti(tmp_path / "missing.bin")


# --- PLY: a byte-level writer after the PLY specification -------------------

PLY_CODES = {"f4": "float", "f8": "double", "u1": "uchar", "i4": "int", "u4": "uint", "i2": "short"}


def write_ply(path, fmt, elements):
    """``elements``: list of (name, [(prop, dtype code or ("list", count code, item code))],
    rows) with rows a list of tuples (a list property's value is a sequence)."""
    head = ["ply", f"format {fmt} 1.0", "comment written by the test"]
    for name, props, rows in elements:
        head.append(f"element {name} {len(rows)}")
        for prop, kind in props:
            if isinstance(kind, tuple):
                head.append(f"property list {PLY_CODES[kind[1]]} {PLY_CODES[kind[2]]} {prop}")
            else:
                head.append(f"property {PLY_CODES[kind]} {prop}")
    head.append("end_header")
    out = ("\n".join(head) + "\n").encode("ascii")
    fmt_char = {"f4": "f", "f8": "d", "u1": "B", "i4": "i", "u4": "I", "i2": "h"}
    order = "<" if fmt == "binary_little_endian" else ">"
    for _, props, rows in elements:
        for row in rows:
            if fmt == "ascii":
                tokens = []
                for (_, kind), v in zip(props, row, strict=True):
                    if isinstance(kind, tuple):
                        tokens += [str(len(v))] + [repr(x) for x in v]
                    else:
                        tokens.append(repr(float(v)) if kind[0] == "f" else str(int(v)))
                out += (" ".join(tokens) + "\n").encode("ascii")
            else:
                for (_, kind), v in zip(props, row, strict=True):
                    if isinstance(kind, tuple):
                        out += struct.pack(order + fmt_char[kind[1]], len(v))
                        out += b"".join(struct.pack(order + fmt_char[kind[2]], x) for x in v)
                    else:
                        out += struct.pack(order + fmt_char[kind], v)
    path.write_bytes(out)
    return out


VERTEX_PROPS = [
    ("x", "f4"),
    ("y", "f4"),
    ("z", "f4"),
    ("intensity", "f4"),
    ("red", "u1"),
    ("label", "i4"),
]


def vertex_rows(pts, intensity, labels, red):
    return [
        (float(p[0]), float(p[1]), float(p[2]), float(i), int(r), int(lab))
        for p, i, r, lab in zip(pts, intensity, red, labels, strict=True)
    ]


@pytest.mark.parametrize("fmt", ["ascii", "binary_little_endian", "binary_big_endian"])
def test_ply_with_camera_and_faces(tmp_path, rng, fmt):
    pts, intensity, labels = cloud(rng)
    red = rng.integers(0, 256, len(pts))
    camera = ("camera", [("view_px", "f4"), ("tags", ("list", "u1", "i4")), ("k", "f8")],
              [(1.5, [1, 2, 3], 2.0), (0.5, [], 1.0)])  # fmt: skip
    faces = ("face", [("vertex_indices", ("list", "u1", "i4"))], [([0, 1, 2],), ([2, 3, 4, 5],)])
    write_ply(
        tmp_path / "a.ply",
        fmt,
        [camera, ("vertex", VERTEX_PROPS, vertex_rows(pts, intensity, labels, red)), faces],
    )
    c = read_points(tmp_path / "a.ply")
    np.testing.assert_array_equal(c.points, pts)
    assert c.feature_names == ("intensity", "red")
    np.testing.assert_array_equal(c.features, np.stack([intensity, red.astype(np.float32)], 1))
    np.testing.assert_array_equal(c.labels, labels)


def test_ply_vertex_with_list_property(tmp_path, rng):
    pts, _, _ = cloud(rng, 5)
    props = [("x", "f4"), ("nbrs", ("list", "u1", "i2")), ("y", "f4"), ("z", "f4")]
    rows = [(float(p[0]), list(range(k)), float(p[1]), float(p[2])) for k, p in enumerate(pts)]
    for fmt in ("ascii", "binary_big_endian"):
        write_ply(tmp_path / "l.ply", fmt, [("vertex", props, rows)])
        c = read_ply(tmp_path / "l.ply")
        np.testing.assert_array_equal(c.points, pts)
        assert c.features is None and c.labels is None


@pytest.mark.parametrize("fmt", ["ascii", "binary_little_endian"])
def test_ply_truncated(tmp_path, rng, fmt):
    pts, intensity, labels = cloud(rng)
    raw = write_ply(
        tmp_path / "a.ply",
        fmt,
        [("vertex", VERTEX_PROPS, vertex_rows(pts, intensity, labels, labels))],
    )
    (tmp_path / "t.ply").write_bytes(raw[: len(raw) - 40])
    with pytest.raises(PointCloudFormatError, match=r"t\.ply: truncated"):
        read_ply(tmp_path / "t.ply")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("plx\nformat ascii 1.0\nelement vertex 1\nproperty float x\nend_header\n", "not a PLY"),
        ("ply\nformat ascii 1.0\nelement vertex 1\nproperty float x\n", "end_header"),
        ("ply\nformat binary_middle_endian 1.0\nelement vertex 1\nend_header\n", "unknown format"),
        ("ply\nformat ascii 1.0\nelement vertex 1\nproperty float128 x\nend_header\n", "PLY type"),
        ("ply\nformat ascii 1.0\nelement vertex 1\nproperty float x\nproperty float y\nend_header\n1 2\n", "lack the property z"),
        ("ply\nformat ascii 1.0\nelement face 1\nproperty float x\nend_header\n1\n", "no 'vertex'"),
        ("ply\nformat ascii 1.0\nelement vertex 1\nproperty float x\nproperty float y\nproperty float z\n"
         "end_header\n1 2 3 4\n", "has 4 values"),
    ],
)  # fmt: skip
def test_ply_wrong_header(tmp_path, header, message):
    (tmp_path / "h.ply").write_bytes(header.encode())
    with pytest.raises(PointCloudFormatError, match=r"h\.ply: .*" + message):
        read_ply(tmp_path / "h.ply")


# --- PCD: a byte-level writer after the PCL file format description ---------


def write_pcd(path, data, fields, types, *, counts=None, packed_rgb=None):
    """``fields`` columns of ``types`` (numpy codes); ``data``: 'ascii' or 'binary'."""
    counts = counts or [1] * len(fields)
    cols = [np.asarray(c) for c in fields.values()]
    n = len(cols[0])
    names = list(fields)
    size = [np.dtype(t).itemsize for t in types]
    kind = [{"f": "F", "i": "I", "u": "U"}[np.dtype(t).kind] for t in types]
    head = [
        "# .PCD v0.7 - Point Cloud Data file format",
        "VERSION 0.7",
        "FIELDS " + " ".join(names),
        "SIZE " + " ".join(map(str, size)),
        "TYPE " + " ".join(kind),
        "COUNT " + " ".join(map(str, counts)),
        f"WIDTH {n}",
        "HEIGHT 1",
        "VIEWPOINT 0 0 0 1 0 0 0",
        f"POINTS {n}",
        f"DATA {data}",
    ]
    out = ("\n".join(head) + "\n").encode("ascii")
    if data == "ascii":
        for i in range(n):
            tokens = []
            for c, t in zip(cols, types, strict=True):
                vals = np.atleast_1d(c[i])
                for v in vals:
                    tokens.append(repr(float(v)) if np.dtype(t).kind == "f" else str(int(v)))
            out += (" ".join(tokens) + "\n").encode("ascii")
    else:
        for i in range(n):
            for c, t in zip(cols, types, strict=True):
                out += np.atleast_1d(c[i]).astype("<" + t).tobytes()
    path.write_bytes(out)
    return out


@pytest.mark.parametrize("data", ["ascii", "binary"])
def test_pcd(tmp_path, rng, data):
    pts, intensity, labels = cloud(rng)
    rgb = rng.integers(0, 256, (len(pts), 3))
    packed = ((rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2]).astype(np.uint32).view(np.float32)
    normals = rng.normal(size=(len(pts), 2)).astype(np.float32)
    fields = {"x": pts[:, 0], "y": pts[:, 1], "z": pts[:, 2], "intensity": intensity,
              "rgb": packed, "nrm": normals, "label": labels.astype(np.uint32)}  # fmt: skip
    write_pcd(tmp_path / "a.pcd", data, fields, ["f4", "f4", "f4", "f4", "f4", "f4", "u4"],
              counts=[1, 1, 1, 1, 1, 2, 1])  # fmt: skip
    c = read_points(tmp_path / "a.pcd")
    np.testing.assert_array_equal(c.points, pts)
    assert c.feature_names == ("intensity", "r", "g", "b", "nrm_0", "nrm_1")
    np.testing.assert_array_equal(c.features[:, 0], intensity)
    np.testing.assert_array_equal(c.features[:, 1:4], rgb.astype(np.float32))
    np.testing.assert_array_equal(c.features[:, 4:], normals)
    np.testing.assert_array_equal(c.labels, labels)


@pytest.mark.parametrize("data", ["ascii", "binary"])
def test_pcd_truncated(tmp_path, rng, data):
    pts, _, _ = cloud(rng)
    raw = write_pcd(
        tmp_path / "a.pcd", data, {"x": pts[:, 0], "y": pts[:, 1], "z": pts[:, 2]}, ["f4"] * 3
    )
    (tmp_path / "t.pcd").write_bytes(raw[: len(raw) - 30])
    with pytest.raises(PointCloudFormatError, match=r"t\.pcd: (truncated|point 49)"):
        read_pcd(tmp_path / "t.pcd")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("VERSION 0.7\nFIELDS x y z\nSIZE 4 4 4\nTYPE F F F\nCOUNT 1 1 1\nPOINTS 1\n", "no 'DATA'"),
        ("VERSION 0.7\nFIELDS x y z\nSIZE 4 4\nTYPE F F F\nPOINTS 1\nDATA ascii\n1 2 3\n", "different lengths"),
        ("VERSION 0.7\nFIELDS x y z\nSIZE 4 4 3\nTYPE F F F\nPOINTS 1\nDATA ascii\n1 2 3\n", "bad SIZE"),
        ("VERSION 0.7\nFIELDS x y w\nSIZE 4 4 4\nTYPE F F F\nPOINTS 1\nDATA ascii\n1 2 3\n", "lack z"),
        ("VERSION 0.7\nFIELDS x y z\nSIZE 4 4 4\nTYPE F F F\nPOINTS 1\nDATA binary_compressed\n", "not supported"),
        ("VERSION 0.7\nFIELDS x y z\nSIZE 4 4 4\nTYPE F F F\nPOINTS 1\nDATA ascii\n1 2 a\n", "not a number"),
    ],
)  # fmt: skip
def test_pcd_wrong_header(tmp_path, header, message):
    (tmp_path / "h.pcd").write_bytes(header.encode())
    with pytest.raises(PointCloudFormatError, match=r"h\.pcd: .*" + message):
        read_pcd(tmp_path / "h.pcd")


# --- LAS / LAZ through laspy -------------------------------------------------


def write_las(path, pts, labels, intensity):
    import laspy

    header = laspy.LasHeader(point_format=3, version="1.4")
    header.offsets = [600000.0, 5000000.0, 100.0]
    header.scales = [0.001, 0.001, 0.001]
    las = laspy.LasData(header)
    las.x, las.y, las.z = pts[:, 0], pts[:, 1], pts[:, 2]
    las.classification = labels
    las.intensity = intensity
    las.write(str(path))


@pytest.mark.parametrize("suffix", [".las", ".laz"])
def test_las(tmp_path, rng, suffix):
    n = 60
    pts = np.round(rng.uniform([600100, 5000200, 110], [600200, 5000300, 130], (n, 3)), 3)
    labels = rng.integers(0, 20, n)
    intensity = rng.integers(0, 65535, n)
    write_las(tmp_path / ("a" + suffix), pts, labels, intensity)
    c = read_points(tmp_path / ("a" + suffix))
    np.testing.assert_array_equal(c.origin, np.floor(pts.min(axis=0)))
    # float32 relative coordinates: within a millimetre's rounding of the file's.
    np.testing.assert_allclose(c.points + c.origin, pts, atol=2e-5, rtol=0)
    np.testing.assert_array_equal(c.labels, labels)
    np.testing.assert_array_equal(c.features[:, c.feature_names.index("intensity")], intensity)
    absolute = read_las(tmp_path / ("a" + suffix), recenter=False)
    assert absolute.origin.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("suffix", [".las", ".laz"])
def test_las_truncated_and_wrong_header(tmp_path, rng, suffix):
    n = 200
    pts = rng.uniform([600000, 5000000, 100], [600050, 5000050, 150], (n, 3))
    write_las(tmp_path / ("a" + suffix), pts, rng.integers(0, 5, n), rng.integers(0, 9, n))
    raw = (tmp_path / ("a" + suffix)).read_bytes()
    (tmp_path / ("t" + suffix)).write_bytes(raw[: len(raw) - 500])
    with pytest.raises(PointCloudFormatError, match=r"t\.la[sz]: "):
        read_las(tmp_path / ("t" + suffix))
    (tmp_path / ("h" + suffix)).write_bytes(b"LASX" + raw[4:])
    with pytest.raises(PointCloudFormatError, match=r"h\.la[sz]: "):
        read_las(tmp_path / ("h" + suffix))


# --- NumPy ------------------------------------------------------------------


def test_npy_npz(tmp_path, rng):
    pts, intensity, labels = cloud(rng)
    np.save(
        tmp_path / "a.npy", np.concatenate([pts, intensity[:, None]], axis=1).astype(np.float64)
    )
    c = read_points(tmp_path / "a.npy")
    np.testing.assert_array_equal(c.points, pts)
    np.testing.assert_array_equal(c.features[:, 0], intensity)
    np.savez(tmp_path / "a.npz", points=pts, features=intensity[:, None], labels=labels)
    c = read_points(tmp_path / "a.npz")
    np.testing.assert_array_equal(c.points, pts)
    np.testing.assert_array_equal(c.labels, labels)


def test_npy_npz_truncated_and_wrong(tmp_path, rng):
    pts, _, labels = cloud(rng)
    np.save(tmp_path / "a.npy", pts)
    raw = (tmp_path / "a.npy").read_bytes()
    (tmp_path / "t.npy").write_bytes(raw[:-10])
    with pytest.raises(PointCloudFormatError, match=r"t\.npy: "):
        read_npy(tmp_path / "t.npy")
    (tmp_path / "h.npy").write_bytes(b"\x93NUMPX" + raw[6:])
    with pytest.raises(PointCloudFormatError, match=r"h\.npy: "):
        read_npy(tmp_path / "h.npy")
    np.save(tmp_path / "flat.npy", pts[:, :2])
    with pytest.raises(
        PointCloudFormatError, match=r"flat\.npy: array must be a numeric \(N, >=3\)"
    ):
        read_npy(tmp_path / "flat.npy")
    np.savez(tmp_path / "a.npz", points=pts, labels=labels)
    raw = (tmp_path / "a.npz").read_bytes()
    (tmp_path / "t.npz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(PointCloudFormatError, match=r"t\.npz: "):
        read_npz(tmp_path / "t.npz")
    np.savez(tmp_path / "k.npz", xyz=pts)
    with pytest.raises(PointCloudFormatError, match=r"k\.npz: no 'points'"):
        read_npz(tmp_path / "k.npz")
    np.savez(tmp_path / "l.npz", points=pts, labels=labels[:-1])
    with pytest.raises(PointCloudFormatError, match=r"l\.npz: labels must be \(50,\)"):
        read_npz(tmp_path / "l.npz")


def test_unknown_suffix_and_label_path(tmp_path):
    with pytest.raises(PointCloudFormatError, match=r"x\.obj: unknown point cloud suffix"):
        read_points(tmp_path / "x.obj")
    with pytest.raises(PointCloudFormatError, match="label_path is only for KITTI"):
        read_points(tmp_path / "x.ply", label_path=tmp_path / "x.label")


def test_las_without_laspy_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "laspy", None)  # import laspy now fails
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'quantlattice_mlx_lattice\[las\]'"):
        read_las(tmp_path / "a.las")
