import pytest

import quantrules as qr

EXPECTED = {
    # name: (bits, signed, kind, mlx (bits, group, mode) or None)
    "int2": (2, True, "integer", (2, 64, "affine")),
    "int3": (3, True, "integer", (3, 64, "affine")),
    "int4": (4, True, "integer", (4, 64, "affine")),
    "int5": (5, True, "integer", (5, 64, "affine")),
    "int6": (6, True, "integer", (6, 64, "affine")),
    "int8": (8, True, "integer", (8, 64, "affine")),
    "uint4": (4, False, "integer", (4, 64, "affine")),
    "uint8": (8, False, "integer", (8, 64, "affine")),
    "float8_e4m3fn": (8, True, "float", None),
    "float8_e5m2": (8, True, "float", None),
    "nf4": (4, True, "lookup_table", None),
    "mxfp4": (4, True, "float", (4, 32, "mxfp4")),
    "mxfp8": (8, True, "float", (8, 32, "mxfp8")),
    "nvfp4": (4, True, "float", (4, 16, "nvfp4")),
}


def test_registry_is_complete():
    assert set(qr.qtype_names()) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_qtype_properties(name):
    bits, signed, kind, mlx = EXPECTED[name]
    qt = qr.get_qtype(name)
    assert (qt.name, qt.bits, qt.signed, qt.kind) == (name, bits, signed, kind)
    assert qt.qwix_name == name
    if mlx is None:
        with pytest.raises(qr.UnsupportedQTypeError, match=f"qtype '{name}'.*cannot be represented"):
            qt.mlx_quantize_args()
    else:
        assert qt.mlx_quantize_args() == dict(zip(("bits", "group_size", "mode"), mlx, strict=True))


@pytest.mark.parametrize(
    ("alias", "name"),
    [("fp8", "float8_e4m3fn"), ("FLOAT8", "float8_e4m3fn"), ("E4M3", "float8_e4m3fn"),
     ("e5m2", "float8_e5m2"), ("Int8", "int8"), (" nf4 ", "nf4"), ("MXFP4", "mxfp4")],
)
def test_aliases_case_insensitive(alias, name):
    assert qr.get_qtype(alias).name == name


def test_unknown_qtype_lists_valid_names():
    with pytest.raises(qr.UnknownQTypeError) as info:
        qr.get_qtype("int7")
    msg = str(info.value)
    assert "unknown qtype 'int7'" in msg
    for name in qr.qtype_names():
        assert name in msg
    assert isinstance(info.value, ValueError)


def test_non_string_qtype():
    with pytest.raises(qr.UnknownQTypeError, match="must be a string, got int 8"):
        qr.get_qtype(8)


@pytest.mark.parametrize("tile", [32, 64, 128])
def test_mlx_affine_group_sizes(tile):
    assert qr.get_qtype("int4").mlx_quantize_args(tile)["group_size"] == tile


@pytest.mark.parametrize("tile", [16, 100, 0.5])
def test_mlx_rejects_unsupported_group(tile):
    with pytest.raises(qr.UnsupportedQTypeError, match=f"tile_size={tile!r}"):
        qr.get_qtype("int8").mlx_quantize_args(tile)


def test_mlx_block_formats_fix_their_block():
    assert qr.get_qtype("nvfp4").mlx_quantize_args(16)["group_size"] == 16
    with pytest.raises(qr.UnsupportedQTypeError, match="block of 32"):
        qr.get_qtype("mxfp4").mlx_quantize_args(64)
