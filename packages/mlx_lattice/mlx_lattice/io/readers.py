"""Point cloud file readers: KITTI ``.bin``/``.label``, PLY, LAS/LAZ, PCD, ``.npy``/``.npz``.

Every reader returns a :class:`PointCloud`:

* ``points``: ``(N, 3)`` float32 coordinates (for LAS/LAZ relative to
  ``origin``, see :func:`read_las`);
* ``features``: ``(N, F)`` float32 per-point values (intensity, colour,
  ...), named by ``feature_names``, or ``None``;
* ``labels``: ``(N,)`` int64 semantic label per point as stored in the file
  (KITTI: the low 16 bits of the ``.label`` word), or ``None``;
* ``instances``: ``(N,)`` int64 instance id per point (KITTI: the high 16
  bits), or ``None``;
* ``origin``: ``(3,)`` float64 offset added back to get the file's
  coordinates (zeros except for LAS/LAZ).

A malformed or truncated file raises :class:`PointCloudFormatError` (a
``ValueError``) naming the file and what is wrong.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "LABEL_FIELDS",
    "LAS_FEATURES",
    "SUFFIXES",
    "PointCloud",
    "PointCloudFormatError",
    "read_kitti",
    "read_las",
    "read_npy",
    "read_npz",
    "read_pcd",
    "read_ply",
    "read_points",
]

PathLike = str | os.PathLike[str]

#: Label property names a PLY/PCD reader takes as the semantic label, in order.
LABEL_FIELDS = ("label", "semantic", "class", "classification", "scalar_label")


class PointCloudFormatError(ValueError):
    """A point cloud file that is malformed, truncated or not of its format."""


@dataclass(frozen=True)
class PointCloud:
    """Points read from a file, with optional per-point features and labels.

    >>> cloud = PointCloud(np.zeros((2, 3), np.float32))
    >>> len(cloud), cloud.features is None, cloud.origin.tolist()
    (2, True, [0.0, 0.0, 0.0])
    """

    points: np.ndarray
    features: np.ndarray | None = None
    feature_names: tuple[str, ...] = ()
    labels: np.ndarray | None = None
    instances: np.ndarray | None = None
    origin: np.ndarray = field(default_factory=lambda: np.zeros(3))

    def __len__(self) -> int:
        return len(self.points)


def _fail(path: PathLike, what: str) -> PointCloudFormatError:
    return PointCloudFormatError(f"{os.fspath(path)}: {what}")


def _read_bytes(path: PathLike) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise _fail(path, f"cannot read the file ({e.strerror or e}).") from None


def _cloud(
    path: PathLike,
    xyz: np.ndarray,
    columns: dict[str, np.ndarray],
    label_field: str | None,
) -> PointCloud:
    """A PointCloud from the x/y/z columns and the other named columns."""
    names = [n for n in columns if n not in ("x", "y", "z")]
    label_name = None
    if label_field is not None:
        if label_field not in columns:
            raise _fail(path, f"no field named {label_field!r} (fields: {', '.join(columns)}).")
        label_name = label_field
    else:
        label_name = next((n for n in LABEL_FIELDS if n in columns), None)
    labels = None
    if label_name is not None:
        raw = np.asarray(columns[label_name])
        if raw.dtype.kind == "f" and not np.all(np.isfinite(raw) & (raw == np.round(raw))):
            raise _fail(path, f"label field {label_name!r} holds non-integer values.")
        labels = raw.astype(np.int64)
        names.remove(label_name)
    features = None
    if names:
        features = np.stack([np.asarray(columns[n], np.float32) for n in names], axis=1)
    return PointCloud(np.ascontiguousarray(xyz, np.float32), features, tuple(names), labels)


# --- KITTI ---------------------------------------------------------------


def read_kitti(path: PathLike, label_path: PathLike | None = None) -> PointCloud:
    """A KITTI / SemanticKITTI velodyne scan: float32 records ``(x, y, z,
    intensity)``; with ``label_path``, its ``.label`` file of one uint32 per
    point (low 16 bits: semantic label, high 16 bits: instance id).

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> np.array([[1, 2, 3, 0.5]], np.float32).tofile(d + "/000000.bin")
    >>> np.array([(7 << 16) | 40], np.uint32).tofile(d + "/000000.label")
    >>> c = read_kitti(d + "/000000.bin", d + "/000000.label")
    >>> c.points.tolist(), c.features.tolist(), c.labels.tolist(), c.instances.tolist()
    ([[1.0, 2.0, 3.0]], [[0.5]], [40], [7])
    """
    raw = _read_bytes(path)
    if len(raw) % 16:
        raise _fail(
            path,
            f"{len(raw)} bytes is not a whole number of 16-byte (x, y, z, intensity) float32 "
            "records: truncated, or not a KITTI .bin scan.",
        )
    rec = np.frombuffer(raw, "<f4").reshape(-1, 4)
    labels = instances = None
    if label_path is not None:
        lab = _read_bytes(label_path)
        if len(lab) % 4:
            raise _fail(label_path, f"{len(lab)} bytes is not a whole number of uint32 labels.")
        words = np.frombuffer(lab, "<u4")
        if len(words) != len(rec):
            raise _fail(
                label_path,
                f"holds {len(words)} labels but {os.fspath(path)} has {len(rec)} points.",
            )
        labels = (words & 0xFFFF).astype(np.int64)
        instances = (words >> 16).astype(np.int64)
    return PointCloud(
        np.ascontiguousarray(rec[:, :3]),
        np.ascontiguousarray(rec[:, 3:4]),
        ("intensity",),
        labels,
        instances,
    )


# --- PLY -----------------------------------------------------------------

_PLY_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1",
    "short": "i2", "int16": "i2", "ushort": "u2", "uint16": "u2",
    "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4",
    "float": "f4", "float32": "f4", "double": "f8", "float64": "f8",
}  # fmt: skip


@dataclass
class _PlyElement:
    name: str
    count: int
    # (name, type) for scalars, (name, (count type, item type)) for lists
    props: list[tuple[str, str | tuple[str, str]]] = field(default_factory=list)

    @property
    def has_lists(self) -> bool:
        return any(isinstance(t, tuple) for _, t in self.props)


def _ply_header(path: PathLike, raw: bytes) -> tuple[str, list[_PlyElement], int]:
    """The format, the elements and the offset of the body."""
    if not raw.startswith(b"ply\n") and not raw.startswith(b"ply\r\n"):
        raise _fail(path, "not a PLY file (it must start with the line 'ply').")
    match = re.search(rb"end_header\r?\n", raw)
    if match is None:
        raise _fail(path, "PLY header has no 'end_header' line (truncated header?).")
    lines = raw[: match.start()].decode("ascii", "replace").splitlines()[1:]
    fmt = None
    elements: list[_PlyElement] = []
    for number, line in enumerate(lines, start=2):
        parts = line.split()
        if not parts or parts[0] in ("comment", "obj_info"):
            continue
        where = f"PLY header line {number} ({line.strip()!r})"
        if parts[0] == "format":
            if len(parts) != 3 or parts[1] not in (
                "ascii",
                "binary_little_endian",
                "binary_big_endian",
            ):
                raise _fail(path, f"{where}: unknown format.")
            fmt = parts[1]
        elif parts[0] == "element":
            if len(parts) != 3 or not parts[2].isdigit():
                raise _fail(path, f"{where}: expected 'element NAME COUNT'.")
            elements.append(_PlyElement(parts[1], int(parts[2])))
        elif parts[0] == "property":
            if not elements:
                raise _fail(path, f"{where}: property before any element.")
            if parts[1:2] == ["list"]:
                if len(parts) != 5 or parts[2] not in _PLY_TYPES or parts[3] not in _PLY_TYPES:
                    raise _fail(path, f"{where}: expected 'property list COUNT_TYPE TYPE NAME'.")
                elements[-1].props.append((parts[4], (_PLY_TYPES[parts[2]], _PLY_TYPES[parts[3]])))
            else:
                if len(parts) != 3 or parts[1] not in _PLY_TYPES:
                    raise _fail(path, f"{where}: expected 'property TYPE NAME' with a PLY type.")
                elements[-1].props.append((parts[2], _PLY_TYPES[parts[1]]))
        else:
            raise _fail(path, f"{where}: unknown header keyword {parts[0]!r}.")
    if fmt is None:
        raise _fail(path, "PLY header has no 'format' line.")
    return fmt, elements, match.end()


def _skip_binary_lists(
    path: PathLike, raw: bytes, pos: int, el: _PlyElement, order: str
) -> tuple[int, list[dict]]:
    """Walk ``el``'s items (with list properties) from ``pos``; returns the
    end offset and the scalar values of each item."""
    rows = []
    for i in range(el.count):
        row = {}
        for name, kind in el.props:
            if isinstance(kind, tuple):
                ctype, itype = np.dtype(order + kind[0]), np.dtype(order + kind[1])
                if pos + ctype.itemsize > len(raw):
                    raise _fail(path, f"truncated in element {el.name!r} item {i}.")
                n = int(np.frombuffer(raw, ctype, 1, pos)[0])
                pos += ctype.itemsize + n * itype.itemsize
            else:
                t = np.dtype(order + kind)
                if pos + t.itemsize > len(raw):
                    raise _fail(path, f"truncated in element {el.name!r} item {i}.")
                row[name] = np.frombuffer(raw, t, 1, pos)[0]
                pos += t.itemsize
        if pos > len(raw):
            raise _fail(path, f"truncated in element {el.name!r} item {i}.")
        rows.append(row)
    return pos, rows


def read_ply(path: PathLike, *, label_field: str | None = None) -> PointCloud:
    """The ``vertex`` element of a PLY file (ascii, binary little or big endian).

    ``x``, ``y``, ``z`` are the points; the label is ``label_field`` or the
    first of :data:`LABEL_FIELDS` present; every other scalar vertex property
    is a feature column (in header order). Vertex list properties and other
    elements (faces, cameras, ...) are skipped.

    >>> import tempfile
    >>> p = tempfile.mkdtemp() + "/a.ply"
    >>> _ = open(p, "w").write("ply\\nformat ascii 1.0\\nelement vertex 2\\nproperty float x\\n"
    ...     "property float y\\nproperty float z\\nproperty uchar red\\nproperty int label\\n"
    ...     "end_header\\n0 0 1 255 3\\n1 2 3 0 4\\n")
    >>> c = read_ply(p)
    >>> c.points.tolist(), c.feature_names, c.features.tolist(), c.labels.tolist()
    ([[0.0, 0.0, 1.0], [1.0, 2.0, 3.0]], ('red',), [[255.0], [0.0]], [3, 4])
    """
    raw = _read_bytes(path)
    fmt, elements, pos = _ply_header(path, raw)
    vertex = next((e for e in elements if e.name == "vertex"), None)
    if vertex is None:
        raise _fail(path, "PLY file has no 'vertex' element.")
    scalars = [(n, t) for n, t in vertex.props if isinstance(t, str)]
    missing = [a for a in "xyz" if a not in dict(scalars)]
    if missing:
        raise _fail(path, f"PLY vertices lack the propert{'ies' if len(missing) > 1 else 'y'} "
                    f"{', '.join(missing)}.")  # fmt: skip
    columns: dict[str, np.ndarray]
    if fmt == "ascii":
        columns = _ply_ascii(path, raw[pos:], elements, vertex)
    else:
        order = "<" if fmt == "binary_little_endian" else ">"
        for el in elements:
            if el is vertex:
                break
            if el.has_lists:
                pos, _ = _skip_binary_lists(path, raw, pos, el, order)
            else:
                pos += (
                    el.count
                    * np.dtype([(f"p{i}", order + t) for i, (_, t) in enumerate(el.props)]).itemsize
                )  # type: ignore[operator]
            if pos > len(raw):
                raise _fail(path, f"truncated in element {el.name!r} (before the vertices).")
        if vertex.has_lists:
            _, rows = _skip_binary_lists(path, raw, pos, vertex, order)
            columns = {n: np.array([r[n] for r in rows], order + t) for n, t in scalars}
        else:
            dtype = np.dtype([(n, order + t) for n, t in scalars])
            need = dtype.itemsize * vertex.count
            if pos + need > len(raw):
                raise _fail(
                    path,
                    f"truncated: {vertex.count} vertices need {need} bytes, the body has "
                    f"{len(raw) - pos}.",
                )
            verts = np.frombuffer(raw, dtype, vertex.count, pos)
            columns = {n: verts[n] for n, _ in scalars}
    xyz = np.stack([columns[a] for a in "xyz"], axis=1)
    return _cloud(path, xyz, columns, label_field)


def _ply_ascii(
    path: PathLike, body: bytes, elements: list[_PlyElement], vertex: _PlyElement
) -> dict[str, np.ndarray]:
    lines = [ln for ln in body.decode("ascii", "replace").splitlines() if ln.strip()]
    start = 0
    for el in elements:
        if el is vertex:
            break
        start += el.count
    rows = lines[start : start + vertex.count]
    if len(rows) < vertex.count:
        raise _fail(path, f"truncated: {vertex.count} vertices declared, {len(rows)} lines found.")
    values: dict[str, list[float]] = {n: [] for n, t in vertex.props if isinstance(t, str)}
    for i, line in enumerate(rows):
        tokens = line.split()
        k = 0
        try:
            for name, kind in vertex.props:
                if isinstance(kind, tuple):
                    k += 1 + int(tokens[k])
                else:
                    values[name].append(float(tokens[k]))
                    k += 1
        except (IndexError, ValueError):
            if i == len(rows) - 1 and start + vertex.count == len(lines):
                raise _fail(
                    path, f"truncated: the last vertex ({line.strip()!r}) is incomplete."
                ) from None
            raise _fail(path, f"vertex {i} ({line.strip()!r}) does not match the header.") from None
        if k != len(tokens):
            raise _fail(path, f"vertex {i} has {len(tokens)} values, the header declares {k}.")
    return {n: np.array(v, np.float64) for n, v in values.items()}


# --- PCD -----------------------------------------------------------------

_PCD_TYPES = {("F", 4): "f4", ("F", 8): "f8", ("I", 1): "i1", ("I", 2): "i2", ("I", 4): "i4",
              ("I", 8): "i8", ("U", 1): "u1", ("U", 2): "u2", ("U", 4): "u4", ("U", 8): "u8"}  # fmt: skip


def read_pcd(path: PathLike, *, label_field: str | None = None) -> PointCloud:
    """A PCL ``.pcd`` file with ``DATA ascii`` or ``DATA binary``.

    Fields ``x``, ``y``, ``z`` are the points; the label is ``label_field``
    or the first of :data:`LABEL_FIELDS`; a packed ``rgb``/``rgba`` field
    becomes ``r``, ``g``, ``b`` features (0-255); fields with ``COUNT > 1``
    become one feature column per element (``name_0``, ...). Points with
    NaN coordinates (organised clouds) are kept. ``DATA binary_compressed``
    raises :class:`PointCloudFormatError` (not supported).

    >>> import tempfile
    >>> p = tempfile.mkdtemp() + "/a.pcd"
    >>> _ = open(p, "w").write("VERSION 0.7\\nFIELDS x y z intensity\\nSIZE 4 4 4 4\\nTYPE F F F F\\n"
    ...     "COUNT 1 1 1 1\\nWIDTH 1\\nHEIGHT 1\\nPOINTS 1\\nDATA ascii\\n1 2 3 0.25\\n")
    >>> c = read_pcd(p)
    >>> c.points.tolist(), c.feature_names, c.features.tolist()
    ([[1.0, 2.0, 3.0]], ('intensity',), [[0.25]])
    """
    raw = _read_bytes(path)
    header: dict[str, list[str]] = {}
    pos = 0
    while True:
        end = raw.find(b"\n", pos)
        if end < 0:
            raise _fail(path, "PCD header has no 'DATA' line (truncated header?).")
        line = raw[pos:end].decode("ascii", "replace").strip()
        pos = end + 1
        if not line or line.startswith("#"):
            continue
        key, *values = line.split()
        header[key.upper()] = values
        if key.upper() == "DATA":
            break
    for key in ("FIELDS", "SIZE", "TYPE"):
        if key not in header:
            raise _fail(path, f"PCD header has no {key} line.")
    names = header["FIELDS"]
    counts = header.get("COUNT", ["1"] * len(names))
    if not (len(header["SIZE"]) == len(header["TYPE"]) == len(counts) == len(names)):
        raise _fail(path, "PCD header: FIELDS, SIZE, TYPE and COUNT have different lengths.")
    try:
        dtypes = [
            _PCD_TYPES[(t.upper(), int(s))]
            for t, s in zip(header["TYPE"], header["SIZE"], strict=True)
        ]
        counts_i = [int(c) for c in counts]
        n = (
            int(header["POINTS"][0])
            if "POINTS" in header
            else int(header["WIDTH"][0]) * int(header.get("HEIGHT", ["1"])[0])
        )
    except (KeyError, ValueError, IndexError):
        raise _fail(path, "PCD header: bad SIZE/TYPE/COUNT/POINTS values.") from None
    missing = [a for a in "xyz" if a not in names]
    if missing:
        raise _fail(path, f"PCD fields lack {', '.join(missing)}.")
    mode = header["DATA"][0].lower() if header["DATA"] else ""
    dtype = np.dtype(
        [
            (name, "<" + t, (c,)) if c > 1 else (name, "<" + t)
            for name, t, c in zip(names, dtypes, counts_i, strict=True)
        ]
    )
    if mode == "binary":
        need = dtype.itemsize * n
        if len(raw) - pos < need:
            raise _fail(
                path, f"truncated: {n} points need {need} bytes, the body has {len(raw) - pos}."
            )
        rec = np.frombuffer(raw, dtype, n, pos)
    elif mode == "ascii":
        rows = [
            ln.split() for ln in raw[pos:].decode("ascii", "replace").splitlines() if ln.strip()
        ]
        width = sum(counts_i)
        if len(rows) < n:
            raise _fail(path, f"truncated: {n} points declared, {len(rows)} lines found.")
        bad = next((i for i, r in enumerate(rows[:n]) if len(r) != width), None)
        if bad is not None:
            raise _fail(
                path, f"point {bad} has {len(rows[bad])} values, the header declares {width}."
            )
        try:
            flat = np.array(rows[:n], np.float64).reshape(n, width)
        except ValueError:
            raise _fail(path, "ascii data holds a value that is not a number.") from None
        rec = np.zeros(n, dtype)
        col = 0
        for name, c in zip(names, counts_i, strict=True):
            value = flat[:, col : col + c]  # a packed float rgb keeps its bits (float64 holds them)
            rec[name] = value if c > 1 else value[:, 0]
            col += c
    elif mode == "binary_compressed":
        raise _fail(path, "PCD 'DATA binary_compressed' is not supported; save as binary or ascii.")
    else:
        raise _fail(path, f"PCD DATA {mode!r} is unknown (expected ascii or binary).")
    columns: dict[str, np.ndarray] = {}
    for name, c in zip(names, counts_i, strict=True):
        if name == "_":
            continue  # padding
        if name in ("rgb", "rgba"):
            packed = np.ascontiguousarray(rec[name]).view(np.uint32)
            for k, channel in enumerate("rgb"):
                columns[channel] = ((packed >> (16 - 8 * k)) & 0xFF).astype(np.float32)
        elif c > 1:
            for k in range(c):
                columns[f"{name}_{k}"] = rec[name][:, k]
        else:
            columns[name] = rec[name]
    xyz = np.stack([columns[a] for a in "xyz"], axis=1)
    return _cloud(path, xyz, columns, label_field)


# --- LAS / LAZ -------------------------------------------------------------

#: LAS point dimensions read as features when present.
LAS_FEATURES = ("intensity", "return_number", "number_of_returns", "red", "green", "blue")


def read_las(path: PathLike, *, recenter: bool = True) -> PointCloud:
    """A LAS or LAZ file through ``laspy`` (LAZ needs ``lazrs``; both come
    with the wheel's ``las`` extra: ``pip install 'quantlattice_mlx_lattice[las]'``).

    ``points`` are the scaled coordinates minus ``origin``: with
    ``recenter`` the floor of the header's minimum (float32 keeps about
    millimetres near it, not near georeferenced coordinates of 10^6 m),
    else zeros. ``labels`` is the ``classification`` dimension; the
    dimensions of :data:`LAS_FEATURES` that the point format has are features.

    >>> import laspy, tempfile
    >>> las = laspy.LasData(laspy.LasHeader(point_format=3, version="1.2"))
    >>> las.header.offsets, las.header.scales = [500000.0, 4e6, 0], [0.01, 0.01, 0.01]
    >>> las.x, las.y, las.z = np.array([500010.25, 500011.5]), np.array([4000001.0, 4000002.0]), np.array([3.0, 4.0])
    >>> las.classification = np.array([2, 6])
    >>> p = tempfile.mkdtemp() + "/a.las"; las.write(p)
    >>> c = read_las(p)
    >>> c.origin.tolist(), c.points.tolist(), c.labels.tolist()
    ([500010.0, 4000001.0, 3.0], [[0.25, 0.0, 0.0], [1.5, 1.0, 1.0]], [2, 6])
    """
    try:
        import laspy
    except ImportError:
        raise ModuleNotFoundError(
            "reading LAS/LAZ needs laspy (and lazrs for LAZ): "
            "pip install 'quantlattice_mlx_lattice[las]' or pip install laspy lazrs"
        ) from None
    if not Path(path).is_file():
        raise _fail(path, "no such file.")
    try:
        las = laspy.read(os.fspath(path))
        xyz = np.stack([np.asarray(las.x), np.asarray(las.y), np.asarray(las.z)], axis=1)
    except laspy.errors.LaspyException as e:
        raise _fail(path, f"not a readable LAS/LAZ file ({e}).") from None
    except Exception as e:
        raise _fail(
            path, f"malformed or truncated LAS/LAZ file ({type(e).__name__}: {e})."
        ) from None
    if len(xyz) != las.header.point_count:
        raise _fail(
            path, f"truncated: header says {las.header.point_count} points, read {len(xyz)}."
        )
    origin = np.floor(xyz.min(axis=0)) if recenter and len(xyz) else np.zeros(3)
    dims = set(las.point_format.dimension_names)
    names = tuple(d for d in LAS_FEATURES if d in dims)
    feats = np.stack([np.asarray(las[d], np.float32) for d in names], axis=1) if names else None
    return PointCloud(
        (xyz - origin).astype(np.float32),
        feats,
        names,
        np.asarray(las.classification, np.int64),
        None,
        origin.astype(np.float64),
    )


# --- NumPy -----------------------------------------------------------------


def read_npy(path: PathLike) -> PointCloud:
    """An ``(N, >=3)`` array: columns 0-2 are the points, the rest features
    (``f3``, ``f4``, ...).

    >>> import tempfile
    >>> p = tempfile.mkdtemp() + "/a.npy"
    >>> np.save(p, np.array([[1, 2, 3, 9]], np.float64))
    >>> c = read_npy(p)
    >>> c.points.tolist(), c.feature_names, c.features.tolist()
    ([[1.0, 2.0, 3.0]], ('f3',), [[9.0]])
    """
    data = _np_load(path)
    if not isinstance(data, np.ndarray):
        raise _fail(path, "expected a .npy array, got an archive.")
    return _from_array(path, data, "array")


def _np_load(path: PathLike):
    try:
        return np.load(os.fspath(path), allow_pickle=False)
    except FileNotFoundError:
        raise _fail(path, "no such file.") from None
    except Exception as e:
        raise _fail(path, f"not a readable NumPy file ({type(e).__name__}: {e}).") from None


def _from_array(path: PathLike, data: np.ndarray, what: str) -> PointCloud:
    if data.ndim != 2 or data.shape[1] < 3 or data.dtype.kind not in "fiu":
        raise _fail(
            path, f"{what} must be a numeric (N, >=3) array, got {data.dtype} {data.shape}."
        )
    feats = data[:, 3:].astype(np.float32) if data.shape[1] > 3 else None
    names = tuple(f"f{i}" for i in range(3, data.shape[1]))
    return PointCloud(np.ascontiguousarray(data[:, :3], np.float32), feats, names)


def read_npz(path: PathLike) -> PointCloud:
    """An ``.npz`` archive with ``points`` ``(N, 3)`` and optionally
    ``features`` ``(N, F)`` and ``labels`` ``(N,)`` (integers).

    >>> import tempfile
    >>> p = tempfile.mkdtemp() + "/a.npz"
    >>> np.savez(p, points=np.zeros((2, 3)), labels=np.array([1, 2]))
    >>> c = read_npz(p)
    >>> c.points.dtype.name, c.labels.tolist(), c.features is None
    ('float32', [1, 2], True)
    """
    archive = _np_load(path)
    if isinstance(archive, np.ndarray):
        raise _fail(path, "expected an .npz archive, got a single array.")
    with archive:
        try:
            keys = set(archive.files)
            if "points" not in keys:
                raise _fail(
                    path, f"no 'points' array (arrays: {', '.join(sorted(keys)) or 'none'})."
                )
            unknown = keys - {"points", "features", "labels"}
            if unknown:
                raise _fail(
                    path, f"unknown array(s) {sorted(unknown)}; expected points, features, labels."
                )
            points = archive["points"]
            feats = archive["features"] if "features" in keys else None
            labels = archive["labels"] if "labels" in keys else None
        except PointCloudFormatError:
            raise
        except Exception as e:
            raise _fail(path, f"corrupt .npz archive ({type(e).__name__}: {e}).") from None
    if points.ndim != 2 or points.shape[1] != 3 or points.dtype.kind not in "fiu":
        raise _fail(
            path, f"points must be a numeric (N, 3) array, got {points.dtype} {points.shape}."
        )
    n = len(points)
    if feats is not None and (feats.ndim != 2 or len(feats) != n or feats.dtype.kind not in "fiub"):
        raise _fail(
            path, f"features must be a numeric ({n}, F) array, got {feats.dtype} {feats.shape}."
        )
    if labels is not None and (labels.shape != (n,) or labels.dtype.kind not in "iu"):
        raise _fail(path, f"labels must be ({n},) integers, got {labels.dtype} {labels.shape}.")
    return PointCloud(
        points.astype(np.float32),
        None if feats is None else feats.astype(np.float32),
        () if feats is None else tuple(f"f{i}" for i in range(feats.shape[1])),
        None if labels is None else labels.astype(np.int64),
    )


#: The suffixes :func:`read_points` knows (lower case).
SUFFIXES = (".bin", ".ply", ".las", ".laz", ".pcd", ".npy", ".npz")


def read_points(path: PathLike, *, label_path: PathLike | None = None) -> PointCloud:
    """Read any supported point cloud file, by its suffix (:data:`SUFFIXES`).

    ``label_path`` is only for KITTI ``.bin`` scans (their ``.label`` file).

    >>> try:
    ...     read_points("scan.xyz")
    ... except PointCloudFormatError as e:
    ...     print(e)
    scan.xyz: unknown point cloud suffix '.xyz' (known: .bin, .ply, .las, .laz, .pcd, .npy, .npz).
    """
    suffix = Path(path).suffix.lower()
    if label_path is not None and suffix != ".bin":
        raise _fail(path, "label_path is only for KITTI .bin scans.")
    if suffix == ".bin":
        return read_kitti(path, label_path)
    if suffix == ".ply":
        return read_ply(path)
    if suffix in (".las", ".laz"):
        return read_las(path)
    if suffix == ".pcd":
        return read_pcd(path)
    if suffix == ".npy":
        return read_npy(path)
    if suffix == ".npz":
        return read_npz(path)
    raise _fail(path, f"unknown point cloud suffix {suffix!r} (known: {', '.join(SUFFIXES)}).")
