"""The Metal kernels of the fused static-int8 convolution
(``mlxl_int8_conv_fused_{float,int8}``), run on the CPU through the MSL
harness (tests/harness_ext.so), against the CPU kernels: the same bits.
The Metal kernel sums each output's edges by offset ascending (the CPU order)
and groups ascending with the CPU's float32 operations, so there is no
tolerance: int8 outputs, float32 outputs and half outputs (the float32
value rounded once) compare exactly, NaN where NaN."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_lattice._native import ext
from mlx_lattice.core import QuantizedWeight, build_kernel_relation


def _load_harness():
    path = Path(__file__).with_name("harness_ext.so")
    spec = importlib.util.spec_from_file_location("harness_ext", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


harness_ext = _load_harness()


def make_case(rng, n_points, cin, cout, bits, group):
    pts = rng.integers(0, 7, (n_points, 3))
    coords = np.unique(np.concatenate([np.zeros((n_points, 1), int), pts], 1), axis=0)
    rel = build_kernel_relation(coords.astype(np.int32), kernel_size=3)
    feats = rng.standard_normal((len(coords), cin)).astype(np.float32)
    weight = mx.array(rng.standard_normal((27, cin, cout)).astype(np.float32) * 0.2)
    return rel, feats, QuantizedWeight.from_float(weight, bits=bits, group_size=group)


# (int8 input, bias, residual, relu, out_scale, out_dtype)
EPILOGUES = [
    (False, False, None, False, 0.0, "float32"),
    (False, True, "float", True, 0.05, None),
    (True, True, "int8", True, 0.05, None),
    (True, False, "float", False, 0.0, "float16"),
    (False, True, "int8", False, 0.0, "bfloat16"),
    (True, True, None, True, 0.0, "float32"),
]


@pytest.mark.parametrize(("cin", "cout", "bits", "group"), [(32, 16, 8, 32), (40, 20, 4, 32)])
def test_metal_kernel_gives_the_cpu_bits(rng, cin, cout, bits, group):
    rel, feats, qw = make_case(rng, 120, cin, cout, bits, group)
    feats[2, 3] = np.inf  # a non-finite float row: NaN sums (0 when requantized)
    s = float(np.abs(feats[np.isfinite(feats)]).max() / 127)
    codes = mx.array(rng.integers(-128, 128, feats.shape).astype(np.int8))
    n_out = rel.n_out_capacity
    bias = mx.array(rng.standard_normal(cout).astype(np.float32))
    res_f = mx.array(rng.standard_normal((n_out, cout)).astype(np.float32))
    res_q = mx.array(rng.integers(-127, 128, (n_out, cout)).astype(np.int8))
    for int8_in, has_bias, residual, relu, out_scale, out_dtype in EPILOGUES:
        kwargs = {"in_scale": s, "relu": relu, "out_scale": out_scale, "out_dtype": out_dtype}
        if has_bias:
            kwargs["bias"] = bias
        if residual == "float":
            kwargs["residual"] = res_f
        elif residual == "int8":
            kwargs.update(residual=res_q, residual_scale=0.02)
        x = codes if int8_in else mx.array(feats)
        with mx.stream(mx.cpu):
            cpu = ext.sparse_quantized_conv_fused(x, qw, rel, **kwargs)
            mx.eval(cpu)
            before = harness_ext.harness_groups_run()
            metal = harness_ext.sparse_quantized_conv_fused(x, qw, rel, **kwargs)
            mx.eval(metal)
        assert harness_ext.harness_groups_run() > before  # the Metal kernel ran
        assert cpu.dtype == metal.dtype
        if cpu.dtype != mx.int8:
            cpu, metal = cpu.astype(mx.float32), metal.astype(mx.float32)
        np.testing.assert_array_equal(
            np.array(metal), np.array(cpu), err_msg=f"{int8_in} {residual} {relu} {out_scale}"
        )
        if not int8_in and cpu.dtype != mx.int8:
            rows = np.isnan(np.array(cpu)).any(axis=1)
            assert rows.any()  # the non-finite row reached the outputs it feeds
