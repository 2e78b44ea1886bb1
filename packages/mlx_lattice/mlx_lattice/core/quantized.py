"""Group-affine quantized convolution weights, packed per kernel offset."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_lattice._errors import MlxLatticeError, MlxLatticeTypeError
from mlx_lattice.core.weights import _CacheEntry, cached_per_value, mapped_conv_weight

__all__ = ["SUPPORTED_BITS", "SUPPORTED_GROUP_SIZES", "QuantizedWeight", "check_act_scale"]

#: Bit widths a :class:`QuantizedWeight` accepts (those of ``mx.quantize``).
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
#: Group sizes a :class:`QuantizedWeight` accepts.
SUPPORTED_GROUP_SIZES = (32, 64, 128)


def check_act_scale(scale: Any, name: str = "act_scale") -> float:
    """A static activation scale as a Python float: one finite value > 0
    (a Python or NumPy number, or an MLX/NumPy array of one element).

    >>> check_act_scale(mx.array([0.25]))
    0.25
    >>> check_act_scale(0.0)
    Traceback (most recent call last):
    ...
    mlx_lattice._errors.MlxLatticeError: act_scale must be one finite value > 0 (a static activation scale), got 0.0.
    """
    if isinstance(scale, bool | str | bytes):
        raise MlxLatticeTypeError(f"{name} must be a number or a one-element array, got {scale!r}.")
    if hasattr(scale, "shape") and hasattr(scale, "tolist"):  # mx.array / np.ndarray
        size = math.prod(int(d) for d in scale.shape)
        if size != 1:
            raise MlxLatticeError(
                f"{name} must be one value (per-tensor static scale), got shape "
                f"{tuple(int(d) for d in scale.shape)}."
            )
        scale = scale.reshape(-1).tolist()[0]
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise MlxLatticeTypeError(f"{name} must be a number or a one-element array, got {scale!r}.") from None
    # The kernel works in float32: the value must stay finite and > 0 there.
    value32 = float(mx.array(value, dtype=mx.float32).item()) if math.isfinite(value) else value
    if not (math.isfinite(value32) and value32 > 0):
        raise MlxLatticeError(
            f"{name} must be one finite value > 0 (a static activation scale), got {value!r}."
        )
    return value32


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A convolution weight quantized per kernel offset in ``mx.quantize``'s layout.

    ``weight`` is uint32 ``(K, Cout, storage_in_channels * bits / 32)``;
    ``scales`` and ``biases`` are ``(K, Cout, storage_in_channels / group_size)``.
    Each offset's ``(Cout, Cin)`` matrix is quantized along ``Cin`` in groups;
    ``Cin`` is zero-padded to ``storage_in_channels`` (a multiple of
    ``group_size``). A value dequantizes to ``scale * q + bias``.

    >>> w = mx.random.normal((27, 16, 8))
    >>> qw = QuantizedWeight.from_float(w, bits=8, group_size=32)
    >>> (qw.in_channels, qw.out_channels, qw.storage_in_channels, qw.weight.shape)
    (16, 8, 32, (27, 8, 8))
    >>> bool(mx.abs(qw.dequantize() - w).max() < 0.05)
    True
    """

    weight: mx.array
    scales: mx.array
    biases: mx.array
    in_channels: int
    out_channels: int
    storage_in_channels: int
    group_size: int
    bits: int
    #: ``8``: convolutions with this weight quantize their input rows to int8
    #: and run the integer kernel (see ``sparse_quantized_conv_features_from_relation``).
    act_bits: int | None = None
    #: With ``act_bits=8``: one static activation scale for every input row
    #: (``None``: a dynamic scale per row). See :func:`check_act_scale`.
    act_scale: float | None = None

    def __post_init__(self) -> None:
        if self.act_bits not in (None, 8):
            raise MlxLatticeError(f"act_bits must be None or 8, got {self.act_bits!r}.")
        if self.act_scale is not None:
            if self.act_bits != 8:
                raise MlxLatticeError("act_scale (a static activation scale) needs act_bits=8.")
            object.__setattr__(self, "act_scale", check_act_scale(self.act_scale))
        if self.bits not in SUPPORTED_BITS:
            raise MlxLatticeError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}.")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise MlxLatticeError(
                f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {self.group_size}."
            )
        if (
            self.storage_in_channels % self.group_size
            or self.storage_in_channels < self.in_channels
        ):
            raise MlxLatticeError(
                "storage_in_channels must be a multiple of group_size and >= in_channels, got "
                f"{self.storage_in_channels} (group_size {self.group_size}, in_channels {self.in_channels})."
            )
        n_kernels = int(self.weight.shape[0]) if self.weight.ndim == 3 else -1
        expected = (n_kernels, self.out_channels, self.storage_in_channels * self.bits // 32)
        if self.weight.dtype != mx.uint32 or tuple(self.weight.shape) != expected:
            raise MlxLatticeError(
                f"weight must be uint32 of shape {expected}, got {self.weight.dtype} {tuple(self.weight.shape)}."
            )
        groups = (n_kernels, self.out_channels, self.storage_in_channels // self.group_size)
        if tuple(self.scales.shape) != groups or tuple(self.biases.shape) != groups:
            raise MlxLatticeError(
                f"scales and biases must have shape {groups}, got {tuple(self.scales.shape)} "
                f"and {tuple(self.biases.shape)}."
            )

    @property
    def n_kernels(self) -> int:
        """Number of kernel offsets K."""
        return int(self.weight.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight, scales and biases."""
        return int(self.weight.nbytes + self.scales.nbytes + self.biases.nbytes)

    @classmethod
    def from_float(
        cls,
        weight: mx.array,
        *,
        bits: int = 4,
        group_size: int = 64,
        dtype: mx.Dtype | None = None,
    ) -> QuantizedWeight:
        """Quantize a float weight ``(K, Cin, Cout)`` or ``(Cout, kx, ky, kz, Cin)``.

        ``dtype`` sets the scales' dtype (default: the weight's float dtype).
        """
        if bits not in SUPPORTED_BITS:
            raise MlxLatticeError(f"bits must be one of {SUPPORTED_BITS}, got {bits}.")
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise MlxLatticeError(
                f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}."
            )
        if not mx.issubdtype(weight.dtype, mx.floating):
            raise MlxLatticeTypeError(f"weight must be floating, got {weight.dtype}.")
        mapped = mapped_conv_weight(weight, cache=False)
        _, cin, cout = (int(d) for d in mapped.shape)
        storage = -(-cin // group_size) * group_size
        per_offset = mapped.transpose(0, 2, 1)  # (K, Cout, Cin)
        if storage != cin:
            per_offset = mx.pad(per_offset, [(0, 0), (0, 0), (0, storage - cin)])
        per_offset = per_offset.astype(dtype or weight.dtype)
        packed, scales, biases = mx.quantize(per_offset, group_size=group_size, bits=bits)
        return cls(packed, scales, biases, cin, cout, storage, group_size, bits)

    def dequantize(self) -> mx.array:
        """The float weight ``(K, Cin, Cout)`` these values stand for."""
        full = mx.dequantize(
            self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits
        )
        return full[:, :, : self.in_channels].transpose(0, 2, 1)


# Float32 copies of half-precision scales and biases, per array value.
_FLOAT32_SCALES_CACHE: dict[int, _CacheEntry] = {}


def _to_float32(a: mx.array) -> mx.array:
    return a.astype(mx.float32)


def with_float32_scales(weight: QuantizedWeight) -> QuantizedWeight:
    """``weight`` with float32 scales and biases, converted once per value.

    The native op takes float32 scales and caches each weight's dequantized
    values under the identity of the buffers it is given: converting on
    every call would hand it new buffers (and miss its cache) every time.
    """
    if weight.scales.dtype == mx.float32 and weight.biases.dtype == mx.float32:
        return weight
    return dataclasses.replace(
        weight,
        scales=cached_per_value(_FLOAT32_SCALES_CACHE, weight.scales, _to_float32),
        biases=cached_per_value(_FLOAT32_SCALES_CACHE, weight.biases, _to_float32),
    )
