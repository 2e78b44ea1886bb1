"""Weight-only quantized matmul as a Pallas TPU kernel, and its plain-JAX twin.

``weight_only_matmul(x, qvalue, scale)`` computes ``x @ dequantize(w)`` for a
weight ``w[K, N]`` that Qwix quantized for the right-hand side of
``x[M, K] @ w[K, N]`` (``dot_general.get_how_to_quantize(for_lhs=False,
tile_size=t, calibration_method='absmax')`` then ``qarray.quantize``). Qwix
0.1.8 stores, for such a weight:

* ``qvalue``: ``[K, N]`` in the qtype (int8, ``jnp.int4`` or fp8);
* ``scale``: ``[K // t, N]`` in the weight's float dtype, one scale per output
  column and K tile of ``t`` rows (rows ``g*t .. g*t+t-1`` use ``scale[g]``);
  channelwise (``t=None``) is the same with one tile, ``[1, N]``. There is no
  zero point (absmax is symmetric).

The kernel streams the quantized blocks from HBM, converts them in VMEM to the
activation dtype (exact for int8, int4 and both fp8 formats in bfloat16),
multiplies on the MXU accumulating in float32, and applies the scale per
output column once per K tile (tiled) or once at the end (channelwise); the
scales are never broadcast to ``[K, N]``. ``jnp.int4`` blocks are loaded as
they are: Mosaic (JAX 0.10.2, TPU v4 and later) loads sub-byte blocks and
converts them, so no nibble packing is needed; the conversion goes through
int8.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from taktiny_ops import _pallas_blocks as B
from taktiny_ops._common import TaktinyOpsError

DTypeLike = jax.typing.DTypeLike

__all__ = ["check_weight", "reference_weight_only_matmul", "weight_only_matmul"]

_QTYPES = tuple(jnp.dtype(d) for d in B.WEIGHT_ONLY_QTYPES)
_CHUNK = 512  # rows of a weight block converted at a time (bounds the temporary)


def _check_float(name: str, a: jax.Array, ndim: int) -> None:
    if a.ndim != ndim:
        raise TaktinyOpsError(f"{name} must have {ndim} dimensions, got shape {a.shape}")
    if a.dtype not in B.FLOATS:
        raise TaktinyOpsError(f"{name} must be float32 or bfloat16, got {a.dtype}")


def _out_dtype(out_dtype: DTypeLike | None, x: jax.Array) -> jnp.dtype:
    if out_dtype is None:
        return x.dtype
    try:
        dt = jnp.dtype(out_dtype)
    except TypeError as e:
        raise TaktinyOpsError(f"out_dtype must be a float dtype, got {out_dtype!r}") from e
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TaktinyOpsError(f"out_dtype must be float32, bfloat16 or float16, got {dt}")
    return dt


def check_weight(x: jax.Array, qvalue: jax.Array, scale: jax.Array,
                 qtypes: tuple[jnp.dtype, ...]) -> int:
    """Validates ``x[M, K]``, ``qvalue[K, N]`` (one of ``qtypes``) and
    ``scale[K // t, N]``; returns the scale's K tile size ``t``.

    A bad operand raises a TaktinyOpsError whose message opens with its name.

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((2, 512), jnp.bfloat16)
    >>> q = jnp.ones((512, 128), jnp.int8)
    >>> check_weight(x, q, jnp.ones((2, 128), jnp.float32), (jnp.dtype(jnp.int8),))
    256
    >>> try:  # 3 scale rows do not divide K=512
    ...     check_weight(x, q, jnp.ones((3, 128), jnp.float32), (jnp.dtype(jnp.int8),))
    ... except TaktinyOpsError as e:
    ...     print(str(e)[:26])
    scale must be [K // t, N]
    """
    _check_float("x", x, 2)
    if qvalue.ndim != 2:
        raise TaktinyOpsError(f"qvalue must be [K, N], got shape {qvalue.shape}")
    if qvalue.dtype not in qtypes:
        names = ", ".join(d.name for d in qtypes)
        raise TaktinyOpsError(f"qvalue must be one of {names}, got {qvalue.dtype}")
    (m, k), (kq, n) = x.shape, qvalue.shape
    if kq != k:
        raise TaktinyOpsError(f"qvalue has {kq} rows but x has K={k} columns")
    if m == 0 or k == 0 or n == 0:
        raise TaktinyOpsError(f"x and qvalue must not be empty: x {x.shape}, qvalue {qvalue.shape}")
    _check_float("scale", scale, 2)
    groups, ns = scale.shape
    if ns != n or groups == 0 or k % groups:
        raise TaktinyOpsError(
            f"scale must be [K // t, N] = [G, {n}] with G dividing K={k} (Qwix's layout"
            f" for a weight quantized along K in tiles of t), got shape {scale.shape}")
    t = k // groups
    if groups > 1 and t % B.LANE:
        raise TaktinyOpsError(
            f"scale: the K tile size {t} (K={k} / {groups} scale rows) must be a multiple"
            f" of {B.LANE} for the TPU kernel")
    return t


def _mxu(w: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The weight block as MXU operands (exact: every qtype value fits bf16)."""
    if w.dtype == jnp.dtype(jnp.int4):
        w = w.astype(jnp.int8)
    return w.astype(dtype)


def _kernel(x_ref: Any, w_ref: Any, s_ref: Any, o_ref: Any, acc_ref: Any, *, nk: int,
            chunk: int, tiles_per_block: int, tiled: bool,
            precision: jax.lax.Precision | None) -> None:
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    bk = w_ref.shape[0]
    for c in range(bk // chunk):  # static: each chunk is one K tile when tiled
        rows = pl.ds(c * chunk, chunk)
        part = jnp.dot(x_ref[:, rows], _mxu(w_ref[rows, :], x_ref.dtype),
                       preferred_element_type=jnp.float32, precision=precision)
        if tiled:
            part = part * s_ref[pl.ds(k * tiles_per_block + c, 1), :]
        acc_ref[...] += part  # accumulate in VMEM, chunk by chunk

    @pl.when(k == nk - 1)
    def _():
        out = acc_ref[...]
        if not tiled:
            out = out * s_ref[...]
        o_ref[...] = out.astype(o_ref.dtype)


def weight_only_matmul(x: jax.Array, qvalue: jax.Array, scale: jax.Array, *,
                       out_dtype: DTypeLike | None = None, block_m: int | None = None,
                       block_n: int | None = None, block_k: int | None = None,
                       interpret: bool | None = None) -> jax.Array:
    """``x @ (qvalue * scale)`` with the weight kept quantized in HBM.

    Args:
      x: ``[M, K]`` bfloat16 or float32 activations.
      qvalue: ``[K, N]`` int8, ``jnp.int4``, float8_e4m3fn or float8_e5m2.
      scale: ``[K // t, N]`` (``[1, N]`` channelwise), Qwix's layout; the K
        tile ``t`` must be a multiple of 128 when there is more than one tile.
      out_dtype: the result dtype; ``x.dtype`` by default.
      block_m, block_n, block_k: the kernel's blocks; by default from the
        per-generation table in ``_pallas_blocks``. ``block_k`` must be a
        multiple of ``t`` (tiled) or of 128.
      interpret: run the kernel in Pallas interpret mode; ``None`` means
        interpret unless the default backend is a TPU.

    The MXU multiplies in ``x.dtype`` (float32 at the highest precision) and
    accumulates in float32. Shapes that the blocks do not divide are padded
    with zeros (a copy of the weight per call for K or N not a multiple of
    128).

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((2, 256), jnp.bfloat16)
    >>> q = jnp.ones((256, 128), jnp.int8)
    >>> s = jnp.full((1, 128), 0.5, jnp.bfloat16)
    >>> y = weight_only_matmul(x, q, s)  # interpreted unless on a TPU
    >>> y.shape, y.dtype, float(y[0, 0])
    ((2, 128), dtype(bfloat16), 128.0)
    """
    t = check_weight(x, qvalue, scale, _QTYPES)
    out_dt = _out_dtype(out_dtype, x)
    (m, k), n = x.shape, qvalue.shape[1]
    tiled = scale.shape[0] > 1
    f32 = x.dtype == jnp.dtype(jnp.float32)
    p = B.plan("weight_only", m, n, k, block_m=block_m, block_n=block_n,
               block_k=block_k, m_step=8 if f32 else 16, k_step=t if tiled else B.LANE)
    chunk = t if tiled else B._largest_dividing(p.bk, _CHUNK, B.LANE)
    x = jnp.pad(x, ((0, p.m_pad - m), (0, p.k_pad - k)))
    qvalue = jnp.pad(qvalue, ((0, p.k_pad - k), (0, p.n_pad - n)))
    g_pad = p.k_pad // t - scale.shape[0] if tiled else 0
    scale = jnp.pad(scale.astype(jnp.float32), ((0, g_pad), (0, p.n_pad - n)))
    grid = (p.m_pad // p.bm, p.n_pad // p.bn, p.k_pad // p.bk)
    if tiled:  # every tile's scale row of this column block stays in VMEM
        s_spec = pl.BlockSpec((scale.shape[0], p.bn), lambda i, j, kk: (0, j))
    else:
        s_spec = pl.BlockSpec((1, p.bn), lambda i, j, kk: (0, j))
    xb, wb = jnp.dtype(x.dtype).itemsize, jnp.dtype(qvalue.dtype).itemsize
    nbytes = (2 * (p.bm * p.bk * xb + p.bk * p.bn * wb + p.bm * p.bn * out_dt.itemsize
                   + scale.shape[0] * p.bn * 4)
              + 2 * p.bm * p.bn * 4 + chunk * p.bn * (xb + 4))
    kern = functools.partial(
        _kernel, nk=grid[2], chunk=chunk, tiles_per_block=p.bk // t, tiled=tiled,
        # Explicit both ways: under jax.default_matmul_precision('highest') an
        # unset precision asks Mosaic for float32 contraction of bf16 operands,
        # which it rejects ("Bad lhs type").
        precision=jax.lax.Precision.HIGHEST if f32 else jax.lax.Precision.DEFAULT)
    out = pl.pallas_call(
        kern,
        grid=grid,
        in_specs=[pl.BlockSpec((p.bm, p.bk), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((p.bk, p.bn), lambda i, j, kk: (kk, j)),
                  s_spec],
        out_specs=pl.BlockSpec((p.bm, p.bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((p.m_pad, p.n_pad), out_dt),
        scratch_shapes=[pltpu.VMEM((p.bm, p.bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=B.vmem_limit(nbytes)),
        interpret=B.use_interpret(interpret),
        name="taktiny_weight_only_matmul",
    )(x, qvalue, scale)
    return out[:m, :n]


def reference_weight_only_matmul(x: jax.Array, qvalue: jax.Array, scale: jax.Array, *,
                                 out_dtype: DTypeLike | None = None) -> jax.Array:
    """Plain JAX with the contract of :func:`weight_only_matmul`.

    Products of ``x`` and the converted weight in float32 at the highest
    precision, one float32 partial per K tile times its scale row, summed.

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((2, 256), jnp.bfloat16)
    >>> q = jnp.ones((256, 128), jnp.int8)
    >>> s = jnp.full((2, 128), 0.5, jnp.float32)
    >>> float(reference_weight_only_matmul(x, q, s)[0, 0])
    128.0
    """
    t = check_weight(x, qvalue, scale, _QTYPES)
    out_dt = _out_dtype(out_dtype, x)
    (m, k), n = x.shape, qvalue.shape[1]
    g = k // t
    xs = x.astype(jnp.float32).reshape(m, g, t)
    ws = _mxu(qvalue, jnp.dtype(jnp.float32)).reshape(g, t, n)
    parts = jnp.einsum("mgt,gtn->gmn", xs, ws, precision=jax.lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32)
    out = jnp.sum(parts * scale.astype(jnp.float32)[:, None, :], axis=0)
    return out.astype(out_dt)
