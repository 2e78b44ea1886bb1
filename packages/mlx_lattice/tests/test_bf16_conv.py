"""The bfloat16 forward convolution and its feature gradient (vdpbf16ps
where the CPU has AVX512-BF16, BFMLALT/BFMLALB where it has FEAT_BF16)
and weight gradient (vdpbf16ps) against a NumPy emulation of their
arithmetic, bit for bit, and against float64 within bf16 rounding; the
same bits for any thread count."""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice._native import ext
from mlx_lattice.core import build_kernel_relation, ops

_spec = importlib.util.spec_from_file_location("refs", Path(__file__).with_name("relation_refs.py"))
relation_refs = importlib.util.module_from_spec(_spec)  # the shared tests/relation_refs.py
_spec.loader.exec_module(relation_refs)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (finite inputs)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _pairs_ref(x: np.ndarray, w: np.ndarray, src, dst, k_ids, n_dst: int) -> np.ndarray:
    """out[dst[e]] += x[src[e]] @ w[k_ids[e]] in the documented order
    (cpu/gemm_bf16.h): offsets ascending, channel pairs ascending, odd
    channel before even; each product exact in float32, each add rounded
    once. Returns the bfloat16 bits of the result."""
    if x.shape[1] % 2:
        x = np.concatenate([x, np.zeros((len(x), 1), np.float32)], 1)
        w = np.concatenate([w, np.zeros((w.shape[0], 1, w.shape[2]), np.float32)], 1)
    pairs = [c for p in range(x.shape[1] // 2) for c in (2 * p + 1, 2 * p)]
    return bf16_bits(relation_refs.chain_ref(x, w, src, dst, k_ids, n_dst, pairs))



def bf16_conv_ref(f: np.ndarray, w: np.ndarray, rel) -> np.ndarray:
    """The forward: per output row, offsets ascending, input channel pairs."""
    in_rows, out_rows, k_ids = relation_refs.edges(rel)
    return _pairs_ref(f, w, in_rows, out_rows, k_ids, rel.n_out_capacity)


def bf16_feature_grad_ref(g: np.ndarray, w: np.ndarray, rel, n_in: int) -> np.ndarray:
    """The feature gradient, the forward's order with the roles swapped: per
    input row, offsets ascending, cotangent channel pairs (each offset's
    weight transposed)."""
    in_rows, out_rows, k_ids = relation_refs.edges(rel)
    return _pairs_ref(g, w.transpose(0, 2, 1), out_rows, in_rows, k_ids, n_in)


def exact_and_magnitude(x: np.ndarray, w: np.ndarray, src, dst, k_ids, n_dst: int):
    """float64 sum over edges of x[src] @ w[k] into dst, and of |x| @ |w|."""
    exact = np.zeros((n_dst, w.shape[2]))
    mag = np.zeros((n_dst, w.shape[2]))
    for k in range(w.shape[0]):
        sel = k_ids == k
        exact[dst[sel]] += x[src[sel]].astype(np.float64) @ w[k].astype(np.float64)
        mag[dst[sel]] += np.abs(x[src[sel]]).astype(np.float64) @ np.abs(w[k])
    return exact, mag


def feature_grad(f: np.ndarray, w: np.ndarray, g: np.ndarray, rel) -> np.ndarray:
    """The bf16 feature gradient through mx.vjp, as float32."""
    wb = mx.array(w).astype(mx.bfloat16)
    _, (df,) = mx.vjp(
        lambda x: ops.sparse_conv_features_from_relation(x, wb, rel),
        [mx.array(f).astype(mx.bfloat16)],
        [mx.array(g).astype(mx.bfloat16)],
    )
    assert df.dtype == mx.bfloat16
    return np.array(df.astype(mx.float32))


def make_case(rng, cin: int, cout: int):
    coords, rel = relation_refs.random_relation(rng, 700)
    f = bf16_values(bf16_bits(rng.standard_normal((len(coords), cin)).astype(np.float32)))
    w = bf16_values(bf16_bits(rng.standard_normal((27, cin, cout)).astype(np.float32) * 0.2))
    return rel, f, w


needs_bf16 = pytest.mark.skipif(
    ext.bf16_isa() == "float32", reason="no bf16 block here: bf16 uses the float32 path"
)
not_amx = pytest.mark.skipif(
    ext.bf16_isa() == "amx-bf16",
    reason="amx-bf16 sums in TDPBF16PS's order: amx_bf16_test checks it, the bound test below too",
)


@needs_bf16
@not_amx
@pytest.mark.parametrize(("cin", "cout"), [(64, 64), (19, 70), (32, 16), (7, 33)])
def test_matches_emulation_bit_for_bit(rng, cin, cout):
    rel, f, w = make_case(rng, cin, cout)
    out = ops.sparse_conv_features_from_relation(
        mx.array(f).astype(mx.bfloat16), mx.array(w).astype(mx.bfloat16), rel
    )
    got = np.array(out.astype(mx.float32)).view(np.uint32) >> 16
    np.testing.assert_array_equal(got.astype(np.uint16), bf16_conv_ref(f, w, rel))


@pytest.mark.parametrize(("cin", "cout"), [(64, 64), (19, 70)])
def test_within_bf16_rounding_of_float64(rng, cin, cout):
    """Every path (TDPBF16PS, vdpbf16ps or float32): |out - exact| <= one bf16 rounding
    of the result (2^-8 relative) plus float32 accumulation error bounded by
    n * eps * sum|terms| (n = K * Cin terms)."""
    rel, f, w = make_case(rng, cin, cout)
    out = ops.sparse_conv_features_from_relation(
        mx.array(f).astype(mx.bfloat16), mx.array(w).astype(mx.bfloat16), rel
    )
    got = np.array(out.astype(mx.float32)).astype(np.float64)
    in_rows, out_rows, k_ids = relation_refs.edges(rel)
    exact, mag = exact_and_magnitude(f, w, in_rows, out_rows, k_ids, len(got))
    n = 27 * cin
    bound = 2.0**-8 * np.abs(exact) + (1 + 2.0**-8) * n * np.finfo(np.float32).eps * mag
    assert np.all(np.abs(got - exact) <= bound)


@needs_bf16
@not_amx
@pytest.mark.parametrize(("cin", "cout"), [(64, 64), (19, 70), (32, 16), (7, 33)])
def test_feature_gradient_matches_emulation_bit_for_bit(rng, cin, cout):
    """The bf16 feature gradient runs on the bf16 block (not widened to
    float32): the emulation of its order, bit for bit."""
    rel, f, w = make_case(rng, cin, cout)
    g = bf16_values(bf16_bits(rng.standard_normal((len(f), cout)).astype(np.float32)))
    got = feature_grad(f, w, g, rel).view(np.uint32) >> 16
    np.testing.assert_array_equal(got.astype(np.uint16), bf16_feature_grad_ref(g, w, rel, len(f)))


@pytest.mark.parametrize(("cin", "cout"), [(64, 64), (19, 70)])
def test_feature_gradient_within_bf16_rounding_of_float64(rng, cin, cout):
    """Every path: |dF - exact| <= one bf16 rounding plus the float32
    accumulation bound (n = K * Cout terms)."""
    rel, f, w = make_case(rng, cin, cout)
    g = bf16_values(bf16_bits(rng.standard_normal((len(f), cout)).astype(np.float32)))
    got = feature_grad(f, w, g, rel).astype(np.float64)
    in_rows, out_rows, k_ids = relation_refs.edges(rel)
    wt = w.transpose(0, 2, 1)
    exact, mag = exact_and_magnitude(g, wt, out_rows, in_rows, k_ids, len(got))
    n = 27 * cout
    bound = 2.0**-8 * np.abs(exact) + (1 + 2.0**-8) * n * np.finfo(np.float32).eps * mag
    assert np.all(np.abs(got - exact) <= bound)


def bf16_weight_grad_ref(f: np.ndarray, g: np.ndarray, rel) -> np.ndarray:
    """dW (K, cin, cout) float32 in the avx512-bf16 driver's order
    (cpu/gemm_bf16.h): per offset, its edges in kernel-CSR order, in pairs,
    the odd edge's product added before the even's; each product exact in
    float32, each add rounded once."""
    in_rows, out_rows, _ = relation_refs.edges(rel)
    offsets = np.array(rel.kernel_csr.row_offsets)
    ids = np.array(rel.kernel_csr.edge_ids)
    dw = np.zeros((len(offsets) - 1, f.shape[1], g.shape[1]), np.float32)
    for k in range(len(offsets) - 1):
        edges = ids[offsets[k] : offsets[k + 1]]
        acc = np.zeros(dw.shape[1:], np.float32)
        for q in range(0, len(edges), 2):
            for e in edges[q : q + 2][::-1]:
                acc = acc + np.outer(f[in_rows[e]], g[out_rows[e]])
        dw[k] = acc
    return dw


@pytest.mark.skipif(
    ext.bf16_isa() != "avx512-bf16",
    reason="the avx512-bf16 weight-gradient driver's order (amx-bf16: amx_bf16_test; "
    "elsewhere bf16 dW is the float32 path's, test_weight_grad_paths.py)",
)
@pytest.mark.parametrize(("cin", "cout"), [(64, 64), (19, 70), (7, 33), (130, 5)])
def test_weight_gradient_matches_emulation_bit_for_bit(rng, cin, cout):
    """bf16 features and cotangents: dW on vdpbf16ps, float32 beside a
    float32 weight, rounded once to bf16 beside a bf16 weight."""
    rel, f, w = make_case(rng, cin, cout)
    g = bf16_values(bf16_bits(rng.standard_normal((len(f), cout)).astype(np.float32)))
    want = bf16_weight_grad_ref(f, g, rel)
    fb, gb = mx.array(f).astype(mx.bfloat16), mx.array(g).astype(mx.bfloat16)
    for weight in (mx.array(w), mx.array(w).astype(mx.bfloat16)):
        _, (dw,) = mx.vjp(
            lambda x, fb=fb: ops.sparse_conv_features_from_relation(fb, x, rel), [weight], [gb]
        )
        if weight.dtype == mx.float32:
            np.testing.assert_array_equal(np.array(dw).view(np.uint32), want.view(np.uint32))
        else:
            got = np.array(dw.astype(mx.float32)).view(np.uint32) >> 16
            np.testing.assert_array_equal(got.astype(np.uint16), bf16_bits(want))


@needs_bf16
def test_same_bits_for_any_thread_count(rng):
    """The forward and the feature gradient."""
    rel, f, w = make_case(rng, 40, 24)
    g = bf16_values(bf16_bits(rng.standard_normal((len(f), 24)).astype(np.float32)))
    fb, wb = mx.array(f).astype(mx.bfloat16), mx.array(w).astype(mx.bfloat16)
    before = mlx_lattice.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            mlx_lattice.set_num_threads(threads)
            out = ops.sparse_conv_features_from_relation(fb, wb, rel)
            results.append((np.array(out.astype(mx.float32)), feature_grad(f, w, g, rel)))
    finally:
        mlx_lattice.set_num_threads(before)
    for r in results[1:]:
        for a, b in zip(r, results[0], strict=True):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_float32_fallback_agrees_within_one_bf16_rounding(rng, conv_per_isa):
    """With the ISA capped below the bf16 block (MLX_LATTICE_GEMM_ISA) bf16
    runs through float32; both paths agree within one bf16 step of the
    result plus the float32 accumulation bound (they add in different
    orders)."""
    pts = rng.integers(0, 9, (700, 3))
    coords = np.unique(np.concatenate([rng.integers(0, 2, (700, 1)), pts], 1), axis=0)
    coords = coords.astype(np.int32)
    f = bf16_values(bf16_bits(rng.standard_normal((len(coords), 48)).astype(np.float32)))
    w = bf16_values(bf16_bits(rng.standard_normal((27, 48, 40)).astype(np.float32) * 0.2))
    # The bf16 block of this architecture and a level below it.
    aarch64 = platform.machine() in ("aarch64", "arm64")
    fast, capped = ("neon-bf16", "neon-i8mm") if aarch64 else ("avx512-bf16", "avx512f")
    results = conv_per_isa(coords, f, w, "bfloat16", (fast, capped))
    assert results[capped]["bf16"] == "float32"
    if results[fast]["bf16"] == "float32":
        # Both ran float32 (no such block here, or an Intel CPU, where
        # avx512-bf16 is skipped): nothing to compare.
        pytest.skip(f"no {fast} bf16 block runs on this host")
    a = bf16_values(results[fast]["out"]).astype(np.float64)
    b = bf16_values(results[capped]["out"]).astype(np.float64)
    rel = build_kernel_relation(coords, kernel_size=3)
    in_rows, out_rows, k_ids = relation_refs.edges(rel)
    _, mag = exact_and_magnitude(f, w, in_rows, out_rows, k_ids, len(a))
    bound = 2.0**-7 * np.maximum(np.abs(a), np.abs(b)) + 2 * 27 * 48 * 2.0**-23 * mag
    assert np.all(np.abs(a - b) <= bound)
    # Which path each process ran is checked by name, not by a != b: the two
    # orders differ in float32's last bits, which seldom cross a bf16
    # rounding boundary, so for some seeds (1330351057) every output agrees.
    assert results[fast]["bf16"] == fast
