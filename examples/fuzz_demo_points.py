"""Fuzz target of the demo's ``--points`` reader (``demo.read_points``).

Budget and replay: ``tools/fuzzing.py``.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from fuzzing import fuzz
from hypothesis import strategies as st

from examples import demo

PLY_TYPES = ["float", "double", "uchar", "int", "short", "float32", "bogus"]
header_lines = st.lists(
    st.sampled_from(["format ascii 1.0", "format binary_little_endian 1.0",
                     "format binary_big_endian 1.0", "format", "comment x", "element face 1",
                     "property", "property float", "property list uchar int vertex_indices"])
    | st.builds(lambda n: f"element vertex {n}",
                st.integers(-2, 4) | st.sampled_from([2**40, "x", ""]))
    | st.builds(lambda t, n: f"property {t} {n}", st.sampled_from(PLY_TYPES),
                st.sampled_from(["x", "y", "z", "w"])),
    max_size=8,
)


def _ply(lines: list[str], newline: bool, body: bytes) -> bytes:
    head = "\n".join(["ply", *lines, "end_header"]).encode()
    return head + (b"\n" if newline else b"") + body


npy_arrays = st.builds(
    lambda shape, dtype: np.arange(int(np.prod(shape))).reshape(shape).astype(dtype),
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.sampled_from(["f4", "f8", "i4", "u1", "c8", "U2", "?"]),
)


def _npy(array: np.ndarray, cut: int | None, flip: int | None) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    blob = bytearray(buf.getvalue())
    if flip is not None and blob:
        blob[flip % len(blob)] ^= 0xFF
    return bytes(blob[:cut] if cut is not None else blob)


ply_files = st.builds(_ply, header_lines, st.booleans(),
                      st.binary(max_size=40) | st.sampled_from([b"0 0 0\n1 2 3\n", b"1 2\n"]))
npy_files = st.builds(_npy, npy_arrays, st.none() | st.integers(0, 200),
                      st.none() | st.integers(0, 200))


@fuzz(300, suffix=st.just(".ply"), blob=ply_files)
def test_ply_reader_returns_points_or_value_error(suffix, blob, tmp_path):
    """read_points on a malformed .ply returns an (M, 3) float32 array or
    raises a ValueError naming the file; nothing else escapes."""
    _check(tmp_path / f"cloud{suffix}", blob)


@fuzz(300, suffix=st.just(".npy"), blob=npy_files)
def test_npy_reader_returns_points_or_value_error(suffix, blob, tmp_path):
    """read_points on a truncated, tampered or wrongly typed .npy returns an
    (M, 3) float32 array or raises a ValueError naming the file."""
    _check(tmp_path / f"cloud{suffix}", blob)


def _check(path: Path, blob: bytes) -> None:
    path.write_bytes(blob)
    try:
        points = demo.read_points(path)
    except ValueError as err:
        message = str(err)
    else:
        assert points.dtype == np.float32
        assert points.ndim == 2
        assert points.shape[1] == 3
        return
    assert str(path) in message, message
