"""The ops layer: validate, choose a dataflow, call the native primitives.

Which dataflow runs is explicit (:mod:`mlx_lattice.core.dataflow`: force one
with ``use_dataflow``, observe with ``record_dataflows``). Under ``"auto"``
(rules kept only where ``benchmarks/sparse_conv.py``, which times every
dataflow per dtype, shows them winning on the CPU; see the Benchmarks page of the docs):

* :func:`sparse_conv_features_from_relation` runs ``"generic"``, except on a
  GPU stream ``"sorted"`` for float16 features and weights, 27 offsets and
  square C32/C64 channels (the Metal kernel's case; not measurable here: on
  the CPU the sorted kernel is 1.3-1.7x slower than ``"generic"`` for every
  dtype). ``"padded_c16"`` (a C14 head padded to C16) is forced only: it
  measured within noise of ``"generic"`` (0.8-1.3x) for every dtype.
* :func:`sparse_conv_normalization_denominator_from_relation` runs
  ``"denominator_csr"`` for submanifold relations with 27 offsets, at least
  ``2**16`` rows and channels a multiple of 4 (unless the numerator runs
  ``"sorted"``), and returns ``None`` otherwise (callers then run the full
  convolution).
* :func:`sparse_quantized_conv_features_from_relation` has one dataflow,
  ``"quantized"``.

Weights are ``(K, Cin, Cout)`` ("mapped") or ``(Cout, kx, ky, kz, Cin)``;
:func:`mapped_conv_weight` (:mod:`mlx_lattice.core.weights`) converts the
latter once per weight value.
"""

from __future__ import annotations

from typing import Literal, cast

import mlx.core as mx

from mlx_lattice._errors import MlxLatticeError
from mlx_lattice._native import ext
from mlx_lattice.core.dataflow import DataflowError, get_dataflow, note
from mlx_lattice.core.quantized import QuantizedWeight, check_act_scale, with_float32_scales
from mlx_lattice.core.relations import SORTED_TILE_ROWS, KernelRelation
from mlx_lattice.core.weights import _CacheEntry, cached_per_value, mapped_conv_weight

__all__ = [
    "mapped_conv_weight",
    "sparse_conv_features_from_implicit_gemm_view",
    "sparse_conv_features_from_relation",
    "sparse_conv_features_sorted_direct_reference_from_relation",
    "sparse_conv_features_sorted_from_relation",
    "sparse_conv_normalization_denominator_from_relation",
    "sparse_pool_features_from_relation",
    "sparse_quantized_conv_features_from_relation",
]

_PADDED_WEIGHT_CACHE: dict[int, _CacheEntry] = {}

# Small relations do not amortize a specialized denominator dispatch.
_NORMALIZATION_CSR_MIN_ROWS = 1 << 16

_FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def _require_static(relation: KernelRelation) -> tuple[int, int]:
    if relation.n_out_capacity is None or relation.n_kernels is None:
        raise MlxLatticeError("kernel relation is missing static shape metadata.")
    return relation.n_out_capacity, relation.n_kernels


def _channels(weight: mx.array) -> tuple[int, int]:
    """(Cin, Cout) of a mapped or 5-D weight."""
    if weight.ndim == 5:
        return int(weight.shape[4]), int(weight.shape[0])
    return int(weight.shape[-2]), int(weight.shape[-1])


# ------------------------------------------------------- dataflow applicability


def _sorted_applies(feats: mx.array, weight: mx.array, relation: KernelRelation) -> bool:
    """The sorted kernels: C32/C64 in and out, at most 32 offsets (tile masks)."""
    if feats.ndim != 2 or weight.ndim not in (3, 5) or feats.dtype not in _FLOAT_DTYPES:
        return False
    if weight.dtype != feats.dtype or int(relation.n_kernels or 0) > 32:
        return False
    cin, cout = _channels(weight)
    return int(feats.shape[1]) == cin and cin in (32, 64) and cout in (32, 64)


def _on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def _auto_sorted(feats: mx.array, weight: mx.array, relation: KernelRelation) -> bool:
    if not _on_gpu() or not _sorted_applies(feats, weight, relation):
        return False
    cin, cout = _channels(weight)
    return feats.dtype == mx.float16 and relation.n_kernels == 27 and cin == cout


def _padded_applies(weight: mx.array) -> bool:
    return weight.ndim in (3, 5) and _channels(weight)[1] % 16 != 0


def _conv_dataflow(feats: mx.array, weight: mx.array, relation: KernelRelation) -> str:
    forced = get_dataflow()
    if forced == "sorted" and not _sorted_applies(feats, weight, relation):
        raise DataflowError(
            "dataflow 'sorted' needs C32/C64 input and output channels, one float dtype for "
            f"features and weight and at most 32 offsets; got features {feats.dtype} "
            f"{tuple(feats.shape)}, weight {weight.dtype} {tuple(weight.shape)}, "
            f"{relation.n_kernels} offsets."
        )
    if forced == "padded_c16" and not _padded_applies(weight):
        raise DataflowError(
            "dataflow 'padded_c16' needs output channels that are not a multiple of 16; got "
            f"weight {tuple(weight.shape)}."
        )
    if forced in ("sorted", "padded_c16"):
        return forced
    if forced != "auto":
        return "generic"
    if _auto_sorted(feats, weight, relation):
        return "sorted"
    return "generic"


def _padded_weight(weight: mx.array) -> mx.array:
    def pad(w: mx.array) -> mx.array:
        mapped = mapped_conv_weight(w, cache=False)
        return mx.pad(mapped, [(0, 0), (0, 0), (0, -int(mapped.shape[2]) % 16)])

    return cached_per_value(_PADDED_WEIGHT_CACHE, weight, pad)


# ------------------------------------------------------------------- the ops


def sparse_conv_features_from_relation(
    feats: mx.array,
    weight: mx.array,
    relation: KernelRelation,
) -> mx.array:
    """Execute sparse convolution over a prebuilt relation.

    ``out[o] = sum over edges e of o of feats[in_rows[e]] @ W[kernel_ids[e]]``,
    in the features' dtype (float32 accumulation). The dataflow follows
    :mod:`mlx_lattice.core.dataflow`.

    >>> from mlx_lattice.core.relations import build_kernel_relation
    >>> coords = mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32)
    >>> rel = build_kernel_relation(coords)
    >>> w = mx.zeros((27, 1, 1)).at[13].add(2.0).at[22].add(1.0)
    >>> sparse_conv_features_from_relation(mx.array([[1.0], [10.0]]), w, rel).tolist()
    [[12.0], [20.0]]
    """
    _require_static(relation)
    flow = _conv_dataflow(feats, weight, relation)
    note("sparse_conv_features", flow)
    if flow == "sorted":
        return _sorted(feats, weight, relation, store_sorted=False)
    if flow == "padded_c16":
        cout = _channels(weight)[1]
        return ext.sparse_conv_features(feats, _padded_weight(weight), relation)[:, :cout]
    return ext.sparse_conv_features(feats, mapped_conv_weight(weight), relation)


def _sorted(
    feats: mx.array, weight: mx.array, relation: KernelRelation, *, store_sorted: bool
) -> mx.array:
    return ext.sparse_conv_features_sorted_implicit_gemm(
        feats,
        mapped_conv_weight(weight),
        relation,
        relation.require_sorted_implicit_gemm(),
        store_sorted=store_sorted,
    )


def sparse_conv_features_sorted_from_relation(
    feats: mx.array,
    weight: mx.array,
    relation: KernelRelation,
    *,
    store_sorted: bool = False,
) -> mx.array:
    """Execute the sorted implicit-GEMM convolution path explicitly.

    With ``store_sorted=True`` row ``r`` of the result is output row
    ``relation.require_sorted_implicit_gemm().reorder_rows[r]``.

    Raises:
        ValueError: unless features and weight share a float dtype, have
            C32/C64 input and output channels and the kernel has at most 32
            offsets.
    """
    _require_static(relation)
    if not _sorted_applies(feats, weight, relation):
        raise MlxLatticeError(
            "sorted implicit GEMM is not supported for this relation, feature tensor, or "
            "weight tensor (needs C32/C64 channels, one float dtype, <= 32 offsets)."
        )
    note("sparse_conv_features", "sorted")
    return _sorted(feats, weight, relation, store_sorted=store_sorted)


def sparse_conv_features_sorted_direct_reference_from_relation(
    feats: mx.array,
    weight: mx.array,
    relation: KernelRelation,
    *,
    store_sorted: bool = False,
) -> mx.array:
    """The sorted dataflow computed from plain MLX ops, to check the sorted path.

    Reads the sorted view (``sorted_out_in_map``, ``reorder_rows``,
    ``tile_masks``: an offset absent from a tile's mask is skipped) and
    computes every sorted row with a gather and an einsum in float32.
    Differentiable through MLX's own gradients.
    """
    _require_static(relation)
    if not _sorted_applies(feats, weight, relation):
        raise MlxLatticeError(
            "sorted direct convolution reference is not supported for this relation, feature "
            "tensor, or weight tensor."
        )
    view = relation.require_sorted_implicit_gemm()
    n_out, n_kernels = int(relation.n_out_capacity or 0), int(relation.n_kernels or 0)
    rows = mx.arange(n_out) // SORTED_TILE_ROWS
    tile_bits = mx.take(view.tile_masks, rows, axis=0)[:, None] >> mx.arange(n_kernels)[None, :]
    masked = mx.where((tile_bits & 1) == 1, view.sorted_out_in_map, -1)
    out = sparse_conv_features_from_implicit_gemm_view(
        feats.astype(mx.float32), mapped_conv_weight(weight).astype(mx.float32), masked
    )
    if not store_sorted:
        out = mx.take(out, mx.argsort(view.reorder_rows), axis=0)
    return out.astype(feats.dtype)


def sparse_quantized_conv_features_from_relation(
    feats: mx.array,
    weight: QuantizedWeight,
    relation: KernelRelation,
    *,
    act_bits: int | None = None,
    act_scale: float | mx.array | None = None,
) -> mx.array:
    """Execute quantized sparse convolution over a prebuilt relation.

    Features are cast to the scales' dtype; the result has the features' dtype.

    ``act_bits=None`` keeps float activations (the weight is dequantized in
    the kernel). ``act_bits=8`` is the integer path (w8a8, or w4a8 with a
    4-bit weight): every feature row is quantized to int8 with a symmetric
    dynamic scale ``max|row| / 127`` and the convolution runs int8 x weight
    codes -> int32 (AVX512-VNNI / AVX-VNNI ``vpdpbusd`` when the CPU has it,
    AMX tiles on Intel Xeons, ``vpmaddubsw`` pairs on plain AVX2) with a
    float32 epilogue applying the activation scale and the weight's
    group scales and biases. CPU stream only; the group size must be a
    multiple of 4 and at most 65536 (so every group's int32 sum is exact).
    Its gradient with respect to the features is that of the
    float-activation convolution (straight-through). ``act_bits=None`` takes
    the weight's own ``act_bits``.

    ``act_scale`` (with ``act_bits=8``): one static activation scale ``S``
    for every row instead of the dynamic per-row ones (a finite value > 0,
    e.g. ``max|F| / 127`` from calibration:
    :func:`mlx_lattice.calibrate_activation_scales`); values beyond
    ``127 * S`` saturate. ``S`` then multiplies each output row once rather
    than every edge. ``None`` takes the weight's own ``act_scale``.

    >>> from mlx_lattice.core.relations import build_kernel_relation
    >>> coords = mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32)
    >>> rel = build_kernel_relation(coords)
    >>> w = mx.zeros((27, 32, 8)).at[13].add(0.5)
    >>> qw = QuantizedWeight.from_float(w, bits=8, group_size=32)
    >>> sparse_quantized_conv_features_from_relation(mx.ones((2, 32)), qw, rel)[:, 0].tolist()
    [16.0, 16.0]
    """
    if feats.dtype not in _FLOAT_DTYPES:
        raise MlxLatticeError("features must be float16, bfloat16 or float32.")
    if act_bits is None:
        act_bits = weight.act_bits
    if act_bits not in (None, 8):
        raise MlxLatticeError(f"act_bits must be None or 8, got {act_bits!r}.")
    if act_scale is None:
        act_scale = weight.act_scale if act_bits == 8 else None
    elif act_bits != 8:
        raise MlxLatticeError("act_scale (a static activation scale) needs act_bits=8.")
    scale = 0.0 if act_scale is None else check_act_scale(act_scale)
    _require_static(relation)
    if relation.n_kernels != weight.n_kernels:
        raise MlxLatticeError("quantized weight kernel rows must match the relation.")
    note("sparse_quantized_conv_features", "quantized" if act_bits is None else "int8")
    out = ext.sparse_quantized_conv_features(
        feats.astype(weight.scales.dtype),
        with_float32_scales(weight),
        relation,
        act_bits=act_bits or 0,
        act_scale=scale,
    )
    return out.astype(feats.dtype)


def sparse_conv_normalization_denominator_from_relation(
    unit_feats: mx.array,
    squared_weight: mx.array,
    relation: KernelRelation,
) -> mx.array | None:
    """The normalization denominator as a dedicated output-CSR reduction.

    Returns ``conv(unit_feats, squared_weight)`` for all-ones ``unit_feats``
    through the ``"denominator_csr"`` dataflow, or ``None`` when that is not
    chosen (the caller then runs the full convolution). Gradients and
    tangents are those of the full convolution.
    """
    forced = get_dataflow()
    if forced == "auto":
        if not _auto_denominator(unit_feats, squared_weight, relation):
            return None
    elif forced != "denominator_csr":
        return None
    elif unit_feats.ndim != 2 or _channels(squared_weight)[0] != int(unit_feats.shape[1]):
        raise DataflowError(
            "dataflow 'denominator_csr' needs (N, C) unit features and a weight with C input "
            f"channels; got {tuple(unit_feats.shape)} and {tuple(squared_weight.shape)}."
        )
    note("sparse_conv_normalization_denominator", "denominator_csr")

    def full_denominator(feats_arg: mx.array, weight_arg: mx.array) -> mx.array:
        return ext.sparse_conv_features(feats_arg, mapped_conv_weight(weight_arg), relation)

    @mx.custom_function
    def csr_denominator(feats_arg: mx.array, weight_arg: mx.array) -> mx.array:
        del feats_arg
        return ext.sparse_conv_normalization_denominator(mapped_conv_weight(weight_arg), relation)

    @csr_denominator.vjp
    def denominator_vjp(primals, cotangent, output):  # noqa: ANN001
        del output
        _, gradients = mx.vjp(full_denominator, list(primals), [cotangent])
        return tuple(gradients)

    @csr_denominator.jvp
    def denominator_jvp(primals, tangents):  # noqa: ANN001
        # MLX passes None for arguments without a tangent.
        filled = [
            mx.zeros_like(p) if t is None else t for p, t in zip(primals, tangents, strict=True)
        ]
        _, tangent = mx.jvp(full_denominator, list(primals), filled)
        return tangent[0]

    return cast(mx.array, csr_denominator(unit_feats, squared_weight))


def _auto_denominator(
    unit_feats: mx.array, squared_weight: mx.array, relation: KernelRelation
) -> bool:
    if relation.contract.kind != "submanifold" or relation.n_kernels != 27:
        return False
    if unit_feats.dtype not in _FLOAT_DTYPES or squared_weight.dtype != unit_feats.dtype:
        return False
    if unit_feats.ndim != 2 or int(unit_feats.shape[0]) < _NORMALIZATION_CSR_MIN_ROWS:
        return False
    if squared_weight.ndim not in (3, 5):
        return False
    cin = _channels(squared_weight)[0]
    if cin % 4 != 0 or cin != int(unit_feats.shape[1]):
        return False
    # Square C32/C64 convolutions use the sorted numerator's accumulation
    # contract; keep their denominator on the same kernel.
    return not _auto_sorted(unit_feats, squared_weight, relation)


def sparse_conv_features_from_implicit_gemm_view(
    feats: mx.array,
    weight: mx.array,
    out_in_map: mx.array,
) -> mx.array:
    """Execute dense convolution from an output-row by kernel-offset map.

    Plain MLX ops (gather, mask, einsum): a reference for the native paths.

    >>> m = mx.array([[0, -1], [1, 0]], dtype=mx.int32)
    >>> w = mx.array([[[1.0]], [[10.0]]])
    >>> sparse_conv_features_from_implicit_gemm_view(mx.array([[1.0], [2.0]]), w, m).tolist()
    [[1.0], [12.0]]
    """
    mapped = mapped_conv_weight(weight)
    if mapped.ndim == 2:
        mapped = mapped[None, ...]
    if int(mapped.shape[0]) != int(out_in_map.shape[1]):
        raise MlxLatticeError("weight kernel rows must match out_in_map columns.")
    valid = out_in_map >= 0
    gathered = mx.take(feats, mx.maximum(out_in_map, 0), axis=0)
    gathered = gathered * valid[..., None].astype(feats.dtype)
    return mx.einsum("nki,kio->no", gathered, mapped)


def sparse_pool_features_from_relation(
    feats: mx.array,
    relation: KernelRelation,
    *,
    input_exclusive: bool,
    mode: Literal["max", "avg", "sum"] | str,
) -> mx.array:
    """Execute sparse pooling over a prebuilt kernel relation.

    ``avg`` divides by the number of present neighbours; outputs with none
    are 0. ``input_exclusive=True`` asserts non-overlapping windows.

    >>> from mlx_lattice.core.relations import build_kernel_relation
    >>> coords = mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32)
    >>> rel = build_kernel_relation(coords, kernel_size=2, stride=2, kind="forward")
    >>> f = mx.array([[1.0], [3.0]])
    >>> sparse_pool_features_from_relation(f, rel, input_exclusive=True, mode="avg").tolist()
    [[2.0]]
    """
    _require_static(relation)
    return ext.sparse_pool_features(feats, relation, input_exclusive=input_exclusive, mode=mode)
