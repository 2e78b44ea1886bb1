"""mlx_lattice.io.write_ply against an independent reader (plyfile): the
vertex count, every property's name, order, dtype and values, the comments
and the byte order; the package's own reader reads the same file back; bad
arguments raise MlxLatticeError naming them and write nothing."""

from __future__ import annotations

import numpy as np
import pytest
from plyfile import PlyData

from mlx_lattice import MlxLatticeError
from mlx_lattice.io import read_ply, write_ply

# Every PLY scalar type as the NumPy dtype a property is given in.
_TYPES = ("i1", "u1", "i2", "u2", "i4", "u4", "f4", "f8")


def _column(rng, code: str, n: int) -> np.ndarray:
    """``n`` values of dtype ``code`` with both ends of its range in them."""
    dtype = np.dtype(code)
    if dtype.kind == "f":
        values = rng.standard_normal(n).astype(dtype) * dtype.type(1e3)
        values[:3] = (np.finfo(dtype).max, np.finfo(dtype).tiny, -0.0)
        return values
    info = np.iinfo(dtype)
    values = rng.integers(info.min, info.max, n, endpoint=True, dtype=dtype)
    values[:2] = (info.min, info.max)
    return values


@pytest.mark.parametrize("coord", ["f4", "f8"])
def test_plyfile_reads_every_property_type(tmp_path, rng, coord):
    n = 1000
    points = (rng.standard_normal((n, 3)) * 50).astype(coord)
    properties = {f"p_{code}": _column(rng, code, n) for code in _TYPES}
    comments = ("made by the writer test", "classes ground,car")
    path = write_ply(tmp_path / "all.ply", points, properties, comments=comments)
    ply = PlyData.read(str(path))
    assert not ply.text and ply.byte_order == "<"
    assert list(ply.comments) == list(comments)
    (vertex,) = ply.elements
    assert vertex.name == "vertex" and vertex.count == n
    names = [p.name for p in vertex.properties]
    assert names == ["x", "y", "z", *properties]
    want_coord = np.dtype("<" + coord)
    for axis, name in enumerate("xyz"):
        assert vertex[name].dtype == want_coord
        np.testing.assert_array_equal(vertex[name], points[:, axis])
    for name, values in properties.items():
        assert vertex[name].dtype == np.dtype("<" + values.dtype.str[1:]), name
        np.testing.assert_array_equal(vertex[name], values, err_msg=name)
    # One structured body right after the header: nothing before or after it.
    row_bytes = 3 * want_coord.itemsize + sum(np.dtype(c).itemsize for c in _TYPES)
    header = path.read_bytes().index(b"end_header\n") + len(b"end_header\n")
    assert path.stat().st_size == header + n * row_bytes


def test_labels_and_colours_read_back_by_the_package_reader(tmp_path, rng):
    n = 300
    points = rng.uniform(-30, 30, (n, 3)).astype(np.float32)
    labels = rng.integers(0, 19, n).astype(np.int32)
    palette = rng.integers(0, 256, (19, 3)).astype(np.uint8)
    rgb = palette[labels]
    path = write_ply(tmp_path / "seg.ply", points,
                     {"red": rgb[:, 0], "green": rgb[:, 1], "blue": rgb[:, 2], "label": labels})  # fmt: skip
    cloud = read_ply(path)
    np.testing.assert_array_equal(cloud.points, points)
    np.testing.assert_array_equal(cloud.labels, labels)
    assert cloud.feature_names == ("red", "green", "blue")
    np.testing.assert_array_equal(cloud.features, rgb.astype(np.float32))


def test_no_points_and_no_properties(tmp_path):
    path = write_ply(tmp_path / "empty.ply", np.zeros((0, 3), np.float32))
    ply = PlyData.read(str(path))
    assert ply["vertex"].count == 0 and [p.name for p in ply["vertex"].properties] == ["x", "y", "z"]
    assert len(read_ply(path)) == 0


@pytest.mark.parametrize(
    ("points", "properties", "comments", "message"),
    [
        (np.zeros((4, 2), np.float32), {}, (), "points must have shape (N, 3), got (4, 2)"),
        (np.zeros((4, 3), np.int32), {}, (), "points must be floating point, got int32"),
        (np.zeros((4, 3), np.float32), {"label": np.zeros(3, np.int32)}, (),
         "property 'label' must have shape (4,) (one value per point), got (3,)"),
        (np.zeros((4, 3), np.float32), {"label": np.zeros(4, np.int64)}, (),
         "property 'label' has dtype int64, which PLY cannot store"),
        (np.zeros((4, 3), np.float32), {"keep": np.zeros(4, bool)}, (), "dtype bool"),
        (np.zeros((4, 3), np.float32), {"x": np.zeros(4, np.float32)}, (), "'x' is given twice"),
        (np.zeros((4, 3), np.float32), {"my label": np.zeros(4, np.int32)}, (),
         "property name 'my label' must be non-empty printable ASCII without spaces"),
        (np.zeros((4, 3), np.float32), {"": np.zeros(4, np.int32)}, (), "property name ''"),
        (np.zeros((4, 3), np.float32), {}, ("two\nlines",), "each comment must be one line"),
        (np.zeros((4, 3), np.float32), {}, "one line", "comments must be a sequence of lines"),
    ],
)
def test_bad_arguments_raise_and_write_nothing(tmp_path, points, properties, comments, message):
    path = tmp_path / "bad.ply"
    with pytest.raises(MlxLatticeError) as info:
        write_ply(path, points, properties, comments=comments)
    assert message in str(info.value) and str(info.value).startswith("write_ply: ")
    assert not path.exists()


def test_rewrites_an_existing_file_and_writes_through_a_link(tmp_path, rng):
    """An earlier file is replaced whole (a shorter file leaves nothing of
    the longer one); a symbolic link keeps pointing at its target, which
    gets the new points."""
    path = tmp_path / "scan.ply"
    write_ply(path, rng.standard_normal((50, 3)).astype(np.float32))
    points = rng.standard_normal((5, 3)).astype(np.float32)
    write_ply(path, points)
    np.testing.assert_array_equal(read_ply(path).points, points)
    assert PlyData.read(str(path))["vertex"].count == 5
    link = tmp_path / "link.ply"
    link.symlink_to(path)
    again = rng.standard_normal((7, 3)).astype(np.float32)
    write_ply(link, again)
    assert link.is_symlink() and link.resolve() == path.resolve()
    np.testing.assert_array_equal(read_ply(path).points, again)


def test_big_endian_float64_points_are_written_as_double(tmp_path, rng):
    """Float64 points in either byte order keep their bits (``double``)."""
    points = (rng.standard_normal((6, 3)) * 1e3).astype(">f8")
    assert points.dtype.byteorder == ">"
    path = write_ply(tmp_path / "be.ply", points)
    vertex = PlyData.read(str(path))["vertex"]
    assert [p.val_dtype for p in vertex.properties] == ["f8", "f8", "f8"]
    for i, axis in enumerate("xyz"):
        np.testing.assert_array_equal(vertex[axis], points[:, i])


def test_a_failed_write_keeps_the_old_file(tmp_path, rng, monkeypatch):
    """The body goes to a temporary file renamed onto the path: a write that
    fails (a full disk here) leaves the earlier file as it was and no
    temporary file behind."""
    from mlx_lattice.io import writers

    path = tmp_path / "scan.ply"
    points = rng.standard_normal((20, 3)).astype(np.float32)
    write_ply(path, points)
    before = path.read_bytes()

    class Full:
        def __init__(self, name, mode):
            self.f = open(name, mode)  # noqa: SIM115

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(bytes(data)[:3])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(writers, "open", Full, raising=False)
    with pytest.raises(OSError, match="No space left"):
        write_ply(path, rng.standard_normal((30, 3)).astype(np.float32))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scan.ply"]
