"""Point cloud file writers: binary PLY.

:func:`write_ply` writes points and per-point properties (class labels,
colours, scores, ...) as one binary little-endian PLY ``vertex`` element
that :func:`~mlx_lattice.io.read_ply`, plyfile, Open3D, CloudCompare and
MeshLab read. The body is one NumPy structured array written in a single
call: on an 88k-point scan with colours and a label it takes a few
milliseconds, well under a tenth of a segmentation network's forward.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from mlx_lattice._errors import MlxLatticeError, MlxLatticeTypeError
from mlx_lattice._files import replacing
from mlx_lattice.io.readers import _PLY_TYPES

__all__ = ["write_ply"]

# NumPy type code -> the PLY type name written (the first spelling of
# each in the reader's table: char, uchar, short, ushort, int, uint, float,
# double).
_PLY_NAMES: dict[str, str] = {}
for _name, _code in _PLY_TYPES.items():
    _PLY_NAMES.setdefault(_code, _name)
del _name, _code


def _check_name(name: object) -> None:
    """A property name is one PLY header word: printable ASCII, no spaces."""
    if not isinstance(name, str):
        raise MlxLatticeTypeError(
            f"write_ply: property names must be str, got {type(name).__name__}."
        )
    if not name or not name.isascii() or not name.isprintable() or " " in name:
        raise MlxLatticeError(
            f"write_ply: property name {name!r} must be non-empty printable ASCII without spaces."
        )


def write_ply(
    path: str | os.PathLike[str],
    points: np.ndarray,
    properties: Mapping[str, np.ndarray] | None = None,
    *,
    comments: Sequence[str] = (),
) -> Path:
    """Write ``points`` and per-point ``properties`` as a binary PLY file.

    ``points`` is ``(N, 3)``: 8-byte float coordinates (float64 in either
    byte order) are written as ``double``, any other float type as
    ``float`` (float32). ``properties`` maps each
    further vertex property, in order, to ``N`` values whose dtype has a PLY
    type (int8, uint8, int16, uint16, int32, uint32, float32, float64; cast
    others, e.g. int64 labels with ``.astype(np.int32)``): ``red``,
    ``green``, ``blue`` as uint8 are the colours viewers show, ``label``
    is the property :func:`~mlx_lattice.io.read_ply` reads as labels.
    ``comments`` are header comment lines (a sequence of str, not one str).
    Returns ``path`` as a ``Path``.

    The file is written under a temporary name in the same folder and then
    renamed onto ``path`` (a symbolic link is written through to its
    target): a failed write keeps the file that was there, and a reader
    never sees half a file. It is always a new file: ext4 writes a file that
    is truncated and rewritten back to disk when it is closed, which made
    overwriting an 88k-point PLY about five times slower than writing a new
    one.

    A wrong shape, dtype or name raises :class:`~mlx_lattice.MlxLatticeError`
    naming the argument; nothing is written then. A file system error is
    the ``OSError`` it raised.

    >>> import tempfile
    >>> from mlx_lattice.io import read_ply
    >>> path = Path(tempfile.mkdtemp()) / "scan.ply"
    >>> points = np.array([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], np.float32)
    >>> rgb = np.array([[255, 0, 0], [0, 0, 255]], np.uint8)
    >>> _ = write_ply(path, points, {"red": rgb[:, 0], "green": rgb[:, 1], "blue": rgb[:, 2],
    ...                              "label": np.array([3, 7], np.int32)})
    >>> path.read_bytes().split(b"end_header")[0].decode().splitlines()[2:4]
    ['element vertex 2', 'property float x']
    >>> cloud = read_ply(path)
    >>> cloud.points.tolist(), cloud.feature_names, cloud.labels.tolist()
    ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], ('red', 'green', 'blue'), [3, 7])
    >>> write_ply(path, points, {"label": np.array([3, 7])})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mlx_lattice._errors.MlxLatticeError: write_ply: property 'label' has dtype int64, which ...
    """
    pts = np.asarray(points)
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise MlxLatticeError(f"write_ply: points must have shape (N, 3), got {pts.shape}.")
    if pts.dtype.kind != "f":
        raise MlxLatticeError(f"write_ply: points must be floating point, got {pts.dtype}.")
    coord = "<f8" if pts.dtype.itemsize == 8 else "<f4"
    fields: list[tuple[str, str]] = [("x", coord), ("y", coord), ("z", coord)]
    columns: list[np.ndarray] = []
    for name, values in (properties or {}).items():
        _check_name(name)
        if name in ("x", "y", "z") or name in dict(fields):
            raise MlxLatticeError(f"write_ply: property {name!r} is given twice (x, y, z are the points).")
        column = np.asarray(values)
        if column.shape != (len(pts),):
            raise MlxLatticeError(
                f"write_ply: property {name!r} must have shape ({len(pts)},) (one value per "
                f"point), got {column.shape}."
            )
        code = column.dtype.str[1:]
        if code not in _PLY_NAMES:
            raise MlxLatticeError(
                f"write_ply: property {name!r} has dtype {column.dtype}, which PLY cannot store; "
                "cast it to one of int8, uint8, int16, uint16, int32, uint32, float32, float64."
            )
        fields.append((name, "<" + code))
        columns.append(column)
    if isinstance(comments, str | bytes):
        raise MlxLatticeTypeError(
            f"write_ply: comments must be a sequence of lines (e.g. [{comments!r}]), got a "
            f"{type(comments).__name__}."
        )
    for text in comments:
        if not isinstance(text, str) or not text.isascii() or not text.isprintable():
            raise MlxLatticeError(
                f"write_ply: each comment must be one line of printable ASCII, got {text!r}."
            )
    vertex = np.empty(len(pts), dtype=fields)
    # x, y, z in one copy: a (N, 3) view of the first three fields.
    coords = np.ndarray((len(pts), 3), coord, vertex.data, 0, (vertex.itemsize, int(coord[-1])))
    coords[...] = pts
    for (name, _), column in zip(fields[3:], columns, strict=True):
        vertex[name] = column
    header = ["ply", "format binary_little_endian 1.0"]
    header += [f"comment {text}" for text in comments]
    header.append(f"element vertex {len(pts)}")
    header += [f"property {_PLY_NAMES[code[1:]]} {name}" for name, code in fields]
    header.append("end_header\n")
    out = Path(path)
    target = Path(os.path.realpath(out)) if out.is_symlink() else out
    with replacing(target) as tmp, open(tmp, "wb") as f:
        f.write("\n".join(header).encode("ascii"))
        f.write(vertex.data)
    return out
