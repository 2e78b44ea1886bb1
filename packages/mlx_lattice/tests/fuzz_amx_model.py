"""Fuzz targets of the AMX drivers on the portable tile model (Hypothesis).

The test-only ``harness_ext`` runs ``csrc/cpu/amx_int8.h``,
``amx_bf16.h`` and ``amx_bf16_wgrad.h`` with the tile model of
``amx_tile_model.h`` on any host, so random relations (dense and sparse
grids; cubic kernels of 1 to 5 and non-cubic ones; strides 1 to 3 and
their transposes) and tile-edge channel
counts reach the same batching, in-place loads, gathers, epilogues and
slab transposes that run on AMX hardware. References: the NumPy model of
the integer math (``int8_refs.py``) and the integer path the dispatch
chose here capped below AMX (on an AMX host the uncapped dispatch would run
this very driver), bit for bit (the documented math is the same bits on
every ISA), and float64 sums of the bf16 products within the bounds the
headers state. Run in a child process by ``test_fuzz_amx_model.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
from fuzzing import fuzz
from hypothesis import strategies as st

import mlx_lattice
from mlx_lattice._native import ext
from mlx_lattice.core import QuantizedWeight, ops


def _load(name: str, filename: str):
    """The module ``name`` from ``filename`` beside this file."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


harness_ext = _load("harness_ext", "harness_ext.so")
int8_refs = _load("int8_refs", "int8_refs.py")
relation_refs = _load("relation_refs", "relation_refs.py")
EMPTY = mx.zeros((0,), dtype=mx.int32)


def _csr(csr) -> tuple[mx.array, mx.array]:
    return csr.row_offsets, EMPTY if csr.edge_ids is None else csr.edge_ids


def _bf16(a: np.ndarray) -> mx.array:
    return mx.array(a.astype(np.float32)).astype(mx.bfloat16)


def _exact(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def _set_l2(n_bytes: int | None) -> None:
    """The L2 size the kernels size their tiles and windows from, in the
    product and in the harness (each extension holds its own copy)."""
    mlx_lattice.set_kernel_l2_bytes(n_bytes)
    harness_ext.set_l2_cache_bytes(n_bytes)


grids = {
    "n_points": st.integers(0, 300),
    "side": st.sampled_from([4, 6, 8, 12]),
    "kernel_size": st.sampled_from([1, 2, 3, 3, 4, 5, (3, 3, 1), (1, 1, 7)]),
    "stride": st.sampled_from([1, 1, 1, 2, 3]),
    "transposed": st.booleans(),
}
channel_counts = st.sampled_from([1, 3, 4, 15, 16, 17, 31, 32, 33, 48, 64, 65, 70])


@fuzz(
    60,
    **grids,
    cin=channel_counts,
    cout=channel_counts,
    bits=st.sampled_from([4, 8]),
    group=st.sampled_from([32, 64]),
    static=st.booleans(),
    nan_row=st.booleans(),
    streamed=st.booleans(),
    data_seed=st.integers(0, 2**32 - 1),
)
def test_amx_int8_model_matches_dispatch(n_points, side, kernel_size, stride, transposed, cin,
                                         cout, bits, group, static, nan_row, streamed,
                                         data_seed):
    """w8a8 / w4a8 through the AMX-INT8 driver on the tile model, with the
    portable and the AVX-512 epilogue, gives the bits of the NumPy model and
    of the integer path the dispatch chose (capped at ``avx512-vnni`` on an
    AMX host), dynamic and static activation scales, a non-finite input row
    included. The reference sums its output in place (no L2 size known);
    with ``streamed`` the model and the dispatch run again under a
    1 KiB L2, where outputs of at least 4 KiB (2 threads) in rows of at
    most 64 channels are summed in per-thread windows and copied out
    (cpu/output_window.h), and give the same bits."""
    rel = relation_refs.grid_relation(n_points, side, kernel_size, stride, transposed, data_seed)
    rng = np.random.default_rng(data_seed)
    n_in = int(rel.n_in)
    feats = rng.standard_normal((n_in, cin)).astype(np.float32)
    if nan_row and n_in:
        feats[n_in // 2, 0] = np.nan
    weight = 0.2 * rng.standard_normal((int(rel.n_kernels), cin, cout)).astype(np.float32)
    qw = QuantizedWeight.from_float(mx.array(weight), bits=bits, group_size=group)
    scale = 0.05 if static else None

    amx_host = ext.int8_isa() == "amx-int8"

    def dispatch() -> mx.array:
        # Capped below AMX on an AMX host: the int8 family follows a cap at once.
        if amx_host:
            mlx_lattice.set_kernel_isa("avx512-vnni")
        try:
            out = ops.sparse_quantized_conv_features_from_relation(
                mx.array(feats), qw, rel, act_bits=8, act_scale=scale
            )
            mx.eval(out)
        finally:
            if amx_host:
                mlx_lattice.set_kernel_isa(None)
        return out

    offsets, edge_ids = _csr(rel.output_csr)
    scales, biases = qw.scales.astype(mx.float32), qw.biases.astype(mx.float32)
    mx.eval(scales, biases)
    epilogues = ["scalar"] + (["avx512"] if harness_ext.amx_model_avx512() else [])
    _set_l2(0)
    try:
        # The reference stays alive, so the streamed call's output cannot
        # reuse its buffer (and find its bits already there).
        reference = dispatch()
        want = np.array(reference).view(np.uint32)
        static_scale = None if scale is None else np.float32(scale)
        model = int8_refs.int8_conv_ref(feats, qw, rel, static_scale)
        # The same values, NaN where the reference has NaN (a non-finite row).
        np.testing.assert_array_equal(np.array(reference), model)
        if streamed:
            _set_l2(1024)
            again = np.array(dispatch()).view(np.uint32)
            assert np.array_equal(again, want), "streamed"
        for epilogue in epilogues:
            got = harness_ext.amx_model_int8_conv(
                mx.array(feats), qw.weight, scales, biases, offsets, edge_ids,
                rel.edges.in_rows, rel.edges.kernel_ids, qw.storage_in_channels, group, bits,
                scale or 0.0, epilogue,
            )
            assert np.array_equal(np.array(got).view(np.uint32), want), epilogue
    finally:
        _set_l2(None)


def _bf16_bound(exact: np.ndarray, mag: np.ndarray, n_terms: int) -> np.ndarray:
    """cpu/amx_bf16.h's bound: 2^-8 |S| + (1 + 2^-8) n u sum|products|,
    plus flushed subnormals (x 1.01: n u is the first-order term of
    (1 + u)^n - 1)."""
    return 2.0**-8 * np.abs(exact) + (1 + 2.0**-8) * 1.01 * n_terms * 2.0**-24 * mag + 2.0**-120


@fuzz(
    60,
    **grids,
    cin=channel_counts,
    cout=channel_counts,
    data_seed=st.integers(0, 2**32 - 1),
)
def test_amx_bf16_model_within_bound(n_points, side, kernel_size, stride, transposed, cin, cout,
                                     data_seed):
    """The bf16 forward and feature gradient through the AMX-BF16 driver on
    the tile model stay within the header's bound of float64 sums of the
    bf16 inputs' products."""
    rel = relation_refs.grid_relation(n_points, side, kernel_size, stride, transposed, data_seed)
    rng = np.random.default_rng(data_seed)
    n_in, n_out, k = int(rel.n_in), int(rel.n_out_capacity or 0), int(rel.n_kernels)
    f = _bf16(rng.standard_normal((n_in, cin)))
    g = _bf16(rng.standard_normal((n_out, cout)))
    w = _bf16(0.2 * rng.standard_normal((k, cin, cout)))
    fe, ge, we = _exact(f), _exact(g), _exact(w)
    in_rows = np.array(rel.edges.in_rows)
    out_rows = np.array(rel.edges.out_rows)
    kid = np.array(rel.edges.kernel_ids)
    for transpose in (False, True):
        rows, cols, src, a_index = (
            (n_out, cout, fe, in_rows) if not transpose else (n_in, cin, ge, out_rows)
        )
        groups = out_rows if not transpose else in_rows
        exact = np.zeros((rows, cols))
        mag = np.zeros((rows, cols))
        for e in range(len(kid)):
            wk = we[kid[e]] if not transpose else we[kid[e]].T
            exact[groups[e]] += src[a_index[e]] @ wk
            mag[groups[e]] += np.abs(src[a_index[e]]) @ np.abs(wk)
        rc = cin if not transpose else cout
        pairs = -(-((rc + 1) // 2) // 16) * 16  # bf16 pairs per row, whole chunks of 16
        offsets, edge_ids = _csr(rel.output_csr if not transpose else rel.input_csr)
        got = harness_ext.amx_model_bf16_conv(
            f if not transpose else g, w, offsets, edge_ids,
            rel.edges.in_rows if not transpose else rel.edges.out_rows,
            rel.edges.kernel_ids, transpose,
        )
        got = np.array(mx.view(got, mx.bfloat16).astype(mx.float32)).astype(np.float64)
        assert got.shape == (rows, cols)
        assert (np.abs(got - exact) <= _bf16_bound(exact, mag, k * 2 * pairs)).all(), transpose


@fuzz(
    40,
    **grids,
    cin=channel_counts,
    cout=channel_counts,
    data_seed=st.integers(0, 2**32 - 1),
)
def test_amx_bf16_wgrad_model_within_bound(n_points, side, kernel_size, stride, transposed, cin,
                                          cout, data_seed):
    """The bf16 weight gradient through the AMX-BF16 driver on the tile
    model: the portable and the AVX-512 slab gather give the same bits,
    within n u sum|products| of the float64 sum over each offset's n edges."""
    rel = relation_refs.grid_relation(n_points, side, kernel_size, stride, transposed, data_seed)
    rng = np.random.default_rng(data_seed)
    n_in, n_out, k = int(rel.n_in), int(rel.n_out_capacity or 0), int(rel.n_kernels)
    f = _bf16(rng.standard_normal((n_in, cin)))
    g = _bf16(rng.standard_normal((n_out, cout)))
    fe, ge = _exact(f), _exact(g)
    offsets, edge_ids = _csr(rel.kernel_csr)
    gathers = ["scalar"] + (["avx512"] if harness_ext.amx_model_avx512() else [])
    results = [
        np.array(harness_ext.amx_model_bf16_wgrad(
            f, g, offsets, edge_ids, rel.edges.in_rows, rel.edges.out_rows, gather))
        for gather in gathers
    ]
    for other in results[1:]:
        assert np.array_equal(other.view(np.uint32), results[0].view(np.uint32))
    in_rows = np.array(rel.edges.in_rows)
    out_rows = np.array(rel.edges.out_rows)
    kid = np.array(rel.edges.kernel_ids)
    exact = np.zeros((k, cin, cout))
    mag = np.zeros((k, cin, cout))
    count = np.zeros(k, np.int64)
    for e in range(len(kid)):
        exact[kid[e]] += np.outer(fe[in_rows[e]], ge[out_rows[e]])
        mag[kid[e]] += np.outer(np.abs(fe[in_rows[e]]), np.abs(ge[out_rows[e]]))
        count[kid[e]] += 1
    bound = 1.01 * count[:, None, None] * 2.0**-24 * mag + 2.0**-120 * count[:, None, None]
    assert results[0].shape == (k, cin, cout)
    assert (np.abs(results[0] - exact) <= bound).all()
