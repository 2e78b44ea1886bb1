"""int8 x int8 matmul with the activation quantization fused, as a Pallas TPU kernel.

``w8a8_matmul(x, qvalue, scale)``: the weight ``w[K, N]`` quantized channelwise
by Qwix 0.1.8 (``qvalue [K, N]`` int8, ``scale [1, N]``), the activation
``x[M, K]`` quantized per row (per token) inside the kernel by an absmax rule
with Qwix's bound, the row scale and the quotient kept in float32:

* ``x_scale[m] = max_k |x[m, k]| * float32(1 / 127.5)`` (Qwix's symmetric
  int8 bound is ``qmax + 0.5``; the kernel writes the multiplication by the
  rounded reciprocal, one IEEE product on every backend), replaced by 1
  below ``sqrt(finfo(float32).tiny)``;
* ``q_x = clip(round_half_even(x * x_inv), -128, 127)`` with
  ``x_inv = 1 / x_scale`` computed once per row before the kernel, so a
  quantized value does not depend on how a compiler fuses a division.
* ``acc = q_x @ qvalue`` in int32 on the MXU; the result is
  ``acc * x_scale[m] * w_scale[n]`` in float32, never rounded to bf16 first.
  K is at most ``MAX_K`` (131071), where the int32 sum cannot overflow.

This is not Qwix's arithmetic: Qwix computes the scale and divides ``x`` by it
in ``x.dtype``, so for bfloat16 activations it rounds both the scale and the
quotient to bfloat16, and its int8 levels can differ from the kernel's (for
float32 ones, where a quotient lands within an ulp of a half-integer).

The per-row absmax needs the whole row while a kernel sees one block, so a
row reduction runs before the kernel (one read of ``x``: at M=8192, K=4096 it
is 64 MiB, ~80 us on a v5e against ~2.5 ms of int8 MXU work) and hands each row
its scale and reciprocal. Finding the absmax inside the kernel instead would
force a full-K activation block at every K: ``2 * block_m * K * 2`` bytes of
double-buffered VMEM (28 MiB at block_m=512, K=14336) besides the weight
blocks. No int8 copy of ``x`` is written to HBM: each activation block is
quantized in VMEM. Where one block spans all of K (the table does so up to
K=8192) that int8 block is made once per row block and reused for every
column block; otherwise it is remade for each column block.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from taktiny_ops import _pallas_blocks as B
from taktiny_ops._common import TaktinyOpsError
from taktiny_ops._pallas_matmul import DTypeLike, _out_dtype, check_weight

__all__ = ["MAX_K", "reference_w8a8_matmul", "row_scales", "w8a8_matmul", "w8a8_parts"]

_INT8 = (jnp.dtype(jnp.int8),)
_INV_QMAX = np.float32(1 / 127.5)  # Qwix's int8 bound: iinfo(int8).max + 0.5
_CHUNK = 512  # activation columns quantized at a time (bounds the f32 temporary)
#: The longest contraction the int32 accumulator holds. Every product
#: q_x * qvalue lies in [-128 * 127, 128 * 128] (both int8 operands can be
#: -128: the clip keeps -128 and Qwix's weights reach it at -absmax), so K
#: products sum to at most 16384 * K in magnitude; 2**31 - 1 bounds it for
#: K <= (2**31 - 1) // 16384 = 131071. One more row could overflow silently.
MAX_K = (2**31 - 1) // (128 * 128)


def row_scales(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(x_scale, x_inv)``, float32 ``[M, 1]``: Qwix's absmax scale and its reciprocal.

    >>> import jax.numpy as jnp
    >>> s, inv = row_scales(jnp.array([[1.0, -255.0], [0.0, 0.0]]))
    >>> s.ravel().tolist(), inv.ravel().tolist()
    ([2.0, 1.0], [0.5, 1.0])
    """
    absmax = jnp.max(jnp.abs(x), axis=1, keepdims=True).astype(jnp.float32)
    scale = absmax * _INV_QMAX
    tiny = jnp.sqrt(jnp.finfo(jnp.float32).tiny)
    scale = jnp.where(scale < tiny, jnp.float32(1), scale)
    return scale, jnp.float32(1) / scale


def _quantize(x: jax.Array, inv: jax.Array) -> jax.Array:
    """clip(round_half_even(x * inv), -128, 127) as int8.

    Clipping to the integer bounds first gives the same values and lets
    Mosaic fuse the rounding into the float-to-int conversion.
    """
    v = jnp.clip(x.astype(jnp.float32) * inv, -128.0, 127.0)
    return jnp.round(v).astype(jnp.int8)  # jnp.round rounds half to even


def _check(x: jax.Array, qvalue: jax.Array, scale: jax.Array) -> None:
    check_weight(x, qvalue, scale, _INT8)
    if x.shape[1] > MAX_K:
        raise TaktinyOpsError(
            f"x: K={x.shape[1]} (its last axis) is longer than the w8a8 kernel's int32"
            f" accumulator holds: at most {MAX_K} = (2**31 - 1) // (128 * 128)")
    if scale.shape[0] != 1:
        raise TaktinyOpsError(
            f"scale must be channelwise [1, N] for w8a8, got shape {scale.shape}")


def _kernel(x_ref: Any, inv_ref: Any, xs_ref: Any, w_ref: Any, ws_ref: Any, *refs: Any,
            nk: int, chunk: int, cache_x: bool, parts: bool) -> None:
    if parts:
        o_ref, qx_ref, *scratch = refs
    else:
        o_ref, *scratch = refs
    xq_ref, *acc_refs = scratch
    j, k = pl.program_id(1), pl.program_id(2)

    def quantize_block():
        for c in range(x_ref.shape[1] // chunk):
            cols = pl.ds(c * chunk, chunk)
            xq_ref[:, cols] = _quantize(x_ref[:, cols], inv_ref[...])

    if cache_x:  # one K block: quantize once per row block, reuse across N
        pl.when(j == 0)(quantize_block)
    else:
        quantize_block()
    if parts:
        qx_ref[...] = xq_ref[...]
    # Precision explicit: a caller's jax.default_matmul_precision('highest')
    # would otherwise ask Mosaic for a float32 contraction of int8 operands.
    acc = jnp.dot(xq_ref[...], w_ref[...], preferred_element_type=jnp.int32,
                  precision=jax.lax.Precision.DEFAULT)

    def finish(total: jax.Array) -> None:
        if parts:
            o_ref[...] = total
        else:
            o_ref[...] = ((total.astype(jnp.float32) * xs_ref[...]) * ws_ref[...]).astype(o_ref.dtype)

    if nk == 1:
        finish(acc)
        return
    (acc_ref,) = acc_refs

    @pl.when(k == 0)
    def _():
        acc_ref[...] = acc

    @pl.when(k > 0)
    def _():
        acc_ref[...] += acc

    @pl.when(k == nk - 1)
    def _():
        finish(acc_ref[...])


def _call(x: jax.Array, qvalue: jax.Array, scale: jax.Array, *, out_dtype: DTypeLike | None,
          block_m: int | None, block_n: int | None, block_k: int | None,
          interpret: bool | None, parts: bool) -> Any:
    _check(x, qvalue, scale)
    interpret = B.use_interpret(interpret)
    if not interpret and B.tpu_generation() == "v4":
        raise TaktinyOpsError("w8a8_matmul: int8 matmuls on the MXU need a TPU v5e or later;"
                              " this is a v4 (pass interpret=True or use weight_only_matmul)")
    out_dt = jnp.dtype(jnp.int32) if parts else _out_dtype(out_dtype, x)
    (m, k), n = x.shape, qvalue.shape[1]
    p = B.plan("w8a8", m, n, k, block_m=block_m, block_n=block_n, block_k=block_k,
               m_step=32)
    x_scale, x_inv = row_scales(x)
    x = jnp.pad(x, ((0, p.m_pad - m), (0, p.k_pad - k)))
    x_scale = jnp.pad(x_scale, ((0, p.m_pad - m), (0, 0)), constant_values=1)
    x_inv = jnp.pad(x_inv, ((0, p.m_pad - m), (0, 0)), constant_values=1)
    qvalue = jnp.pad(qvalue, ((0, p.k_pad - k), (0, p.n_pad - n)))
    w_scale = jnp.pad(scale.astype(jnp.float32), ((0, 0), (0, p.n_pad - n)))
    grid = (p.m_pad // p.bm, p.n_pad // p.bn, p.k_pad // p.bk)
    cache_x = grid[2] == 1 and grid[1] > 1
    chunk = B._largest_dividing(p.bk, _CHUNK, B.LANE)
    row = pl.BlockSpec((p.bm, 1), lambda i, j, kk: (i, 0))
    in_specs = [pl.BlockSpec((p.bm, p.bk), lambda i, j, kk: (i, kk)), row, row,
                pl.BlockSpec((p.bk, p.bn), lambda i, j, kk: (kk, j)),
                pl.BlockSpec((1, p.bn), lambda i, j, kk: (0, j))]
    out_specs = [pl.BlockSpec((p.bm, p.bn), lambda i, j, kk: (i, j))]
    out_shape = [jax.ShapeDtypeStruct((p.m_pad, p.n_pad), out_dt)]
    if parts:
        out_specs.append(pl.BlockSpec((p.bm, p.bk), lambda i, j, kk: (i, kk)))
        out_shape.append(jax.ShapeDtypeStruct((p.m_pad, p.k_pad), jnp.int8))
    scratch = [pltpu.VMEM((p.bm, p.bk), jnp.int8)]
    if grid[2] > 1:
        scratch.append(pltpu.VMEM((p.bm, p.bn), jnp.int32))
    xb = jnp.dtype(x.dtype).itemsize
    nbytes = (2 * (p.bm * p.bk * xb + p.bk * p.bn + p.bm * p.bn * out_dt.itemsize
                   + p.bn * 4 + 2 * p.bm * B.LANE * 4)
              + p.bm * p.bk + 2 * p.bm * p.bn * 4 + p.bm * chunk * 4)
    kern = functools.partial(_kernel, nk=grid[2], chunk=chunk, cache_x=cache_x,
                             parts=parts)
    outs = pl.pallas_call(
        kern,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary" if cache_x else "parallel",
                                 "arbitrary"),
            vmem_limit_bytes=B.vmem_limit(nbytes)),
        interpret=interpret,
        name="taktiny_w8a8_matmul",
    )(x, x_inv, x_scale, qvalue, w_scale)
    if parts:
        return outs[1][:m, :k], x_scale[:m, 0], x_inv[:m, 0], outs[0][:m, :n]
    return outs[0][:m, :n]


def w8a8_matmul(x: jax.Array, qvalue: jax.Array, scale: jax.Array, *,
                out_dtype: DTypeLike | None = None, block_m: int | None = None,
                block_n: int | None = None, block_k: int | None = None,
                interpret: bool | None = None) -> jax.Array:
    """``x @ w`` with ``x`` quantized per row to int8 in the kernel, int32 accumulation.

    Args:
      x: ``[M, K]`` bfloat16 or float32 activations.
      qvalue: ``[K, N]`` int8, Qwix's channelwise quantized weight.
      scale: ``[1, N]`` float, its scale.
      out_dtype: the result dtype; ``x.dtype`` by default.
      block_m, block_n, block_k: the kernel's blocks (multiples of 32, 128,
        128); by default from the per-generation table in ``_pallas_blocks``.
      interpret: Pallas interpret mode; ``None`` means interpret unless the
        default backend is a TPU.

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((2, 256), jnp.bfloat16)
    >>> q = jnp.ones((256, 128), jnp.int8)
    >>> s = jnp.full((1, 128), 0.5, jnp.float32)
    >>> y = w8a8_matmul(x, q, s, out_dtype=jnp.float32)  # interpreted unless on a TPU
    >>> round(float(y[0, 0]), 3)  # q_x = 127, x_scale = 1/127.5: 256 * 127 / 127.5 * 0.5
    127.498
    """
    return _call(x, qvalue, scale, out_dtype=out_dtype, block_m=block_m,
                 block_n=block_n, block_k=block_k, interpret=interpret, parts=False)


def w8a8_parts(x: jax.Array, qvalue: jax.Array, scale: jax.Array, *,
               block_m: int | None = None, block_n: int | None = None,
               block_k: int | None = None,
               interpret: bool | None = None) -> tuple[jax.Array, ...]:
    """The kernel's parts: ``(q_x, x_scale, x_inv, acc)``.

    ``q_x`` int8 ``[M, K]``, ``x_scale`` and ``x_inv`` float32 ``[M]``,
    ``acc`` int32 ``[M, N]``.

    The same kernel as :func:`w8a8_matmul` with the float epilogue left out and
    the in-VMEM int8 activation block written out (for tests).

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((2, 256), jnp.bfloat16)
    >>> q = jnp.ones((256, 128), jnp.int8)
    >>> q_x, x_scale, x_inv, acc = w8a8_parts(x, q, jnp.ones((1, 128), jnp.float32))
    >>> int(q_x[0, 0]), float(x_inv[0]), int(acc[0, 0])  # 1 * 127.5 clips to 127; 256 * 127
    (127, 127.5, 32512)
    """
    return _call(x, qvalue, scale, out_dtype=None, block_m=block_m, block_n=block_n,
                 block_k=block_k, interpret=interpret, parts=True)


def reference_w8a8_matmul(x: jax.Array, qvalue: jax.Array, scale: jax.Array, *,
                          out_dtype: DTypeLike | None = None) -> jax.Array:
    """Plain JAX with the contract of :func:`w8a8_matmul`.

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((2, 256), jnp.bfloat16)
    >>> q = jnp.ones((256, 128), jnp.int8)
    >>> s = jnp.full((1, 128), 0.5, jnp.float32)
    >>> round(float(reference_w8a8_matmul(x, q, s, out_dtype=jnp.float32)[0, 0]), 3)
    127.498
    """
    _check(x, qvalue, scale)
    out_dt = _out_dtype(out_dtype, x)
    x_scale, x_inv = row_scales(x)
    acc = jax.lax.dot(_quantize(x, x_inv), qvalue, preferred_element_type=jnp.int32)
    out = (acc.astype(jnp.float32) * x_scale) * scale.astype(jnp.float32)
    return out.astype(out_dt)
