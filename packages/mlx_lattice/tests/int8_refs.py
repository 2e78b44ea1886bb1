"""NumPy references of the integer convolution (``act_bits=8``): the
documented math of ``csrc/cpu/gemm_int8.h`` (int64 dot products, the
float32 epilogue one rounding per operation, offsets and groups ascending),
bit for bit with every ISA path; and the fused epilogue of
``sparse_quantized_conv_fused`` (bias, residual, ReLU, requantization to
int8). Shared by ``test_int8_conv.py``, ``test_fused_int8_conv.py`` and the
fuzz targets."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_lattice.core import QuantizedWeight

_spec = importlib.util.spec_from_file_location("refs", Path(__file__).with_name("relation_refs.py"))
relation_refs = importlib.util.module_from_spec(_spec)  # the shared tests/relation_refs.py
_spec.loader.exec_module(relation_refs)

__all__ = [
    "codes_ref",
    "fused_epilogue_ref",
    "int8_conv_ref",
    "make_case",
    "quantize_rows_ref",
    "quantize_static_ref",
    "requantize_ref",
]


def make_case(rng, n_points: int, cin: int, cout: int, bits: int, group: int):
    """A seeded case: a 3x3x3 submanifold relation over up to n_points cells
    of two batches, (N, cin) features with a few rows of very different
    magnitude and an all-zero row, and a (27, cin, cout) weight quantized
    to ``bits`` in groups of ``group``."""
    coords, rel = relation_refs.random_relation(rng, n_points)
    feats = rng.standard_normal((len(coords), cin)).astype(np.float32)
    feats[:5] *= np.float32(40.0)
    feats[5] = 0.0
    weight = mx.array(rng.standard_normal((27, cin, cout)).astype(np.float32) * 0.2)
    qw = QuantizedWeight.from_float(weight, bits=bits, group_size=group)
    return rel, feats, qw


def codes_ref(qw: QuantizedWeight) -> np.ndarray:
    """Unsigned codes (K, Cout, storage_in) from the packed uint32 words:
    value c is bits [c * bits, (c + 1) * bits) of the row's little-endian
    bit stream."""
    words = np.array(qw.weight).astype("<u4")
    k, cout, _ = words.shape
    bits = np.unpackbits(words.view(np.uint8).reshape(k, cout, -1), axis=2, bitorder="little")
    bits = bits.reshape(k, cout, qw.storage_in_channels, qw.bits).astype(np.int64)
    return (bits * (1 << np.arange(qw.bits))).sum(axis=3)


def quantize_rows_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row int8: scale max|row| / 127 (float32), q = rint(x / s);
    a row with a non-finite value: scale NaN and q = 0 (cpu/gemm_int8.h)."""
    x = x.astype(np.float32)
    finite = np.isfinite(x).all(axis=1)
    with np.errstate(invalid="ignore"):
        scale = (np.abs(x).max(axis=1) / np.float32(127)).astype(np.float32)
        safe = np.where(finite & (scale > 0), scale, np.float32(1))
        q = np.clip(np.rint(np.where(finite[:, None], x, 0) / safe[:, None]), -127, 127)
    q = q.astype(np.int64)
    q[scale == 0] = 0
    return q, np.where(finite, scale, np.float32(np.nan)).astype(np.float32)


def quantize_static_ref(x: np.ndarray, scale: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """One static scale S: q = rint(clip(x / S, -127, 127)) (float32
    division); the per-row factor is 1 (NaN for a non-finite row)."""
    x = x.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        q = np.rint(np.clip(x / np.float32(scale), -127, 127))
    finite = np.isfinite(x).all(axis=1)
    q[~finite] = 0
    return q.astype(np.int64), np.where(finite, np.float32(1), np.float32(np.nan))


def int8_conv_ref(
    feats: np.ndarray | None, qw: QuantizedWeight, rel, static=None, codes=None
) -> np.ndarray:
    """The documented math (cpu/gemm_int8.h) in NumPy: exact int64 dot
    products, then the float32 epilogue one rounding per operation, offsets
    ascending and groups ascending inside each offset. ``static``: the
    static activation scale S, folded into the weight's scales and biases
    (float32 products) instead of multiplying every edge. ``codes``: int8
    rows already at scale ``static`` (feats unused; -128 reads as -127)."""
    if codes is not None:
        q = np.maximum(np.asarray(codes).astype(np.int64), -127)
        sa = np.ones(len(q), dtype=np.float32)
    elif static is None:
        q, sa = quantize_rows_ref(feats)
    else:
        q, sa = quantize_static_ref(feats, static)
    cin, gs = qw.in_channels, qw.group_size
    codes = codes_ref(qw)[:, :, :cin]
    scales = np.array(qw.scales.astype(mx.float32))
    biases = np.array(qw.biases.astype(mx.float32))
    if static is not None:
        scales = (scales * np.float32(static)).astype(np.float32)
        biases = (biases * np.float32(static)).astype(np.float32)
    in_rows, out_rows, kernel_ids = relation_refs.edges(rel)
    out = np.zeros((rel.n_out_capacity, qw.out_channels), dtype=np.float32)
    for k in range(qw.n_kernels):
        sel = kernel_ids == k
        i, o = in_rows[sel], out_rows[sel]
        assert len(np.unique(o)) == len(o)
        for g in range(qw.storage_in_channels // gs):
            c0, c1 = g * gs, min(cin, (g + 1) * gs)
            acc = q[i, c0:c1] @ codes[k, :, c0:c1].T
            assert np.abs(acc).max(initial=0) < 2**31
            asum = q[i, c0:c1].sum(axis=1)
            t = acc.astype(np.float32) * scales[k, :, g]
            u = asum.astype(np.float32)[:, None] * biases[k, :, g]
            t = t + u
            # Static: sa is 1 (exact, as the kernel leaving it out) or NaN.
            out[o] = out[o] + t * sa[i][:, None]
    return out


def requantize_ref(y: np.ndarray, out_scale) -> np.ndarray:
    """The fused epilogue's requantization: q = clip(rint(y / out_scale),
    -127, 127) with a float32 division and rounding half to even, NaN -> 0,
    +-inf saturating; int8."""
    y = np.asarray(y, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        v = y / np.float32(out_scale)
        q = np.rint(np.clip(v, -127, 127))
    q[np.isnan(v)] = 0
    return q.astype(np.int8)


def fused_epilogue_ref(
    acc: np.ndarray,
    bias=None,
    residual=None,
    residual_scale=None,
    relu: bool = False,
    out_scale=None,
) -> np.ndarray:
    """The fused epilogue on the convolution's float32 sums ``acc`` (N, C),
    one float32 rounding per operation in this order: + bias (C,); +
    residual (float, as float32) or + float32(int8 residual) *
    residual_scale (product rounded, then the sum); ReLU as ``y < 0 -> +0``
    (NaN stays); then ``requantize_ref`` when ``out_scale`` is given, else
    float32 ``y`` (the caller rounds to a half dtype)."""
    y = np.array(acc, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        if bias is not None:
            y = y + np.asarray(bias, dtype=np.float32)
        if residual is not None:
            r = np.asarray(residual)
            if r.dtype == np.int8:
                y = y + r.astype(np.float32) * np.float32(residual_scale)
            else:
                y = y + r.astype(np.float32)
        if relu:
            y = np.where(y < 0, np.float32(0), y).astype(np.float32)
    return y if out_scale is None else requantize_ref(y, out_scale)
