"""The kernel switch: Qwix's program or a Pallas matmul kernel, per call or per layer.

``'qwix'`` (the default) runs the Qwix-exact program; ``'pallas'`` runs the
Pallas TPU kernels where one exists for the rule and the contraction's
layout, and Qwix elsewhere; ``'auto'`` is ``'pallas'`` on a TPU backend and
``'qwix'`` otherwise. :func:`choose` decides, and says why a call that asked
for Pallas got Qwix; :func:`matmul` runs the chosen kernel. The Pallas
modules are imported only when a kernel runs.

A TPU v4 has no int8 MXU matmul, so on a v4 backend w8a8 rules run Qwix under
both ``'auto'`` and ``'pallas'``, with that note (rather than a kernel that
raises on every call); off a TPU ``'pallas'`` still runs the w8a8 kernel in
interpret mode.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import quantrules
from taktiny_ops import _pallas_blocks as B
from taktiny_ops._common import TaktinyOpsError

__all__: list[str] = []

#: The values of ``kernel=`` (ops) and ``kernels=`` (:func:`taktiny_ops.quantize`).
SWITCH = ("qwix", "pallas", "auto")
QWIX = "qwix"
WEIGHT_ONLY = "pallas-weight-only"
W8A8 = "pallas-w8a8"
_SYMMETRIC = ("absmax", "rms")  # calibrations with no zero point


def check_switch(value: Any, argument: str) -> str:
    """``value`` if it is one of :data:`SWITCH`, else a TaktinyOpsError naming ``argument``."""
    if not isinstance(value, str) or value not in SWITCH:
        raise TaktinyOpsError(
            f"{argument}: expected one of {', '.join(repr(s) for s in SWITCH)}, got {value!r}"
        )
    return value


def qtype_name(qtype: Any) -> str:
    """A qtype's name ('int8', 'float8_e4m3fn', 'nf4'), however it is spelled."""
    try:
        return jnp.dtype(qtype).name
    except TypeError:
        return str(qtype)


def choose(switch: str, res: quantrules.Resolution | None, *, layout: str | None = None,
           operands: tuple[Any, Any] | None = None) -> tuple[str, str]:
    """``(kernel, note)``: :data:`QWIX`, :data:`WEIGHT_ONLY` or :data:`W8A8`, and,
    when ``switch`` asked for Pallas and the answer is Qwix, why.

    ``res`` is the selected PTQ/QT resolution (None: no quantizing rule);
    ``layout`` is None for a ``[..., K] x [K, N]`` contraction with the
    weight second, else the reason it is not one; ``operands``, the
    activation (None: not checked) and the quantized weight: a Pallas kernel
    they do not fit (:func:`misfit`) is Qwix, with that reason.
    """
    if switch == QWIX or res is None:
        return QWIX, ""
    if switch == "auto" and jax.default_backend() != "tpu":
        return QWIX, f"kernels='auto' on a {jax.default_backend()} backend runs Qwix"
    rule = res.rule
    if res.mode != "ptq":
        return QWIX, "QT (training) rules run Qwix's training kernel"
    if rule.weight_qtype is None:
        return QWIX, "no Pallas kernel for activation-only quantization"
    weight = qtype_name(quantrules.qwix_qtype(rule.weight_qtype))
    if rule.weight_calibration_method.split(",")[0] not in _SYMMETRIC:
        return QWIX, (f"no Pallas kernel for weight calibration "
                      f"{rule.weight_calibration_method!r} (it has a zero point)")
    if layout is not None:
        return QWIX, layout
    if rule.act_qtype is None:
        if weight not in B.WEIGHT_ONLY_QTYPES:
            return QWIX, f"no Pallas weight-only kernel for {weight} weights"
        kernel = WEIGHT_ONLY
    else:
        act = qtype_name(quantrules.qwix_qtype(rule.act_qtype))
        if (weight, act) != ("int8", "int8"):
            return QWIX, f"no Pallas kernel for {weight} weights x {act} activations"
        if rule.tile_size is not None:
            return QWIX, f"no Pallas kernel for tiled w8a8 (tile_size={rule.tile_size})"
        if (rule.act_calibration_method or "absmax") != "absmax":
            return QWIX, "the Pallas w8a8 kernel needs per-token absmax activation scales"
        if jax.default_backend() == "tpu" and B.tpu_generation() == "v4":
            return QWIX, "the TPU v4 has no int8 MXU matmul"
        kernel = W8A8
    why = misfit(*operands) if operands is not None else None
    return (QWIX, why) if why is not None else (kernel, "")


def misfit(x: Any, w: Any) -> str | None:
    """Why the Pallas kernels cannot take this activation (None: not checked)
    and quantized weight ``w[K, N]``, or None when they can."""
    if x is not None and jnp.dtype(x.dtype) not in B.FLOATS:
        return f"the Pallas kernels take float32 or bfloat16 activations, not {x.dtype}"
    if w.zero_point is not None:
        return "the Pallas kernels take no zero point"
    if jnp.dtype(w.scale.dtype) not in B.FLOATS:
        return f"the Pallas kernels take float32 or bfloat16 scales, not {w.scale.dtype}"
    k, groups = w.qvalue.shape[0], w.scale.shape[0]
    if groups > 1 and (k // groups) % B.LANE:
        return f"the Pallas kernel needs K tiles of a multiple of {B.LANE}, not {k // groups}"
    return None


def matmul(kernel: str, x: jax.Array, w: Any, out_dtype: Any) -> jax.Array:
    """``x[..., K] @ w[K, N]`` with ``w`` a Qwix QArray, on the Pallas ``kernel``.

    Off a TPU the kernels run in Pallas interpret mode (correct, slow).
    """
    if kernel == W8A8:
        from taktiny_ops._pallas_w8a8 import w8a8_matmul as run
    else:
        from taktiny_ops._pallas_matmul import weight_only_matmul as run
    y = run(jnp.reshape(x, (-1, x.shape[-1])), w.qvalue, w.scale, out_dtype=out_dtype)
    return jnp.reshape(y, (*x.shape[:-1], w.qvalue.shape[1]))
