"""The float16 forward convolution (cpu/gemm_bf16.h): FMLAL/FMLAL2 where the
CPU has FEAT_FHM ("neon-fhm"), else the float32 path. Both must give the
bits of a NumPy emulation of the float32 fused chain (offsets ascending,
channels ascending, each product exact in float32 and each add rounded once,
then one rounding to float16): the FHM block is that chain on the widened
inputs, not float16 arithmetic."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice._native import ext
from mlx_lattice.core import QuantizedWeight, build_kernel_relation, ops

_spec = importlib.util.spec_from_file_location("refs", Path(__file__).with_name("relation_refs.py"))
relation_refs = importlib.util.module_from_spec(_spec)  # the shared tests/relation_refs.py
_spec.loader.exec_module(relation_refs)


def fp16_chain(f: np.ndarray, w: np.ndarray, src, dst, k_ids, n_rows: int) -> np.ndarray:
    """float16 result of the documented float32 chain (inputs float16-valued):
    row dst[e] gets f[src[e]] @ w[k_ids[e]], offsets ascending, channels
    ascending, each product exact in float32, each add rounded once."""
    return relation_refs.chain_ref(f, w, src, dst, k_ids, n_rows, range(f.shape[1])).astype(
        np.float16
    )


def fp16_conv_ref(f: np.ndarray, w: np.ndarray, rel) -> np.ndarray:
    """float16 result of the documented float32 chain (inputs float16-valued)."""
    in_rows, out_rows, k_ids = relation_refs.edges(rel)
    return fp16_chain(f, w, in_rows, out_rows, k_ids, rel.n_out_capacity)


def make_case(rng, cin: int, cout: int):
    coords, rel = relation_refs.random_relation(rng, 700)
    f = rng.standard_normal((len(coords), cin)).astype(np.float16).astype(np.float32)
    w = (rng.standard_normal((27, cin, cout)) * 0.2).astype(np.float16).astype(np.float32)
    return coords, rel, f, w


def run_fp16(f: np.ndarray, w: np.ndarray, rel) -> np.ndarray:
    out = ops.sparse_conv_features_from_relation(
        mx.array(f).astype(mx.float16), mx.array(w).astype(mx.float16), rel
    )
    assert out.dtype == mx.float16
    return np.array(out.view(mx.uint16))


fused = pytest.mark.skipif(
    ext.fp16_isa() == "float32" and ext.gemm_isa() == "scalar",
    reason="no fused path here: the scalar float32 path rounds every product",
)
needs_fhm = pytest.mark.skipif(
    ext.fp16_isa() == "float32", reason="no FEAT_FHM block here: float16 uses the float32 path"
)


@fused
@pytest.mark.parametrize(("cin", "cout"), [(64, 64), (19, 70), (7, 33), (1, 3)])
def test_matches_emulation_bit_for_bit(rng, cin, cout):
    _, rel, f, w = make_case(rng, cin, cout)
    want = fp16_conv_ref(f, w, rel).view(np.uint16)
    np.testing.assert_array_equal(run_fp16(f, w, rel), want)


def test_within_float16_rounding_of_float64(rng):
    """Every path: |out - exact| <= one float16 rounding of the result plus
    the float32 accumulation bound n * eps * sum|terms| (n = K * Cin)."""
    _, rel, f, w = make_case(rng, 40, 24)
    got = run_fp16(f, w, rel).view(np.float16).astype(np.float64)
    in_rows, out_rows, k_ids = relation_refs.edges(rel)
    exact = np.zeros(got.shape)
    mag = np.zeros(got.shape)
    for k in range(27):
        sel = k_ids == k
        exact[out_rows[sel]] += f[in_rows[sel]].astype(np.float64) @ w[k].astype(np.float64)
        mag[out_rows[sel]] += np.abs(f[in_rows[sel]]).astype(np.float64) @ np.abs(w[k])
    bound = 2.0**-11 * np.abs(exact) + 2.0**-24 + 1.01 * 27 * 40 * 2.0**-23 * mag
    assert np.all(np.abs(got - exact) <= bound)


@needs_fhm
def test_same_bits_for_any_thread_count(rng):
    _, rel, f, w = make_case(rng, 40, 24)
    before = mlx_lattice.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            mlx_lattice.set_num_threads(threads)
            results.append(run_fp16(f, w, rel))
    finally:
        mlx_lattice.set_num_threads(before)
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


@needs_fhm
def test_float32_fallback_gives_the_same_bits(rng, conv_per_isa):
    """Capped below neon-fhm (MLX_LATTICE_GEMM_ISA=neon-dotprod), float16
    runs through the float32 NEON path: the same chain, the same bits."""
    coords, _, f, w = make_case(rng, 48, 40)
    results = conv_per_isa(coords, f, w, "float16", ("neon-fhm", "neon-dotprod"))
    assert results["neon-fhm"]["fp16"] == "neon-fhm"
    assert results["neon-dotprod"]["fp16"] == "float32"
    assert results["neon-dotprod"]["gemm"] == "neon-fma"
    np.testing.assert_array_equal(results["neon-fhm"]["out"], results["neon-dotprod"]["out"])


def dense_cube_case(rng, side: int, cin: int, cout: int):
    """Every voxel of a side^3 cube in two batch entries: an interior row is
    gathered by all 27 offsets, so a tile's edges reuse each input row up to
    27 times (the forward converts each distinct row of a tile once)."""
    axes = np.meshgrid(*[np.arange(side)] * 3, indexing="ij")
    cube = np.stack(axes, -1).reshape(-1, 3)
    coords = np.concatenate(
        [np.concatenate([np.full((len(cube), 1), b), cube], 1) for b in (0, 1)]
    ).astype(np.int32)
    rel = build_kernel_relation(coords, kernel_size=3)
    f = rng.standard_normal((len(coords), cin)).astype(np.float16).astype(np.float32)
    w = (rng.standard_normal((27, cin, cout)) * 0.2).astype(np.float16).astype(np.float32)
    return rel, f, w


def for_threads(fn):
    before = mlx_lattice.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            mlx_lattice.set_num_threads(threads)
            results.append(fn())
    finally:
        mlx_lattice.set_num_threads(before)
    return results


@fused
@pytest.mark.parametrize(("cin", "cout"), [(64, 64), (32, 32), (19, 5)])
def test_heavy_row_reuse_matches_emulation_for_any_thread_count(rng, seed, cin, cout):
    """A 12^3 cube (3456 rows, several tiles; ~24 edges per row): the bits of
    the per-edge emulation (every edge widens its own row) for 1, 2 and 3
    threads."""
    rel, f, w = dense_cube_case(rng, 12, cin, cout)
    assert rel.n_edges > 20 * rel.n_in
    want = fp16_conv_ref(f, w, rel).view(np.uint16)
    for threads, got in zip((1, 2, 3), for_threads(lambda: run_fp16(f, w, rel)), strict=True):
        np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}, {threads} threads")


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_heavy_row_reuse_is_the_float32_result_rounded(rng, seed, bits):
    """Weight-only int8/int4 with float16 features (rows widened inside
    each register block) gives the float32-feature result of the same codes rounded to
    float16, bit for bit, for 1, 2 and 3 threads."""
    rel, f, w = dense_cube_case(rng, 12, 64, 48)
    q = QuantizedWeight.from_float(mx.array(w), bits=bits, group_size=32)
    f16 = mx.array(f).astype(mx.float16)

    def run():
        half = ops.sparse_quantized_conv_features_from_relation(f16, q, rel)
        wide = ops.sparse_quantized_conv_features_from_relation(f16.astype(mx.float32), q, rel)
        assert half.dtype == mx.float16 and wide.dtype == mx.float32
        return np.array(half.view(mx.uint16)), np.array(wide.astype(mx.float16).view(mx.uint16))

    for threads, (half, wide) in zip((1, 2, 3), for_threads(run), strict=True):
        np.testing.assert_array_equal(half, wide, err_msg=f"seed {seed}, {threads} threads")


@fused
@pytest.mark.parametrize("width", [1, 3, 17, 33, 64, 130])
def test_odd_widths_match_emulation_for_any_thread_count(rng, seed, width):
    """Channel counts off the 16-lane vectors (widening tails of 1-15 values,
    masked column strips): the bits of the per-edge emulation, 1-3 threads."""
    _, rel, f, w = make_case(rng, width, width)
    want = fp16_conv_ref(f, w, rel).view(np.uint16)
    for threads, got in zip((1, 2, 3), for_threads(lambda: run_fp16(f, w, rel)), strict=True):
        np.testing.assert_array_equal(
            got, want, err_msg=f"seed {seed}, C{width}, {threads} threads"
        )


def far_outputs(first: int, count: int) -> np.ndarray:
    """`count` output coordinates far from every input of make_case (whose
    coordinates lie in [0, 9)): outputs without a single edge."""
    xs = first + 2 * np.arange(count)
    return np.stack([np.zeros(count), xs, np.full(count, 40), np.full(count, 40)], 1)


@fused
@pytest.mark.parametrize(("cin", "cout"), [(17, 5), (64, 64)])
def test_empty_tiles_are_zero_and_match_emulation(rng, seed, cin, cout):
    """A target relation whose first 1100 and last 600 outputs have no edges
    (whole tiles without an edge, at every tile size the driver picks) and a
    tile that ends inside them: those rows are +0.0 and the rest the bits of
    the emulation, for 1-3 threads."""
    coords, _, f, w = make_case(rng, cin, cout)
    out_coords = np.concatenate(
        [far_outputs(40, 1100), coords, far_outputs(4000, 600)]
    ).astype(np.int32)
    rel = build_kernel_relation(coords, out_coords, kernel_size=3, kind="target")
    assert rel.n_out_capacity == len(out_coords) and rel.n_edges > 0
    out_rows = np.array(rel.edges.out_rows)
    assert out_rows.min() == 1100 and out_rows.max() < 1100 + len(coords)
    want = fp16_conv_ref(f, w, rel).view(np.uint16)
    edgeless = np.ones(len(out_coords), bool)
    edgeless[out_rows] = False
    for threads, got in zip((1, 2, 3), for_threads(lambda: run_fp16(f, w, rel)), strict=True):
        msg = f"seed {seed}, {threads} threads"
        np.testing.assert_array_equal(got[edgeless], 0, err_msg=msg)
        np.testing.assert_array_equal(got, want, err_msg=msg)


@pytest.mark.skipif(
    not {"avx512f", "avx2-fma"} <= set(ext.gemm_isas()),
    reason="needs both x86 fp32 levels (AVX-512 and AVX2 widening/rounding)",
)
@pytest.mark.parametrize(("cin", "cout"), [(33, 130), (64, 64), (3, 17)])
def test_avx512_and_avx2_widening_give_the_same_bits(rng, seed, conv_per_isa, cin, cout):
    """float16 rows widen and the tiles round with AVX-512 conversions under
    the avx512f ceiling and with 8-lane F16C ones under avx2-fma (and the
    GEMM changes kernel): both exact conversions around the same fused
    chain, so the same bits, equal to the emulation."""
    coords, rel, f, w = make_case(rng, cin, cout)
    results = conv_per_isa(coords, f, w, "float16", ("avx512f", "avx2-fma"))
    assert results["avx512f"]["gemm"] == "avx512f"
    assert results["avx2-fma"]["gemm"] == "avx2-fma"
    want = fp16_conv_ref(f, w, rel).view(np.uint16)
    for isa in ("avx512f", "avx2-fma"):
        np.testing.assert_array_equal(results[isa]["out"], want, err_msg=f"seed {seed}, {isa}")


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize(("width", "bits"), [(1, 8), (3, 4), (17, 8), (33, 4), (64, 8), (130, 4)])
def test_weight_only_odd_widths_are_the_float_conv_of_the_dequantized_weight(
    rng, seed, width, bits, dtype
):
    """Weight-only int8/int4 (dequantized once per call, then the float
    forward) against the float convolution of a NumPy dequantization of the
    codes (s * q + b, both roundings), bit for bit, 1-3 threads."""
    _, rel, f, w = make_case(rng, width, width)
    group = 32
    q = QuantizedWeight.from_float(mx.array(w), bits=bits, group_size=group)
    # Codes: value c is bits [c * bits, (c + 1) * bits) of a row's
    # little-endian bit stream.
    words = np.array(q.weight).astype("<u4")
    k, cout, _ = words.shape
    storage = q.storage_in_channels
    stream = np.unpackbits(words.view(np.uint8).reshape(k, cout, -1), axis=2, bitorder="little")
    stream = stream.reshape(k, cout, storage, bits).astype(np.int64)
    codes = (stream * (1 << np.arange(bits))).sum(axis=3).astype(np.float32)
    g = np.arange(storage) // group
    scales = np.array(q.scales.astype(mx.float32))[:, :, g]
    biases = np.array(q.biases.astype(mx.float32))[:, :, g]
    product = (scales * codes).astype(np.float32)
    dense = (product + biases).astype(np.float32)[:, :, :width].transpose(0, 2, 1)
    feats = mx.array(f).astype(dtype)
    want = ops.sparse_conv_features_from_relation(
        feats.astype(mx.float32), mx.array(np.ascontiguousarray(dense)), rel
    )
    want = np.array(want.astype(dtype).astype(mx.float32))

    def run():
        got = ops.sparse_quantized_conv_features_from_relation(feats, q, rel)
        assert got.dtype == dtype
        return np.array(got.astype(mx.float32))

    for threads, got in zip((1, 2, 3), for_threads(run), strict=True):
        np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}, C{width}, {threads} threads")


def fp16_input_grad_ref(g: np.ndarray, w: np.ndarray, rel, n_in: int) -> np.ndarray:
    """float16 input gradient by the same chain: per input row, offsets
    ascending, output channels ascending (the relation reversed, each
    offset's weight transposed)."""
    in_rows, out_rows, k_ids = relation_refs.edges(rel)
    return fp16_chain(g, np.transpose(w, (0, 2, 1)), out_rows, in_rows, k_ids, n_in)


@fused
@pytest.mark.parametrize("weight_dtype", [mx.float16, mx.float32])
@pytest.mark.parametrize(("cin", "cout"), [(64, 64), (19, 70), (7, 33)])
def test_input_gradient_matches_emulation_for_any_thread_count(
    rng, seed, weight_dtype, cin, cout
):
    """The float16 feature gradient (half cotangent rows widened per tile, no
    float32 copy of the cotangent) against the float32 chain rounded once,
    bit for bit, at 1/2/3 threads; a float32 weight beside float16 features
    (mixed precision) is read rounded to float16."""
    coords, rel, f, w = make_case(rng, cin, cout)
    g = rng.standard_normal((rel.n_out_capacity, cout)).astype(np.float16).astype(np.float32)
    want = fp16_input_grad_ref(g, w, rel, len(coords)).view(np.uint16)
    weight = mx.array(w).astype(weight_dtype)  # w is float16-valued: exact either way

    def run():
        _, (df,) = mx.vjp(
            lambda x: [ops.sparse_conv_features_from_relation(x, weight, rel)],
            [mx.array(f).astype(mx.float16)],
            [mx.array(g).astype(mx.float16)],
        )
        assert df.dtype == mx.float16
        return np.array(df.view(mx.uint16))

    for threads, got in zip((1, 2, 3), for_threads(run), strict=True):
        np.testing.assert_array_equal(
            got, want, err_msg=f"seed {seed}, {threads} threads, weight {weight_dtype}"
        )


# The child of test_every_isa_rounds_the_float32_result: under its ISA
# ceiling, the float16 forward and input gradient at 1/2/3 threads beside the
# float32 ones on the same (float16-valued) inputs, rounded by MLX's cast.
_ISA_CHILD = """
import sys
import mlx.core as mx
import numpy as np
import mlx_lattice
from mlx_lattice._native import ext
from mlx_lattice.core import build_kernel_relation, ops

data = np.load(sys.argv[1])
rel = build_kernel_relation(data["coords"], kernel_size=3)
w = mx.array(data["w"])
out = {"gemm": ext.gemm_isa()}
for wide in (True, False):
    dtype = mx.float32 if wide else mx.float16
    f = mx.array(data["f"]).astype(dtype)
    g = mx.array(data["g"]).astype(dtype)
    for threads in (1, 2, 3):
        mlx_lattice.set_num_threads(threads)
        y, (df,) = mx.vjp(
            lambda x: [ops.sparse_conv_features_from_relation(x, w.astype(dtype), rel)], [f], [g]
        )
        tag = ("f32" if wide else "f16") + str(threads)
        out["y" + tag] = np.array(y[0].astype(mx.float16).view(mx.uint16))
        out["df" + tag] = np.array(df.astype(mx.float16).view(mx.uint16))
np.savez(sys.argv[2], **out)
"""


@pytest.mark.parametrize("width", [1, 17, 130])
def test_every_isa_rounds_the_float32_result(rng, seed, tmp_path, isa_child, width):
    """Under every fp32 ISA ceiling this machine has (AVX-512, AVX2 + F16C,
    scalar: each its own widening, rounding and micro-kernel), the float16
    forward and input gradient (the half driver, rows widened inside each
    register block) are the float32 path's results on the same values rounded to float16,
    bit for bit, at 1/2/3 threads; the scalar path too, whose products round
    on their own (so the fused-chain emulation does not apply to it)."""
    coords, rel, f, w = make_case(rng, width, width)
    g = rng.standard_normal((rel.n_out_capacity, width)).astype(np.float16).astype(np.float32)
    case = tmp_path / "case.npz"
    np.savez(case, coords=coords, f=f, w=w, g=g)
    for isa in ext.gemm_isas():
        result = tmp_path / f"{isa}.npz"
        isa_child(_ISA_CHILD, isa, case, result)
        with np.load(result) as got:
            assert str(got["gemm"]) == isa
            for name in ("y", "df"):
                want = got[f"{name}f321"]
                for threads in (1, 2, 3):
                    msg = f"seed {seed}, C{width}, {isa}, {name}, {threads} threads"
                    np.testing.assert_array_equal(got[f"{name}f32{threads}"], want, err_msg=msg)
                    np.testing.assert_array_equal(got[f"{name}f16{threads}"], want, err_msg=msg)
