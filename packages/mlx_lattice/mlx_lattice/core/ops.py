"""The ops layer: validate, choose a dataflow, call the native primitives.

Dispatch rules:

* :func:`sparse_conv_features_from_relation` takes the sorted implicit-GEMM
  path for float16 features and weights, 27 offsets and square C32/C64
  channels on ``forward``/``target``/``submanifold`` relations; a float16
  C64 -> C14 submanifold head on at least 4096 outputs is padded to C16 and
  sliced back; everything else runs the generic output-stationary kernel.
* :func:`sparse_quantized_conv_features_from_relation` hands the sorted view
  to the native op when it qualifies (float16, 27 offsets, C32/C64 without
  channel padding, ``group_size <= in_channels``).
* :func:`sparse_conv_normalization_denominator_from_relation` returns ``None``
  unless the specialised output-CSR reduction applies (float16 submanifold,
  27 offsets, at least ``2**16`` rows, channels a multiple of 4, not a
  square C32/C64 convolution); callers then use the full convolution.

Weights are ``(K, Cin, Cout)`` ("mapped") or ``(Cout, kx, ky, kz, Cin)``;
:func:`mapped_conv_weight` converts the latter and caches the result per
weight *value*: an array updated in place, or a new array at a reused
``id``, never gets a stale entry, and a dead weight is never kept alive.
"""

from __future__ import annotations

import weakref
from typing import Literal, cast

import mlx.core as mx

from mlx_lattice._native import ext
from mlx_lattice.core.quantized import QuantizedWeight
from mlx_lattice.core.relations import KernelRelation

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

# Cache entries: id(weight) -> (weakref to the weight, handle on the value it
# had, derived array). The value handle makes in-place updates miss the cache.
_CacheEntry = tuple[weakref.ReferenceType[mx.array], mx.array, mx.array]
_PACKED_WEIGHT_CACHE: dict[int, _CacheEntry] = {}
_PADDED_COUT16_WEIGHT_CACHE: dict[int, _CacheEntry] = {}

# Small relations do not amortize a specialized denominator dispatch.
_NORMALIZATION_CSR_MIN_ROWS = 1 << 16

_FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def _cached(cache: dict[int, _CacheEntry], weight: mx.array, derive) -> mx.array:  # noqa: ANN001
    key = id(weight)
    entry = cache.get(key)
    if entry is not None:
        ref, value, derived = entry
        if ref() is weight and ext.same_value(value, weight):
            return derived
    derived = derive(weight)

    def forget(dead: weakref.ReferenceType[mx.array], key: int = key) -> None:
        current = cache.get(key)
        if current is not None and current[0] is dead:
            cache.pop(key, None)

    cache[key] = (weakref.ref(weight, forget), ext.array_value(weight), derived)
    return derived


def _empty_i32() -> mx.array:
    return mx.array([], dtype=mx.int32)


def _require_static(relation: KernelRelation) -> tuple[int, int]:
    if relation.n_out_capacity is None or relation.n_kernels is None:
        raise ValueError("kernel relation is missing static shape metadata.")
    return relation.n_out_capacity, relation.n_kernels


def sparse_quantized_conv_features_from_relation(
    feats: mx.array,
    weight: QuantizedWeight,
    relation: KernelRelation,
) -> mx.array:
    """Execute quantized sparse convolution over a prebuilt relation.

    Features are cast to the scales' dtype; the result has the features' dtype.

    >>> from mlx_lattice.core.relations import build_kernel_relation
    >>> coords = mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32)
    >>> rel = build_kernel_relation(coords)
    >>> qw = QuantizedWeight.from_float(mx.random.normal((27, 32, 8)), bits=8, group_size=32)
    >>> sparse_quantized_conv_features_from_relation(mx.ones((2, 32)), qw, rel).shape
    (2, 8)
    """
    if feats.dtype not in _FLOAT_DTYPES:
        raise ValueError("features must be float16, bfloat16 or float32.")
    n_out, n_kernels = _require_static(relation)
    output_dtype = feats.dtype
    feats = feats.astype(weight.scales.dtype)
    if n_kernels != weight.weight.shape[0]:
        raise ValueError("quantized weight kernel rows must match the relation.")
    sorted_kv_out_in_map = _empty_i32()
    reorder_rows = _empty_i32()
    tile_masks = _empty_i32()
    if _can_use_sorted_quantized_implicit_gemm(feats, weight, relation):
        view = relation.require_sorted_implicit_gemm()
        sorted_kv_out_in_map = view.sorted_kv_out_in_map
        reorder_rows = view.reorder_rows
        tile_masks = view.tile_masks
    out = ext.sparse_quantized_conv_features(
        feats,
        weight.weight,
        weight.scales,
        weight.biases,
        relation.edges.in_rows,
        relation.edges.out_rows,
        relation.edges.kernel_ids,
        relation.counts,
        relation.output_csr.row_offsets,
        sorted_kv_out_in_map,
        reorder_rows,
        tile_masks,
        n_out,
        n_kernels,
        weight.in_channels,
        weight.out_channels,
        weight.storage_in_channels,
        weight.group_size,
        weight.bits,
    )
    return out.astype(output_dtype)


def _can_use_sorted_quantized_implicit_gemm(
    feats: mx.array,
    weight: QuantizedWeight,
    relation: KernelRelation,
) -> bool:
    return (
        relation.contract.kind in ("forward", "target", "submanifold")
        and feats.dtype == mx.float16
        and relation.n_kernels == 27
        and weight.storage_in_channels == weight.in_channels
        and weight.in_channels in (32, 64)
        and weight.out_channels in (32, 64)
        and weight.group_size <= weight.in_channels
    )


def sparse_conv_features_from_relation(
    feats: mx.array,
    weight: mx.array,
    relation: KernelRelation,
) -> mx.array:
    """Execute sparse convolution over a prebuilt relation.

    ``out[o] = sum over edges e of o of feats[in_rows[e]] @ W[kernel_ids[e]]``,
    in the features' dtype (float32 accumulation).

    >>> from mlx_lattice.core.relations import build_kernel_relation
    >>> coords = mx.array([[0, 0, 0, 0], [0, 1, 0, 0]], dtype=mx.int32)
    >>> rel = build_kernel_relation(coords)
    >>> w = mx.zeros((27, 1, 1)).at[13].add(2.0).at[22].add(1.0)
    >>> sparse_conv_features_from_relation(mx.array([[1.0], [10.0]]), w, rel).tolist()
    [[12.0], [20.0]]
    """
    n_out, n_kernels = _require_static(relation)
    if _can_pad_cout14_to_cout16(feats, weight, relation):
        return sparse_conv_features_from_relation(
            feats, _pad_cout14_weight_to_cout16(weight), relation
        )[:, :14]
    if _can_use_sorted_implicit_gemm(feats, weight, relation):
        return sparse_conv_features_sorted_from_relation(feats, weight, relation)
    input_csr = relation.input_csr
    kernel_csr = relation.kernel_csr
    if input_csr.edge_ids is None or kernel_csr.edge_ids is None:
        raise ValueError("kernel relation is missing grouped CSR views.")
    return ext.sparse_conv_features(
        feats,
        weight,
        relation.edges.in_rows,
        relation.edges.out_rows,
        relation.edges.kernel_ids,
        relation.counts,
        relation.output_csr.row_offsets,
        input_csr.row_offsets,
        input_csr.edge_ids,
        kernel_csr.row_offsets,
        kernel_csr.edge_ids,
        n_out,
        n_kernels,
    )


def _can_pad_cout14_to_cout16(
    feats: mx.array,
    weight: mx.array,
    relation: KernelRelation,
) -> bool:
    """Use the C16 dense kernel for large C64-to-C14 output heads."""
    if (
        relation.contract.kind != "submanifold"
        or relation.n_kernels != 27
        or relation.n_out_capacity is None
        or relation.n_out_capacity < 4096
        or feats.dtype != mx.float16
        or feats.ndim != 2
        or int(feats.shape[1]) != 64
        or weight.dtype != mx.float16
    ):
        return False
    if weight.ndim == 3:
        return tuple(int(d) for d in weight.shape) == (27, 64, 14)
    return weight.ndim == 5 and tuple(int(d) for d in weight.shape) == (14, 3, 3, 3, 64)


def _pad_cout14_weight_to_cout16(weight: mx.array) -> mx.array:
    def pad(w: mx.array) -> mx.array:
        widths = (
            [(0, 0), (0, 0), (0, 2)] if w.ndim == 3 else [(0, 2), (0, 0), (0, 0), (0, 0), (0, 0)]
        )
        return mx.pad(w, widths)

    return _cached(_PADDED_COUT16_WEIGHT_CACHE, weight, pad)


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
    """
    n_out, n_kernels = _require_static(relation)
    if not _can_use_sorted_implicit_gemm(feats, weight, relation):
        raise ValueError(
            "sorted implicit GEMM is not supported for this relation, feature tensor, or weight tensor."
        )
    view = relation.require_sorted_implicit_gemm()
    return ext.sparse_conv_features_sorted_implicit_gemm(
        feats,
        mapped_conv_weight(weight),
        view.sorted_out_in_map,
        view.sorted_kv_out_in_map,
        view.reorder_rows,
        view.tile_masks,
        relation.edges.in_rows,
        relation.edges.out_rows,
        relation.edges.kernel_ids,
        relation.counts,
        relation.output_csr.row_offsets,
        relation.input_csr.row_offsets,
        relation.in_edge_ids,
        relation.kernel_csr.row_offsets,
        relation.kernel_edge_ids,
        n_out,
        n_kernels,
        store_sorted=store_sorted,
    )


def sparse_conv_normalization_denominator_from_relation(
    unit_feats: mx.array,
    squared_weight: mx.array,
    relation: KernelRelation,
) -> mx.array | None:
    """Reduce FP16 denominators in canonical output-CSR edge order.

    Returns ``conv(unit_feats, squared_weight)`` for all-ones ``unit_feats``
    through a specialised reduction, or ``None`` when it does not apply (the
    caller then runs the full convolution). Gradients and tangents are those
    of the full convolution.
    """
    if relation.contract.kind != "submanifold":
        return None
    if unit_feats.dtype != mx.float16 or squared_weight.dtype != mx.float16:
        return None
    if (
        relation.n_kernels != 27
        or unit_feats.ndim != 2
        or int(unit_feats.shape[0]) < _NORMALIZATION_CSR_MIN_ROWS
    ):
        return None
    mapped_weight = mapped_conv_weight(squared_weight)
    if (
        mapped_weight.ndim != 3
        or int(mapped_weight.shape[0]) != 27
        or int(mapped_weight.shape[1]) % 4 != 0
        or int(mapped_weight.shape[1]) != int(unit_feats.shape[1])
    ):
        return None
    # Square C32/C64 convolutions use a different accumulation contract. Keep
    # their denominator on the numerator's existing kernel.
    if _can_use_sorted_implicit_gemm(unit_feats, squared_weight, relation):
        return None

    def full_denominator(feats_arg: mx.array, weight_arg: mx.array) -> mx.array:
        return sparse_conv_features_from_relation(feats_arg, weight_arg, relation)

    @mx.custom_function
    def csr_denominator(feats_arg: mx.array, weight_arg: mx.array) -> mx.array:
        del feats_arg
        return ext.sparse_conv_normalization_denominator(
            mapped_conv_weight(weight_arg),
            relation.edges.kernel_ids,
            relation.counts,
            relation.output_csr.row_offsets,
        )

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


def sparse_conv_features_sorted_direct_reference_from_relation(
    feats: mx.array,
    weight: mx.array,
    relation: KernelRelation,
    *,
    store_sorted: bool = False,
) -> mx.array:
    """Execute the sorted direct reference path for diagnostics/tests."""
    n_out, n_kernels = _require_static(relation)
    if not _can_use_sorted_implicit_gemm(feats, weight, relation):
        raise ValueError(
            "sorted direct convolution reference is not supported for this relation, feature tensor, or weight tensor."
        )
    view = relation.require_sorted_implicit_gemm()
    return ext.sparse_conv_features_sorted_direct_reference(
        feats,
        mapped_conv_weight(weight),
        view.sorted_out_in_map,
        view.reorder_rows,
        view.tile_masks,
        n_out,
        n_kernels,
        store_sorted=store_sorted,
    )


def _can_use_sorted_implicit_gemm(
    feats: mx.array,
    weight: mx.array,
    relation: KernelRelation,
) -> bool:
    if relation.contract.kind not in ("forward", "target", "submanifold"):
        return False
    if feats.dtype != mx.float16 or weight.dtype != mx.float16:
        return False
    if relation.n_kernels != 27:
        return False
    if feats.ndim != 2 or int(feats.shape[1]) not in (32, 64):
        return False
    channels = int(feats.shape[1])
    if weight.ndim == 3:
        return int(weight.shape[0]) == 27 and tuple(weight.shape[1:]) == (channels, channels)
    return weight.ndim == 5 and tuple(weight.shape) == (channels, 3, 3, 3, channels)


def mapped_conv_weight(weight: mx.array) -> mx.array:
    """``(Cout, kx, ky, kz, Cin)`` -> contiguous ``(K, Cin, Cout)``; 3-D passes through.

    >>> mapped_conv_weight(mx.zeros((8, 3, 3, 3, 4))).shape
    (27, 4, 8)
    """
    if weight.ndim == 3:
        return weight
    if weight.ndim != 5:
        raise ValueError(
            f"weight must be (K, Cin, Cout) or (Cout, kx, ky, kz, Cin), got shape {tuple(weight.shape)}."
        )

    def pack(w: mx.array) -> mx.array:
        out_channels, in_channels = int(w.shape[0]), int(w.shape[4])
        return mx.contiguous(w.transpose(1, 2, 3, 4, 0).reshape((-1, in_channels, out_channels)))

    return _cached(_PACKED_WEIGHT_CACHE, weight, pack)


def sparse_conv_features_from_implicit_gemm_view(
    feats: mx.array,
    weight: mx.array,
    out_in_map: mx.array,
) -> mx.array:
    """Execute dense convolution from an output-row by kernel-offset map.

    Plain MLX ops (gather, mask, einsum): a reference for the native paths.
    """
    mapped = mapped_conv_weight(weight)
    if mapped.ndim == 2:
        mapped = mapped[None, ...]
    if int(mapped.shape[0]) != int(out_in_map.shape[1]):
        raise ValueError("weight kernel rows must match out_in_map columns.")
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
    """
    n_out, n_kernels = _require_static(relation)
    return ext.sparse_pool_features(
        feats,
        relation.edges.in_rows,
        relation.edges.out_rows,
        relation.edges.kernel_ids,
        relation.output_csr.row_offsets,
        relation.counts,
        input_exclusive,
        mode,
        n_out,
        n_kernels,
    )
