"""Block sizes, padding and VMEM budgets of the Pallas TPU matmul kernels.

One small table, keyed by the TPU generation and a bucket of M, gives the
default ``(block_m, block_n, block_k)`` of each kernel; :func:`plan` turns it
(or the caller's explicit blocks) into a legal plan for any shape: every block
a multiple of the hardware tile, the padded extents multiples of the blocks.
M may be symbolic (``jax.export`` with a symbolic batch size): the plan then
takes the table's last bucket (large M, the serving throughput case) and
keeps ``bm`` as it is, so the padded extent ``round_up(m, bm)`` and the grid
``m_pad // bm`` are symbolic expressions jax.export resolves at run time (a
batch smaller than ``bm`` is padded up to one block).
Shapes that are not multiples of 128 along K or N are padded with zeros by the
caller of :func:`plan` (a copy of the weight per call: store weights padded to
avoid it).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from taktiny_ops._common import TaktinyOpsError

__all__: list[str] = []

LANE = 128  # the lane width of a vreg and the MXU edge on v4..v6e
#: Weight storage types the weight-only kernel reads (Qwix qtype names).
WEIGHT_ONLY_QTYPES = ("int8", "int4", "float8_e4m3fn", "float8_e5m2")
#: The float types the kernels take for activations and scales.
FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
MIB = 1 << 20


class Plan(NamedTuple):
    """A legal tiling: blocks and the padded extents they divide."""

    bm: int
    bn: int
    bk: int
    m_pad: Any  # symbolic where M is
    n_pad: int
    k_pad: int


@functools.cache  # the device kind is fixed for the process; asked on every trace
def tpu_generation() -> str:
    """'v4', 'v5e', 'v5p', 'v6e' or 'default' from the first device's kind.

    >>> tpu_generation() in {"v4", "v5e", "v5p", "v6e", "default"}
    True
    """
    kind = jax.devices()[0].device_kind.lower()
    if "tpu" not in kind:
        return "default"
    if "v6" in kind:
        return "v6e"
    if "v5 lite" in kind or "v5e" in kind or "v5litepod" in kind:
        return "v5e"
    if "v5" in kind:
        return "v5p"
    if "v4" in kind:
        return "v4"
    return "default"


_MOSAIC = contextvars.ContextVar("taktiny_ops_mosaic", default=False)


@contextlib.contextmanager
def mosaic() -> Iterator[None]:
    """Kernels traced inside lower to Mosaic (the TPU), whatever the default backend.

    ``export_model`` traces under it: an artifact carries the TPU kernel, not
    its interpreted twin, even when a CPU-only host exports it.

    >>> with mosaic():
    ...     use_interpret(None)
    False
    """
    token = _MOSAIC.set(True)
    try:
        yield
    finally:
        _MOSAIC.reset(token)


def use_interpret(interpret: bool | None) -> bool:
    """``None`` means interpret mode unless the default backend is a TPU (or
    the trace runs under :func:`mosaic`)."""
    if interpret is None:
        return jax.default_backend() != "tpu" and not _MOSAIC.get()
    return bool(interpret)


# The usable scoped-VMEM ceiling per generation (physical VMEM less headroom
# for Mosaic's internal scratch): v4 has 32 MiB per core, v5e/v6e 128 MiB,
# v5p 95 MiB.
_VMEM_CAP = {"v4": 28 * MIB, "v5e": 100 * MIB, "v5p": 80 * MIB, "v6e": 100 * MIB,
             "default": 32 * MIB}

# (kernel, generation) -> ((max M of the bucket, (bm, bn, bk)), ...), smallest
# bucket first. M <= 128 is memory bound: few large weight blocks, so the
# per-step overhead (~0.35 us) stays small against each block's HBM time.
# Large M is MXU bound: 512-row blocks reuse each dequantized weight block.
# bk == 0 (w8a8) asks that each activation block be quantized once: all of K in
# one block (the int8 block is kept in VMEM across the N blocks) up to
# K = _FULL_K_MAX; beyond (at K=14336 and bm=512 the bf16 block alone would take
# 2 x 14 MiB) bk = 2048 and, up to N = _FULL_N_MAX, all of N in one block.
_FULL_K_MAX = 8192
_FULL_N_MAX = 4096
_TABLE: dict[tuple[str, str], tuple[tuple[int, tuple[int, int, int]], ...]] = {
    # M > 512: 512x2048x2048 timed 0.98-0.99x bf16 at M=1024 against
    # 512x1024x1024's 0.96-0.97x (benchmarks/LOG.md, the block sweep).
    ("weight_only", "v5e"): ((128, (128, 2048, 1024)), (512, (256, 1024, 1024)),
                             (math.inf, (512, 2048, 2048))),
    ("weight_only", "v6e"): ((128, (128, 2048, 2048)), (math.inf, (512, 2048, 1024))),
    ("w8a8", "v5e"): ((128, (128, 2048, 0)), (512, (256, 1024, 0)),
                      (math.inf, (512, 1024, 0))),
    ("w8a8", "v6e"): ((128, (128, 2048, 0)), (math.inf, (512, 2048, 0))),
    ("weight_only", "default"): ((128, (128, 1024, 1024)), (math.inf, (256, 512, 512))),
    ("w8a8", "default"): ((128, (128, 1024, 1024)), (math.inf, (256, 512, 512))),
}


def default_blocks(kernel: str, m: Any) -> tuple[int, int, int]:
    """The table's (bm, bn, bk) for this generation and M (bk 0: all of K);
    a symbolic M (an exported artifact's batch) takes the last (large M) bucket.

    >>> bm, bn, bk = default_blocks("weight_only", 16)
    >>> bn % 128 == 0 and bk % 128 == 0
    True
    >>> (m,) = jax.export.symbolic_shape("batch")
    >>> default_blocks("w8a8", m) == default_blocks("w8a8", 1 << 30)
    True
    """
    gen = tpu_generation()
    rows = _TABLE.get((kernel, gen)) or _TABLE[(kernel, "default")]
    if not isinstance(m, int):
        return rows[-1][1]
    for limit, blocks in rows:
        if m <= limit:
            return blocks
    return rows[-1][1]


def vmem_cap() -> int:
    return _VMEM_CAP.get(tpu_generation(), _VMEM_CAP["default"])


def round_up(x: Any, m: int) -> Any:
    """``x`` rounded up to a multiple of ``m`` (an int, or a symbolic dimension)."""
    return -(-x // m) * m


def _largest_dividing(total: int, target: int, step: int) -> int:
    """The largest multiple of ``step`` <= ``target`` that divides ``total``."""
    b = max(step, (min(target, total) // step) * step)
    while total % b:
        b -= step
    return b


def _check_block(name: str, value: int | None, step: int) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % step:
        raise TaktinyOpsError(f"{name} must be a positive multiple of {step}, got {value!r}")


def plan(kernel: str, m: Any, n: int, k: int, *, block_m: int | None,
         block_n: int | None, block_k: int | None, m_step: int,
         k_step: int = LANE) -> Plan:
    """Legal blocks for ``x[m, k] @ w[k, n]``.

    ``m_step`` is the row tile of the activation block (8 for float32, 16 for
    bfloat16, 32 where an int8 copy of the block is made), ``k_step`` the K
    granularity (the scale tile for sub-channel scales). Explicit blocks must
    be multiples of these; the padded extents are multiples of the blocks.

    >>> plan("weight_only", 5, 200, 384, block_m=None, block_n=None, block_k=None,
    ...      m_step=16)[3:]
    (16, 256, 384)
    >>> (b,) = jax.export.symbolic_shape("b")
    >>> p = plan("weight_only", 4 * b, 200, 384, block_m=None, block_n=None,
    ...          block_k=None, m_step=16)
    >>> p.bm == default_blocks("weight_only", b)[0], p.m_pad == round_up(4 * b, p.bm)
    (True, True)
    """
    _check_block("block_m", block_m, m_step)
    _check_block("block_n", block_n, LANE)
    _check_block("block_k", block_k, k_step)
    dm, dn, dk = default_blocks(kernel, m)
    m_al, n_al, k_al = round_up(m, m_step), round_up(n, LANE), round_up(k, k_step)
    if block_m is not None:
        bm = block_m
    elif isinstance(m, int):
        bm = min(round_up(dm, m_step), m_al)
    else:  # symbolic M: no comparison with it is decidable; one full block
        bm = round_up(dm, m_step)
    bn = block_n if block_n is not None else _largest_dividing(n_al, dn, LANE)
    if block_k is not None:
        bk = block_k
    elif dk == 0 and k_al <= _FULL_K_MAX:  # all of K: x quantized once per row block
        bk = k_al
    elif dk == 0:  # K too long for one block: all of N instead, where it fits,
        bk = _largest_dividing(k_al, 2048, k_step)  # so x is still quantized once
        if block_n is None and n_al <= _FULL_N_MAX:
            bn = n_al
    else:
        bk = _largest_dividing(k_al, max(dk, k_step), k_step)
    return Plan(bm, bn, bk, round_up(m, bm), round_up(n, bn), round_up(k, bk))


def vmem_limit(nbytes: int) -> int:
    """A scoped-VMEM limit for a kernel whose buffers take ``nbytes``."""
    want = int(nbytes * 1.5) + 4 * MIB
    return max(16 * MIB, min(want, vmem_cap()))
