"""Bad relations raise ValueError before any kernel reads memory; thread
counts never change bits."""

import dataclasses
import os
import platform
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_lattice
from mlx_lattice._native import ext
from mlx_lattice.core import build_kernel_relation, ops


@pytest.fixture
def setup(rng, ref):
    coords = ref.random_coords(rng, 120, 5)
    rel = build_kernel_relation(coords)
    f = mx.array(rng.standard_normal((len(coords), 4)).astype(np.float32))
    w = mx.array(rng.standard_normal((27, 4, 3)).astype(np.float32))
    return rel, f, w


def with_field(rel, path, value):
    """A copy of the relation with one (dotted) field replaced."""
    head, _, tail = path.partition(".")
    if not tail:
        return dataclasses.replace(rel, **{head: value})
    return dataclasses.replace(
        rel, **{head: dataclasses.replace(getattr(rel, head), **{tail: value})}
    )


def edited(a, index, value):
    n = np.array(a).copy()
    n[index] = value
    return mx.array(n)


@pytest.mark.parametrize(
    ("field", "change", "match"),
    [
        ("edges.in_rows", lambda a: edited(a, 0, 10_000), r"in_rows\[0\] = 10000 is out of range"),
        ("edges.in_rows", lambda a: edited(a, -1, -1), "in_rows.* is out of range"),
        ("edges.kernel_ids", lambda a: edited(a, 0, 27), r"kernel_ids\[0\] = 27 is out of range"),
        ("edges.out_rows", lambda a: edited(a, 0, 5_000), "out_rows.* is out of range"),
        ("edges.in_rows", lambda a: a.astype(mx.int64), "in_rows must be an int32 array"),
        ("edges.in_rows", lambda a: a[:-1], "must have one length"),
        (
            "output_csr.row_offsets",
            lambda a: edited(a, -1, 0),
            "output_row_offsets must start at 0 and end at",
        ),
        ("output_csr.row_offsets", lambda a: a[:-1], "output_row_offsets must have"),
        (
            "input_csr.edge_ids",
            lambda a: edited(a, 0, int(np.array(a)[1])),
            "input_edge_ids must be a permutation",
        ),
        (
            "kernel_csr.edge_ids",
            lambda a: edited(a, 0, 1 << 30),
            "kernel_edge_ids must be a permutation",
        ),
        (
            "input_csr.row_offsets",
            lambda a: a.reshape(1, -1),
            "input_row_offsets must have 1 dimension",
        ),
        ("n_kernels", lambda a: 26, "out of range"),
        ("n_out_capacity", lambda a: a + 5, "output_row_offsets must have"),
    ],
)
def test_bad_relation_arrays_raise(setup, field, change, match):
    rel, f, w = setup
    current = rel
    for part in field.split("."):
        current = getattr(current, part)
    bad = with_field(rel, field, change(current))
    with pytest.raises(ValueError, match=match):
        mx.eval(ext.sparse_conv_features(f, w if field != "n_kernels" else w[:26], bad))


def test_inconsistent_groupings_raise(setup):
    rel, f, w = setup
    # Edges out of output order: swap two edges of different outputs.
    out_rows = np.array(rel.edges.out_rows)
    j = int(np.nonzero(np.diff(out_rows))[0][0]) + 1
    out_rows[[0, j]] = out_rows[[j, 0]]
    with pytest.raises(ValueError, match="grouped under"):
        ext.sparse_conv_features(f, w, with_field(rel, "edges.out_rows", mx.array(out_rows)))
    # Two edges of one output through the same offset.
    kid = np.array(rel.edges.kernel_ids)
    offs = np.array(rel.output_csr.row_offsets)
    o = int(np.nonzero(np.diff(offs) >= 2)[0][0])
    kid[offs[o] + 1] = kid[offs[o]]
    with pytest.raises(ValueError, match="two edges of kernel offset"):
        ext.sparse_conv_features(f, w, with_field(rel, "edges.kernel_ids", mx.array(kid)))


def test_mismatched_features_and_weights_raise(setup):
    rel, f, w = setup
    with pytest.raises(ValueError, match=r"feats must have the relation's n_in = \d+ rows, got 10"):
        ops.sparse_conv_features_from_relation(f[:10], w, rel)
    with pytest.raises(ValueError, match=r"weight must be \(K, Cin, Cout\)"):
        ops.sparse_conv_features_from_relation(f, w[:, :3], rel)
    with pytest.raises(ValueError, match=r"weight must be \(K, Cin, Cout\) = \(27, 4, Cout\)"):
        ops.sparse_conv_features_from_relation(f, mx.zeros((3, 2, 2, 2, 4)), rel)
    with pytest.raises(ValueError, match="feats must be float32, float16 or bfloat16"):
        ops.sparse_conv_features_from_relation(f.astype(mx.int32), w, rel)
    with pytest.raises(ValueError, match=r"feats must be \(N, C\)"):
        ops.sparse_conv_features_from_relation(f[None], w, rel)


def test_bad_sorted_view_raises(rng, ref):
    coords = ref.random_coords(rng, 100, 5)
    rel = build_kernel_relation(coords)
    view = rel.require_sorted_implicit_gemm()
    f = mx.zeros((len(coords), 32), mx.float16)
    w = mx.zeros((27, 32, 32), mx.float16)

    def run(**changes):
        bad = dataclasses.replace(view, **changes)
        return ext.sparse_conv_features_sorted_implicit_gemm(f, w, rel, bad)

    perm = np.array(view.reorder_rows)
    perm[0] = perm[1]
    with pytest.raises(ValueError, match="reorder_rows must be a permutation"):
        run(reorder_rows=mx.array(perm))
    with pytest.raises(ValueError, match=r"tile_masks.* lacks kernel offset"):
        run(tile_masks=mx.zeros_like(view.tile_masks))
    with pytest.raises(ValueError, match=r"sorted_out_in_map.* is out of range"):
        run(sorted_out_in_map=edited(view.sorted_out_in_map, (0, 13), 99_999))
    swapped = np.array(view.sorted_out_in_map)
    swapped[[0, 1]] = swapped[[1, 0]]
    if not np.array_equal(swapped[0], swapped[1]):
        with pytest.raises(ValueError, match="does not match the relation's edges"):
            run(sorted_out_in_map=mx.array(swapped))


def test_relation_arrays_as_compiled_arguments_raise(setup):
    rel, f, w = setup

    def fn(x, rows):
        return ext.sparse_conv_features(x, w, with_field(rel, "edges.in_rows", rows))

    with pytest.raises(ValueError, match="index arrays must be concrete values"):
        mx.compile(fn)(f, rel.edges.in_rows)


@pytest.fixture
def restore_threads():
    previous = mlx_lattice.get_num_threads()
    yield
    mlx_lattice.set_num_threads(previous)


def test_threads_give_identical_bits(rng, ref, restore_threads):
    coords = ref.random_coords(rng, 3000, 16, batches=2)
    f = mx.array(rng.standard_normal((len(coords), 64)).astype(np.float32))
    w = mx.array(rng.standard_normal((27, 64, 96)).astype(np.float32) * 0.05)
    probe = mx.array(rng.standard_normal((len(coords), 96)).astype(np.float32))

    def run():
        rel = build_kernel_relation(coords, kernel_size=3)
        loss = lambda a, b: (ops.sparse_conv_features_from_relation(a, b, rel) * probe).sum()  # noqa: E731
        out = ops.sparse_conv_features_from_relation(f, w, rel)
        gf, gw = mx.grad(loss, argnums=(0, 1))(f, w)
        pooled = ops.sparse_pool_features_from_relation(f, rel, input_exclusive=False, mode="max")
        gp = mx.grad(
            lambda a: (
                ops.sparse_pool_features_from_relation(a, rel, input_exclusive=False, mode="avg")
                ** 2
            ).sum()
        )(f)
        den = ext.sparse_conv_normalization_denominator(w, rel)
        return [np.array(a) for a in (rel.edges.in_rows, out, gf, gw, pooled, gp, den)]

    results = {}
    for n in (1, 2, 4):
        mlx_lattice.set_num_threads(n)
        assert mlx_lattice.get_num_threads() == n
        results[n] = run()
    for n in (2, 4):
        for a, b in zip(results[1], results[n], strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="set_num_threads"):
        mlx_lattice.set_num_threads(0)
    with pytest.raises(TypeError):
        mlx_lattice.set_num_threads(2.0)


def _child(code, name, value):
    """A child Python running ``code`` with environment variable ``name`` set
    to ``value`` (None: removed), the rest of the environment as ours."""
    env = {k: v for k, v in os.environ.items() if k != name}
    if value is not None:
        env[name] = value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_default_thread_count_is_the_cpus_the_process_may_run_on():
    # A container's CPU set or taskset limits the CPUs; the default used to
    # count the machine's, oversubscribing the allowed ones.
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "import mlx_lattice; print(mlx_lattice.get_num_threads())"
    )
    out = _child(code, "MLX_LATTICE_NUM_THREADS", None)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_thread_count_environment_variable():
    code = "import mlx_lattice; print(mlx_lattice.get_num_threads())"
    out = _child(code, "MLX_LATTICE_NUM_THREADS", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"


def _import_with(name, value):
    """A child importing mlx_lattice with one variable set; prints its GEMM kernel."""
    code = "import mlx_lattice; from mlx_lattice._native import ext; print(ext.gemm_isa())"
    return _child(code, name, value)


_AARCH64 = platform.machine() in ("aarch64", "arm64")
# This architecture's levels, lowest first; the other's names are unknown
# here (they would cap nothing or everything).
_LEVELS = (
    "scalar, neon-fma, neon-dotprod, neon-fhm, neon-i8mm, neon-bf16"
    if _AARCH64
    else "scalar, avx2-fma, avx-vnni, avx512f, avx512-vnni, avx512-bf16, amx-int8, amx-bf16"
)
_OTHER_ARCH_LEVEL = "avx512f" if _AARCH64 else "neon-fma"
_ISA_MESSAGE = f"MLX_LATTICE_GEMM_ISA: unknown ISA level 'avx9'; the levels are {_LEVELS}."
_THREADS_MESSAGE = "MLX_LATTICE_NUM_THREADS: must be an integer in [1, 1024], got '0'."


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("MLX_LATTICE_GEMM_ISA", "avx9", _ISA_MESSAGE),
        ("MLX_LATTICE_GEMM_ISA", "AVX512F", "unknown ISA level 'AVX512F'"),
        ("MLX_LATTICE_GEMM_ISA", _OTHER_ARCH_LEVEL, f"unknown ISA level '{_OTHER_ARCH_LEVEL}'"),
        ("MLX_LATTICE_NUM_THREADS", "0", _THREADS_MESSAGE),
        ("MLX_LATTICE_NUM_THREADS", "two", "got 'two'"),
        ("MLX_LATTICE_NUM_THREADS", "3x", "got '3x'"),
        ("MLX_LATTICE_NUM_THREADS", "1025", "got '1025'"),
        ("MLX_LATTICE_NUM_THREADS", "99999999999999999999", "got '99999999999999999999'"),
        ("MLX_LATTICE_GEMM_SPLAT", "yes", "MLX_LATTICE_GEMM_SPLAT: must be 0 or 1, got 'yes'."),
        ("MLX_LATTICE_GEMM_SPLAT", "01", "got '01'"),
        ("MLX_LATTICE_WEIGHT_CACHE_MB", "-1", "MLX_LATTICE_WEIGHT_CACHE_MB: must be an integer"),
        ("MLX_LATTICE_WEIGHT_CACHE_MB", "+5", "MiB in [0, 2^40], got '+5'."),
        ("MLX_LATTICE_WEIGHT_CACHE_MB", "64MB", "got '64MB'"),
        ("MLX_LATTICE_WEIGHT_CACHE_MB", "99999999999999999999", "got '99999999999999999999'"),
    ],
)
def test_environment_values_the_kernels_cannot_use_raise_at_import(name, value, message):
    # Before, the kernels ignored such a value at their first call: a
    # mistyped ISA cap ran the best kernel instead, silently.
    out = _import_with(name, value)
    assert out.returncode != 0, out.stdout
    assert "mlx_lattice._errors.MlxLatticeError" in out.stderr and message in out.stderr, out.stderr


def test_another_architectures_level_is_unknown_to_set_kernel_isa():
    # Before, x86-64 took "neon-fma" (a level above all of its own: a cap of
    # nothing) and AArch64 "avx512f" (below all of its own: everything scalar).
    before = mlx_lattice.get_kernel_isa()
    with pytest.raises(mlx_lattice.MlxLatticeError) as info:
        mlx_lattice.set_kernel_isa(_OTHER_ARCH_LEVEL)
    assert str(info.value) == (
        f"set_kernel_isa: unknown ISA level '{_OTHER_ARCH_LEVEL}'; the levels are {_LEVELS}."
    )
    assert mlx_lattice.get_kernel_isa() == before


def test_the_default_cap_is_this_architectures_highest_level():
    code = "import mlx_lattice; print(mlx_lattice.get_kernel_isa())"
    out = _child(code, "MLX_LATTICE_GEMM_ISA", None)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _LEVELS.split(", ")[-1]


def test_environment_values_the_kernels_use_import():
    assert _import_with("MLX_LATTICE_GEMM_ISA", "scalar").stdout.strip() == "scalar"
    budget = "import mlx_lattice; print(mlx_lattice.weight_cache_info()['budget'])"
    for mib in ("0", "64"):
        out = _child(budget, "MLX_LATTICE_WEIGHT_CACHE_MB", mib)
        assert out.returncode == 0 and out.stdout.strip() == str(int(mib) << 20), out.stderr
    for splat in ("0", "1"):
        assert _import_with("MLX_LATTICE_GEMM_SPLAT", splat).returncode == 0
    names = ("MLX_LATTICE_GEMM_ISA", "MLX_LATTICE_NUM_THREADS", "MLX_LATTICE_GEMM_SPLAT",
             "MLX_LATTICE_WEIGHT_CACHE_MB")
    for name in names:
        out = _import_with(name, "")  # empty: as if unset
        unset = _import_with(name, None)
        assert out.returncode == 0 and unset.returncode == 0, out.stderr + unset.stderr
        assert out.stdout.strip() == unset.stdout.strip()


_ISA_SCRIPT = """
import sys
import mlx.core as mx
import numpy as np
from mlx_lattice._native import ext
from mlx_lattice.core import build_kernel_relation, ops

rng = np.random.default_rng(7)
pts = rng.integers(0, 10, (600, 3))
coords = np.unique(np.concatenate([rng.integers(0, 2, (600, 1)), pts], 1), axis=0).astype(np.int32)
rel = build_kernel_relation(coords, kernel_size=3)
f = mx.array(rng.standard_normal((len(coords), 19)).astype(np.float32))
w = mx.array(rng.standard_normal((27, 19, 70)).astype(np.float32) * 0.1)
probe = mx.array(rng.standard_normal((len(coords), 70)).astype(np.float32))
loss = lambda a, b: (ops.sparse_conv_features_from_relation(a, b, rel) * probe).sum()
gf, gw = mx.grad(loss, argnums=(0, 1))(f, w)
out = ops.sparse_conv_features_from_relation(f, w, rel)
e = rel.edges
np.savez(sys.argv[1], out=np.array(out), gf=np.array(gf), gw=np.array(gw), isa=ext.gemm_isa(),
         f=np.array(f), w=np.array(w), probe=np.array(probe), in_rows=np.array(e.in_rows),
         out_rows=np.array(e.out_rows), kernel_ids=np.array(e.kernel_ids))
"""


def _conv_and_grads_float64(r):
    """The child's forward, feature gradient and weight gradient in float64:
    per key, the exact values, their sums of |products| and the number of
    products per value."""
    f, w, probe = (r[key].astype(np.float64) for key in ("f", "w", "probe"))
    i, o, k = r["in_rows"], r["out_rows"], r["kernel_ids"]
    sums = {key: [np.zeros(r[key].shape), np.zeros(r[key].shape)] for key in ("out", "gf", "gw")}
    for slot, (ff, ww, pp) in enumerate(((f, w, probe), (np.abs(f), np.abs(w), np.abs(probe)))):
        for kk in np.unique(k):
            sel = k == kk  # one edge per output row and offset, per input row and offset
            sums["out"][slot][o[sel]] += ff[i[sel]] @ ww[kk]
            sums["gf"][slot][i[sel]] += pp[o[sel]] @ ww[kk].T
            sums["gw"][slot][kk] += ff[i[sel]].T @ pp[o[sel]]
    terms = {
        "out": w.shape[0] * w.shape[1],
        "gf": w.shape[0] * w.shape[2],
        "gw": np.bincount(k, minlength=w.shape[0])[:, None, None],
    }
    return {key: (*sums[key], terms[key]) for key in sums}


def _vector_isas():
    """The FMA micro-kernels of this build and CPU (x86: avx512f, avx2-fma;
    AArch64: neon-fma); empty where only the scalar path exists."""
    return [isa for isa in ext.gemm_isas() if isa != "scalar"]


def test_isa_list_is_ordered_and_ends_in_scalar():
    isas = ext.gemm_isas()
    assert isas[-1] == "scalar" and len(set(isas)) == len(isas)
    assert ext.gemm_isa() in isas
    known = {"x86_64": ["avx512f", "avx2-fma"], "AMD64": ["avx512f", "avx2-fma"]}
    known.update(aarch64=["neon-fma"], arm64=["neon-fma"])
    assert set(_vector_isas()) <= set(known.get(platform.machine(), []))


def test_every_micro_kernel_path(tmp_path, isa_child):
    """Each ISA path (forced by MLX_LATTICE_GEMM_ISA) computes the same
    convolution and gradients: the FMA paths give identical bits, and every
    path, scalar included, is within the float32 summation bound of NumPy's
    float64 values."""
    isas = _vector_isas()
    if not isas:
        pytest.skip(f"no FMA micro-kernel on this {platform.machine()} build/CPU; scalar only")
    results = {}
    for isa in [*isas, "scalar"]:
        path = tmp_path / f"{isa}.npz"
        isa_child(_ISA_SCRIPT, isa, path)
        results[isa] = np.load(path)
        assert str(results[isa]["isa"]) == isa
    reference = results[isas[0]]
    for isa in isas[1:]:
        for key in ("out", "gf", "gw"):
            np.testing.assert_array_equal(results[isa][key], reference[key], err_msg=isa)
    # Every path, scalar included, within the float32 summation bound of the
    # float64 values: n u sum|products| for n products in any order (u =
    # 2^-24; x 1.01: the first-order term of (1 + u)^n - 1).
    for key, (exact, mag, n) in _conv_and_grads_float64(reference).items():
        for isa, r in results.items():
            err = np.abs(r[key].astype(np.float64) - exact)
            assert (err <= 1.01 * n * 2.0**-24 * mag + 1e-30).all(), f"{isa} {key}"


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_conversions_round_trip_exactly(rng, dtype):
    """A one-channel 1x1x1 convolution by 1 returns its half-precision input
    bit for bit, special values included (the native conversions match
    MLX's); -0 becomes +0, as 0 + (-0) does."""
    n = 3000
    coords = np.stack([np.zeros(n), np.arange(n), np.zeros(n), np.zeros(n)], 1).astype(np.int32)
    rel = build_kernel_relation(coords, kernel_size=1)
    special = [0.0, np.inf, -np.inf, np.nan, 6.1e-5, 3e-7, -2e-8, 65504.0, 1e-40, -1e-39]
    values = np.concatenate([rng.standard_normal(n - len(special)) * 10, special])
    one = mx.ones((1, 1, 1), dtype=dtype)
    feats = mx.array(values.astype(np.float32).reshape(n, 1)).astype(dtype)
    out = ops.sparse_conv_features_from_relation(feats, one, rel)
    nan = np.isnan(np.array(feats.astype(mx.float32)))
    a, b = np.array(out.view(mx.uint16)), np.array(feats.view(mx.uint16))
    b = np.where(b == 0x8000, 0, b)  # -0 (also from tiny negatives) -> +0
    # vdpbf16ps and TDPBF16PS (the bf16 paths on AVX512-BF16 and AMX-BF16
    # CPUs) flush subnormal inputs and results to zero, as bf16 dot-product
    # hardware does.
    ftz = dtype == mx.bfloat16 and ext.bf16_isa() in ("avx512-bf16", "amx-bf16")
    subnormal = ((b & 0x7F80) == 0) & ((b & 0x7F) != 0)
    if ftz:
        b = np.where(subnormal, 0, b)
    np.testing.assert_array_equal(a[~nan], b[~nan])
    assert np.isnan(np.array(out.astype(mx.float32))[nan]).all()
    # float32 -> half rounding matches MLX's astype: products of two half
    # values are exact in float32 and rounded once on output.
    scale = mx.array([[[1.37]]]).astype(dtype)
    product = ops.sparse_conv_features_from_relation(feats, scale, rel)
    expected = (feats.astype(mx.float32) * scale.astype(mx.float32).reshape(1, 1)).astype(dtype)
    finite = np.isfinite(np.array(expected.astype(mx.float32)))
    want = np.array(expected.view(mx.uint16))
    want = np.where(want == 0x8000, 0, want)
    if ftz:
        want = np.where(subnormal | (((want & 0x7F80) == 0) & ((want & 0x7F) != 0)), 0, want)
    np.testing.assert_array_equal(np.array(product.view(mx.uint16))[finite], want[finite])


def test_long_kernels_release_the_gil(restore_threads):
    """Python keeps running while a long convolution evaluates."""
    import threading
    import time

    mlx_lattice.set_num_threads(1)  # leave a core for the Python thread
    rng = np.random.default_rng(0)
    coords = np.unique(rng.integers(0, 60, (60000, 4)) * [0, 1, 1, 1], axis=0).astype(np.int32)
    rel = build_kernel_relation(coords, kernel_size=3)
    f = mx.array(rng.standard_normal((len(coords), 64)).astype(np.float32))
    w = mx.array(rng.standard_normal((27, 64, 64)).astype(np.float32))
    mx.eval(f, w)
    span = {}

    def work():
        start = time.perf_counter()
        out = f
        for _ in range(4):
            out = ops.sparse_conv_features_from_relation(out, w, rel)
        mx.eval(out)
        span["eval"] = time.perf_counter() - start

    thread = threading.Thread(target=work)
    ticks = [time.perf_counter()]
    thread.start()
    while thread.is_alive():
        ticks.append(time.perf_counter())
    thread.join()
    gap = max(np.diff(ticks)) if len(ticks) > 1 else span["eval"]
    assert span["eval"] > 0.05
    assert gap < span["eval"] / 3, (gap, span["eval"])
