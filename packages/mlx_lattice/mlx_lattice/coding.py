"""Entropy coding for point-cloud compression: rANS, range coding, octrees.

Lossless coders of integer symbols, in native code (the GIL is released
while a stream is coded):

* :func:`rans_encode` / :func:`rans_decode` and :func:`range_encode` /
  :func:`range_decode` code every symbol under one probability table;
* :func:`encode_with_cdfs` / :func:`decode_with_cdfs` code each symbol under
  its own integer CDF row (the tables compression models such as
  CompressAI's entropy bottlenecks produce), with either coder;
* :func:`encode_occupancy` / :func:`decode_occupancy` code a voxel set as an
  octree: one 8-bit occupancy symbol per node, level by level, under an
  adaptive frequency table.

Probabilities are quantized to :data:`PRECISION_BITS` (16) bits: integer
frequencies summing to ``2**16`` (:func:`quantize_probabilities`), every
symbol of nonzero probability getting at least 1. Coded sizes are within a
fraction of a percent of the Shannon bound of that *quantized* table on
long inputs (see ``docs/topics/entropy_coding.rst`` for the stream formats).

Every stream ends with a CRC-32 of what precedes it, so truncated or altered
streams raise :class:`CodingError` instead of decoding to other symbols;
the native decoders check every byte and table index on their own as well.

>>> import numpy as np
>>> probs = np.array([0.5, 0.25, 0.125, 0.125])
>>> symbols = np.array([0, 1, 0, 3, 2, 0, 0, 1])
>>> data = rans_encode(symbols, probs)
>>> rans_decode(data, probs, len(symbols)).tolist()
[0, 1, 0, 3, 2, 0, 0, 1]
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

import numpy as np

__all__ = [
    "PRECISION_BITS",
    "CodingError",
    "decode_occupancy",
    "decode_with_cdfs",
    "encode_occupancy",
    "encode_with_cdfs",
    "quantize_probabilities",
    "range_decode",
    "range_encode",
    "rans_decode",
    "rans_encode",
]

#: Bits of the coders' probability precision: frequencies sum to ``2**16``.
PRECISION_BITS = 16

Method = Literal["rans", "range"]
T = TypeVar("T")
ArrayLike = np.ndarray | Sequence[int] | Sequence[float]


class CodingError(ValueError):
    """An entropy coder got an invalid argument or stream (the message names it)."""


def _ext():
    from mlx_lattice._native import ext

    return ext


def _native(fn: Callable[..., T], *args: object) -> T:
    try:
        return fn(*args)
    except ValueError as err:  # the extension's std::invalid_argument
        raise CodingError(str(err)) from None


def _frame(payload: bytes) -> bytes:
    return payload + zlib.crc32(payload).to_bytes(4, "little")


def _unframe(data: bytes | bytearray | memoryview) -> bytes:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodingError(f"data must be bytes, got {type(data).__name__}.")
    data = bytes(data)
    if len(data) < 4:
        raise CodingError(f"data: corrupt stream (only {len(data)} bytes, no checksum).")
    payload, crc = data[:-4], int.from_bytes(data[-4:], "little")
    if zlib.crc32(payload) != crc:
        raise CodingError("data: corrupt stream (checksum mismatch: truncated or altered).")
    return payload


def _int_vector(values: ArrayLike, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise CodingError(f"{name} must be 1-D, got shape {arr.shape}.")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise CodingError(f"{name} must hold integers, got dtype {arr.dtype}.")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise CodingError(f"{name} has entries beyond int64.")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _count(n: int, name: str = "n") -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer):
        raise CodingError(f"{name} must be an int, got {type(n).__name__}.")
    if n < 0:
        raise CodingError(f"{name} must be >= 0, got {n}.")
    return int(n)


def _method(method: str) -> str:
    if method not in ("rans", "range"):
        raise CodingError(f"method must be 'rans' or 'range', got {method!r}.")
    return method


def quantize_probabilities(probs: ArrayLike, *, precision: int = PRECISION_BITS) -> np.ndarray:
    """Integer frequencies summing to ``2**precision`` from ``probs``.

    ``probs`` is any 1-D array of finite non-negative numbers with a positive
    sum (normalised here; counts work too). Every nonzero entry gets a
    frequency of at least 1 and zero entries get 0; the rounding remainder
    goes, one unit at a time, where it costs the fewest expected bits (ties to
    the lower index). These are the frequencies the table coders use.

    >>> quantize_probabilities([0.5, 0.25, 0.25, 0.0]).tolist()
    [32768, 16384, 16384, 0]
    >>> quantize_probabilities([1.0, 1e-12]).tolist()
    [65535, 1]
    """
    if isinstance(precision, bool) or not isinstance(precision, int):
        raise CodingError(f"precision must be an int, got {type(precision).__name__}.")
    arr = np.asarray(probs)
    if arr.ndim != 1:
        raise CodingError(f"probs must be 1-D, got shape {arr.shape}.")
    if arr.size and not (
        np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
    ):
        raise CodingError(f"probs must hold numbers, got dtype {arr.dtype}.")
    arr = np.ascontiguousarray(arr, dtype=np.float64)
    return _native(_ext().entropy_quantize_probabilities, arr, precision)


def _encode_table(method: str, symbols: ArrayLike, probs: ArrayLike) -> bytes:
    freqs = quantize_probabilities(probs)
    syms = _int_vector(symbols, "symbols")
    return _frame(_native(_ext().entropy_encode_table, method, syms, freqs, PRECISION_BITS))


def _decode_table(method: str, data: bytes, probs: ArrayLike, n: int) -> np.ndarray:
    n = _count(n)
    freqs = quantize_probabilities(probs)
    payload = _unframe(data)
    return _native(_ext().entropy_decode_table, method, payload, freqs, PRECISION_BITS, n)


def rans_encode(symbols: ArrayLike, probs: ArrayLike) -> bytes:
    """rANS stream of ``symbols`` (ints in ``[0, len(probs))``) under ``probs``.

    ``probs`` is quantized with :func:`quantize_probabilities`; a symbol whose
    probability is 0 raises :class:`CodingError` naming its index. The
    stream is 4 bytes of rANS state, the renormalisation bytes and a CRC-32.

    >>> data = rans_encode([2, 2, 0], [0.25, 0.25, 0.5])
    >>> rans_decode(data, [0.25, 0.25, 0.5], 3).tolist()
    [2, 2, 0]
    """
    return _encode_table("rans", symbols, probs)


def rans_decode(data: bytes, probs: ArrayLike, n: int) -> np.ndarray:
    """The ``n`` symbols (int32) of a :func:`rans_encode` stream under the
    same ``probs``. A truncated or altered stream raises :class:`CodingError`.

    >>> rans_decode(rans_encode([1, 0], [1, 1]), [1, 1], 2).tolist()
    [1, 0]
    """
    return _decode_table("rans", data, probs, n)


def range_encode(symbols: ArrayLike, probs: ArrayLike) -> bytes:
    """Range-coder stream of ``symbols`` under ``probs`` (as :func:`rans_encode`).

    >>> data = range_encode([3, 0, 1], [0.1, 0.2, 0.3, 0.4])
    >>> range_decode(data, [0.1, 0.2, 0.3, 0.4], 3).tolist()
    [3, 0, 1]
    """
    return _encode_table("range", symbols, probs)


def range_decode(data: bytes, probs: ArrayLike, n: int) -> np.ndarray:
    """The ``n`` symbols (int32) of a :func:`range_encode` stream.

    >>> range_decode(range_encode([0, 0, 1], [3, 1]), [3, 1], 3).tolist()
    [0, 0, 1]
    """
    return _decode_table("range", data, probs, n)


def _cdf_args(
    cdfs: np.ndarray, indexes: ArrayLike | None, precision: int, method: str
) -> tuple[np.ndarray, np.ndarray | None]:
    _method(method)
    if isinstance(precision, bool) or not isinstance(precision, int):
        raise CodingError(f"precision must be an int, got {type(precision).__name__}.")
    arr = np.asarray(cdfs)
    if arr.ndim != 2:
        raise CodingError(f"cdfs must be 2-D (rows, alphabet + 1), got shape {arr.shape}.")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise CodingError(f"cdfs must hold integers, got dtype {arr.dtype}.")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise CodingError("cdfs has entries beyond int32.")
    arr = np.ascontiguousarray(arr, dtype=np.int32)
    idx = None if indexes is None else _int_vector(indexes, "indexes")
    return arr, idx


def encode_with_cdfs(
    symbols: ArrayLike,
    cdfs: np.ndarray,
    *,
    indexes: ArrayLike | None = None,
    precision: int = PRECISION_BITS,
    method: Method = "rans",
) -> bytes:
    """Stream of ``symbols``, symbol ``i`` coded under CDF row ``indexes[i]``
    (row ``i`` when ``indexes`` is None).

    ``cdfs`` is an integer ``(rows, S + 1)`` table: each row starts at 0,
    never decreases and ends at ``2**precision`` (``precision`` <= 16), so
    symbol ``s`` has frequency ``cdf[s + 1] - cdf[s]``. Shorter alphabets pad
    their rows with ``2**precision`` (zero-probability tail). A symbol outside
    ``[0, S)`` or of zero frequency raises :class:`CodingError` naming it.

    >>> cdfs = np.array([[0, 1 << 15, 1 << 16], [0, 1 << 14, 1 << 16]])
    >>> data = encode_with_cdfs([1, 0, 1], cdfs, indexes=[0, 1, 1])
    >>> decode_with_cdfs(data, cdfs, indexes=[0, 1, 1]).tolist()
    [1, 0, 1]
    """
    arr, idx = _cdf_args(cdfs, indexes, precision, method)
    syms = _int_vector(symbols, "symbols")
    if idx is not None and len(idx) != len(syms):
        raise CodingError(f"indexes must have one entry per symbol ({len(syms)}), got {len(idx)}.")
    payload = _native(_ext().entropy_encode_cdfs, method, syms, arr, idx, precision)
    return _frame(payload)


def decode_with_cdfs(
    data: bytes,
    cdfs: np.ndarray,
    *,
    indexes: ArrayLike | None = None,
    precision: int = PRECISION_BITS,
    method: Method = "rans",
) -> np.ndarray:
    """The symbols (int32) of an :func:`encode_with_cdfs` stream: one per
    entry of ``indexes``, or one per row of ``cdfs`` when ``indexes`` is None.

    >>> cdfs = np.array([[0, 40000, 65536]] * 4)
    >>> decode_with_cdfs(encode_with_cdfs([0, 1, 1, 0], cdfs), cdfs).tolist()
    [0, 1, 1, 0]
    """
    arr, idx = _cdf_args(cdfs, indexes, precision, method)
    n = arr.shape[0] if idx is None else len(idx)
    payload = _unframe(data)
    return _native(_ext().entropy_decode_cdfs, method, payload, arr, idx, n, precision)


def encode_occupancy(coords: np.ndarray) -> bytes:
    """Octree occupancy stream of a voxel set.

    ``coords`` is ``(N, 3)`` (x, y, z) or ``(N, 4)`` (batch, x, y, z)
    integers within int32; duplicate rows are coded once. Per batch the
    stream keeps the smallest corner and the octree depth (the bits of the
    largest extent), then, level by level from the root, each node's 8-bit
    child occupancy under an adaptive frequency table.

    >>> coords = np.array([[0, 0, 0], [1, 0, 0], [5, 7, 2], [1, 0, 0]])
    >>> decode_occupancy(encode_occupancy(coords)).tolist()
    [[0, 0, 0], [1, 0, 0], [5, 7, 2]]
    """
    arr = np.asarray(coords)
    if arr.ndim != 2 or arr.shape[1] not in (3, 4):
        raise CodingError(f"coords must be (N, 3) or (N, 4), got shape {arr.shape}.")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise CodingError(f"coords must hold integers, got dtype {arr.dtype}.")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise CodingError("coords has entries beyond int32.")
    arr = np.ascontiguousarray(arr, dtype=np.int32)
    return _frame(_native(_ext().entropy_encode_occupancy, arr))


def decode_occupancy(data: bytes) -> np.ndarray:
    """The voxel set of an :func:`encode_occupancy` stream: unique int32
    rows, sorted lexicographically, with the input's 3 or 4 columns.

    >>> batched = np.array([[1, 4, 4, 4], [0, 2, 3, 1], [1, 0, 0, 0]])
    >>> decode_occupancy(encode_occupancy(batched)).tolist()
    [[0, 2, 3, 1], [1, 0, 0, 0], [1, 4, 4, 4]]
    """
    return _native(_ext().entropy_decode_occupancy, _unframe(data))
