"""mlx_lattice.coding against pure-Python coders written here.

The references implement the documented algorithms (rANS with a 32-bit
state and byte renormalisation; the LZMA-style range coder) over the same
quantized tables, so byte streams must match exactly. Sizes are checked
against the Shannon bound of the quantized table; the octree coder against
NumPy's unique rows and a count of the octree's nodes.
"""

from __future__ import annotations

import itertools
import math
import zlib

import numpy as np
import pytest

from mlx_lattice import coding
from mlx_lattice._native import ext
from mlx_lattice.coding import CodingError

M = 1 << coding.PRECISION_BITS

# ---- pure-Python references ---------------------------------------------------------------


def rans_ref(symbols, starts, freqs, bits=16) -> bytes:
    """rANS, 32-bit state in [2^23, 2^31), byte renormalisation, last symbol first.

    starts/freqs are per-symbol sequences (one entry per coded symbol)."""
    low = 1 << 23
    x = low
    emitted = []
    for i in reversed(range(len(symbols))):
        s, f = starts[i], freqs[i]
        x_max = ((low >> bits) << 8) * f
        while x >= x_max:
            emitted.append(x & 0xFF)
            x >>= 8
        x = (x // f << bits) + x % f + s
    return x.to_bytes(4, "little") + bytes(reversed(emitted))


def range_ref(starts, freqs, bits=16) -> bytes:
    """The LZMA range coder: 64-bit low, 32-bit range >= 2^24, cached carry byte."""
    low, rng, cache, pending = 0, 0xFFFFFFFF, 0, 1
    out = bytearray()

    def shift_low():
        nonlocal low, cache, pending
        if (low & 0xFFFFFFFF) < 0xFF000000 or (low >> 32) != 0:
            carry = low >> 32
            byte = cache
            while True:
                out.append((byte + carry) & 0xFF)
                byte = 0xFF
                pending -= 1
                if pending == 0:
                    break
            cache = (low >> 24) & 0xFF
        pending += 1
        low = (low & 0x00FFFFFF) << 8

    for s, f in zip(starts, freqs, strict=True):
        r = rng >> bits
        low += r * s
        rng = r * f
        while rng < (1 << 24):
            rng <<= 8
            shift_low()
    for _ in range(5):
        shift_low()
    return bytes(out)


def table_intervals(symbols, freqs):
    cdf = np.concatenate([[0], np.cumsum(freqs)])
    return [int(cdf[s]) for s in symbols], [int(freqs[s]) for s in symbols]


def attempt(fn, *args) -> tuple[object, str]:
    """(result, "") or (None, the ValueError's message) of fn(*args)."""
    try:
        return fn(*args), ""
    except ValueError as err:
        return None, str(err)


def payload(data: bytes) -> bytes:
    assert int.from_bytes(data[-4:], "little") == zlib.crc32(data[:-4])
    return data[:-4]


def info_bits(symbols, freqs, bits=16) -> float:
    """Σ -log2 q(s): the sequence's exact information under the quantized table."""
    counts = np.bincount(symbols, minlength=len(freqs))
    used = counts > 0
    return float(np.sum(counts[used] * (bits - np.log2(freqs[used].astype(np.float64)))))


def entropy_bits(freqs, bits=16) -> float:
    q = freqs[freqs > 0].astype(np.float64) / (1 << bits)
    return float(-np.sum(q * np.log2(q)))


ENCODERS = {
    "rans": (coding.rans_encode, coding.rans_decode),
    "range": (coding.range_encode, coding.range_decode),
}


def adversarial_tables(rng: np.random.Generator) -> dict[str, np.ndarray]:
    dirichlet = rng.dirichlet(np.full(256, 0.3))
    skewed = np.array([1.0] + [1e-9] * 50)
    zeros = rng.random(40) * (rng.random(40) < 0.4)
    zeros[3] = 0.5
    return {
        "one_symbol": np.array([2.5]),
        "one_nonzero_among_zeros": np.array([0.0, 0.0, 7.0, 0.0]),
        "dirichlet_256": dirichlet,
        "tiny_tail": skewed,
        "denormal": np.array([1.0, 5e-324, 1e-300]),
        "uniform_65536": np.ones(M),
        "zeros_mixed": zeros,
        "counts": np.array([1, 1000, 3, 0, 12], dtype=np.int64),
        "two_equal": np.array([1.0, 1.0]),
    }


# ---- quantization -------------------------------------------------------------------------


def test_quantize_properties(rng: np.random.Generator) -> None:
    for name, probs in adversarial_tables(rng).items():
        f = coding.quantize_probabilities(probs)
        assert f.dtype == np.uint32, name
        assert int(f.sum()) == M, name
        assert np.array_equal(f > 0, probs > 0), name
        p = probs / probs.sum()
        # Only the floor of 1 for rare symbols pulls an entry far from p * M.
        big = p * M > 2 * np.count_nonzero(p)
        assert np.all(np.abs(f[big] - p[big] * M) <= 1 + np.count_nonzero(p) * 1.0), name


def test_quantize_matches_brute_force_optimum(rng: np.random.Generator) -> None:
    """At 4 bits the cross-entropy of the greedy table equals the best of
    every allocation with nonzero entries >= 1 (exhaustive search)."""
    bits = 4
    for _ in range(40):
        k = int(rng.integers(1, 5))
        p = rng.random(k) ** 3 + 1e-3
        p /= p.sum()
        f = coding.quantize_probabilities(p, precision=bits)
        cost = float(-np.sum(p * np.log2(f)))
        best = min(
            float(-np.sum(p * np.log2(np.array(c, dtype=np.float64))))
            for c in itertools.product(range(1, (1 << bits) + 1), repeat=k)
            if sum(c) == 1 << bits
        )
        assert cost == pytest.approx(best, rel=0, abs=1e-12), (p, f)


@pytest.mark.parametrize(
    ("probs", "match"),
    [
        ([], "at least one entry"),
        ([0.0, 0.0], "positive sum"),
        ([0.5, -0.1], r"probs\[1\]"),
        ([0.5, float("nan")], r"probs\[1\]"),
        ([1.0, float("inf")], r"probs\[1\]"),
        ([[0.5, 0.5]], "1-D"),
        (["a", "b"], "numbers"),
    ],
)
def test_quantize_rejects(probs, match) -> None:
    with pytest.raises(CodingError, match=match):
        coding.quantize_probabilities(probs)


def test_quantize_rejects_too_many_symbols_and_bad_precision() -> None:
    with pytest.raises(CodingError, match="65537 nonzero entries"):
        coding.quantize_probabilities(np.ones(M + 1))
    with pytest.raises(CodingError, match="precision"):
        coding.quantize_probabilities([1.0], precision=17)
    with pytest.raises(CodingError, match="precision"):
        coding.quantize_probabilities([1.0], precision=0)


# ---- one table ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["rans", "range"])
def test_table_streams_match_reference(method: str, rng: np.random.Generator) -> None:
    encode, decode = ENCODERS[method]
    for name, probs in adversarial_tables(rng).items():
        freqs = coding.quantize_probabilities(probs)
        support = np.flatnonzero(freqs)
        n = 3000
        # Draw from the table, then force the rarest symbol in a few places.
        q = freqs[support] / M
        symbols = support[rng.choice(len(support), n, p=q)]
        symbols[rng.integers(0, n, 5)] = support[np.argmin(freqs[support])]
        data = encode(symbols, probs)
        starts, fr = table_intervals(symbols, freqs)
        expected = rans_ref(symbols, starts, fr) if method == "rans" else range_ref(starts, fr)
        assert payload(data) == expected, name
        out = decode(data, probs, n)
        assert out.dtype == np.int32
        assert np.array_equal(out, symbols), name


@pytest.mark.parametrize("method", ["rans", "range"])
def test_table_empty_and_single(method: str) -> None:
    encode, decode = ENCODERS[method]
    for symbols in ([], [0], [1]):
        data = encode(np.array(symbols, dtype=np.int64), [0.5, 0.5])
        assert decode(data, [0.5, 0.5], len(symbols)).tolist() == symbols
    # A one-symbol alphabet costs no bytes beyond the coder's fixed state.
    one = encode(np.zeros(100_000, dtype=np.int64), [1.0])
    assert len(one) == (4 if method == "rans" else 5) + 4
    assert np.array_equal(decode(one, [1.0], 100_000), np.zeros(100_000))


@pytest.mark.parametrize("method", ["rans", "range"])
def test_shannon_bound(method: str, rng: np.random.Generator) -> None:
    """10^6 symbols drawn from the quantized table code within 1% of
    n * H(q), and within 10^-3 bits per symbol (+ 64 bits of final state) of
    the sequence's own information: the range coder's interval truncation
    (range // 2^16 with range >= 2^24) loses at most log2(1 + 2^-8) bits on
    a symbol and about 6 * 10^-4 on average; rANS loses less."""
    encode, _ = ENCODERS[method]
    n = 1_000_000
    tables = {
        "dirichlet_256": rng.dirichlet(np.full(256, 0.5)),
        "geometric_64": 0.7 ** np.arange(64),
        "skewed_binary": np.array([0.97, 0.03]),
    }
    for name, probs in tables.items():
        freqs = coding.quantize_probabilities(probs)
        symbols = rng.choice(len(freqs), n, p=freqs / M)
        bits = 8 * len(payload(encode(symbols, probs)))
        shannon = n * entropy_bits(freqs)
        info = info_bits(symbols, freqs)
        assert bits <= 1.01 * shannon, (name, bits / shannon)
        assert info - 64 <= bits <= info + 1e-3 * n + 64, (name, (bits - info) / n)


@pytest.mark.parametrize("method", ["rans", "range"])
def test_table_rejects_bad_symbols(method: str) -> None:
    encode, decode = ENCODERS[method]
    probs = [0.5, 0.0, 0.5]
    with pytest.raises(CodingError, match=r"symbols\[2\] = 1 has zero probability"):
        encode([0, 2, 1, 0], probs)
    with pytest.raises(CodingError, match=r"symbols\[1\] = 3 is outside the alphabet \[0, 3\)"):
        encode([0, 3], probs)
    with pytest.raises(CodingError, match=r"symbols\[0\] = -1"):
        encode([-1], probs)
    with pytest.raises(CodingError, match="integers"):
        encode([0.5], probs)
    with pytest.raises(CodingError, match="n must be >= 0"):
        decode(encode([0], probs), probs, -1)


@pytest.mark.parametrize("method", ["rans", "range"])
def test_table_rejects_truncated_and_altered(method: str, rng: np.random.Generator) -> None:
    encode, decode = ENCODERS[method]
    probs = rng.dirichlet(np.ones(16))
    symbols = rng.choice(16, 2000, p=probs)
    data = encode(symbols, probs)
    for cut in (0, 3, len(data) // 2, len(data) - 1):
        with pytest.raises(CodingError, match="corrupt"):
            decode(data[:cut], probs, len(symbols))
    for _ in range(50):
        bad = bytearray(data)
        bad[int(rng.integers(len(bad)))] ^= 1 << int(rng.integers(8))
        with pytest.raises(CodingError, match="corrupt"):
            decode(bytes(bad), probs, len(symbols))
    with pytest.raises(CodingError, match="bytes"):
        decode("text", probs, 1)


@pytest.mark.parametrize("method", ["rans", "range"])
def test_native_decoders_never_overrun(method: str, rng: np.random.Generator) -> None:
    """Without the checksum the native decoders see mutated, truncated and
    random streams: each raises ValueError or returns in-alphabet symbols."""
    freqs = coding.quantize_probabilities(rng.dirichlet(np.ones(9)))
    symbols = rng.choice(9, 500, p=freqs / M)
    good = ext.entropy_encode_table(method, symbols.astype(np.int64), freqs, 16)
    raised = 0
    for trial in range(400):
        bad = bytearray(good)
        if trial % 4 == 0:
            bad = bad[: int(rng.integers(len(bad)))]
        elif trial % 4 == 1:
            bad = bytearray(rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8))
        else:
            for _ in range(int(rng.integers(1, 4))):
                bad[int(rng.integers(len(bad)))] = int(rng.integers(256))
        out, error = attempt(ext.entropy_decode_table, method, bytes(bad), freqs, 16, len(symbols))
        if out is None:
            assert "corrupt" in error
            raised += 1
        else:
            assert len(out) == len(symbols) and np.all(freqs[out] > 0)
    assert raised > 300  # most mutations are caught even without a checksum


def test_native_table_validation() -> None:
    bad_sum = np.array([1, 2, 3], dtype=np.uint32)
    with pytest.raises(ValueError, match="sum to 2"):
        ext.entropy_encode_table("rans", np.zeros(1, np.int64), bad_sum, 16)
    with pytest.raises(ValueError, match="sum to 2"):
        ext.entropy_decode_table("range", b"\0" * 8, bad_sum, 16, 1)
    with pytest.raises(ValueError, match="method"):
        ext.entropy_decode_table("huffman", b"\0" * 8, bad_sum, 16, 1)


# ---- CDF rows -----------------------------------------------------------------------------


def cdf_table(rng: np.random.Generator, rows: int, alphabet: int, bits: int) -> np.ndarray:
    """Rows as a compression model's quantized CDFs: some zero-width symbols,
    short alphabets padded with the top value."""
    out = np.empty((rows, alphabet + 1), dtype=np.int32)
    for r in range(rows):
        k = int(rng.integers(1, alphabet + 1))
        f = coding.quantize_probabilities(
            rng.dirichlet(np.full(k, 0.4)) * (rng.random(k) < 0.8) + 1e-3 * (np.arange(k) == 0),
            precision=bits,
        )
        out[r, 0] = 0
        out[r, 1 : k + 1] = np.cumsum(f)
        out[r, k + 1 :] = 1 << bits
    return out


@pytest.mark.parametrize("method", ["rans", "range"])
@pytest.mark.parametrize("bits", [16, 12, 1])
def test_cdf_streams_match_reference(method: str, bits: int, rng: np.random.Generator) -> None:
    alphabet = 2 if bits == 1 else 12
    cdfs = cdf_table(rng, 30, alphabet, bits)
    n = 2000
    indexes = rng.integers(0, len(cdfs), n)
    symbols = np.empty(n, dtype=np.int64)
    for i, r in enumerate(indexes):
        widths = np.diff(cdfs[r])
        symbols[i] = rng.choice(alphabet, p=widths / widths.sum())
    starts = [int(cdfs[r, s]) for r, s in zip(indexes, symbols, strict=True)]
    freqs = [int(cdfs[r, s + 1] - cdfs[r, s]) for r, s in zip(indexes, symbols, strict=True)]
    data = coding.encode_with_cdfs(symbols, cdfs, indexes=indexes, precision=bits, method=method)
    expected = (
        rans_ref(symbols, starts, freqs, bits)
        if method == "rans"
        else range_ref(starts, freqs, bits)
    )
    assert payload(data) == expected
    out = coding.decode_with_cdfs(data, cdfs, indexes=indexes, precision=bits, method=method)
    assert np.array_equal(out, symbols)
    # One row per symbol (no indexes) is the same stream.
    per_row = coding.encode_with_cdfs(symbols, cdfs[indexes], precision=bits, method=method)
    assert per_row == data
    assert np.array_equal(
        coding.decode_with_cdfs(per_row, cdfs[indexes], precision=bits, method=method), symbols
    )


def test_cdf_rejects_bad_tables_and_symbols() -> None:
    good = np.array([[0, 100, 65536], [0, 65536, 65536]])
    cases = [
        (np.array([[1, 100, 65536]]), [0], None, r"cdfs\[0, 0\] must be 0"),
        (np.array([[0, 100, 65535]]), [0], None, r"cdfs\[0, 2\] must be 2\^16"),
        (np.array([[0, 700, 600, 65536]]), [0], None, r"cdfs\[0, 2\] = 600 is below"),
        (np.array([[0]]), [0], None, "at least 2 columns"),
        (good, [1, 0, 0], [0, 2, 1], r"indexes\[1\] = 2 is outside \[0, 2\)"),
        (good, [0, 1], [0, 1], r"symbols\[1\] = 1 has zero probability in cdfs row 1"),
        (good, [0, 2], [0, 1], r"symbols\[1\] = 2 is outside the alphabet \[0, 2\)"),
        (good, [0, 1, 0], None, "one row per symbol"),
        (good, [0], [0, 1], "one entry per symbol"),
        (np.array([0, 65536]), [0], None, "2-D"),
        (good.astype(np.float32), [0, 0], None, "integers"),
    ]
    for cdfs, symbols, indexes, match in cases:
        with pytest.raises(CodingError, match=match):
            coding.encode_with_cdfs(symbols, cdfs, indexes=indexes)
    with pytest.raises(CodingError, match="method"):
        coding.encode_with_cdfs([0], good[:1], method="huffman")
    with pytest.raises(CodingError, match="precision"):
        coding.encode_with_cdfs([0], good[:1], precision=20)
    data = coding.encode_with_cdfs([0, 0], good)
    with pytest.raises(CodingError, match=r"indexes\[0\] = -1"):
        coding.decode_with_cdfs(data, good, indexes=[-1, 0])
    with pytest.raises(CodingError, match="corrupt"):
        coding.decode_with_cdfs(data[:-1], good)


@pytest.mark.parametrize("method", ["rans", "range"])
def test_native_cdf_decoders_never_overrun(method: str, rng: np.random.Generator) -> None:
    cdfs = cdf_table(rng, 8, 6, 16)
    idx = rng.integers(0, 8, 300).astype(np.int64)
    symbols = np.array([int(np.argmax(np.diff(cdfs[r]))) for r in idx], dtype=np.int64)
    good = ext.entropy_encode_cdfs(method, symbols, cdfs, idx, 16)
    for _ in range(300):
        bad = bytearray(good)
        bad[int(rng.integers(len(bad)))] = int(rng.integers(256))
        bad = bad[: int(rng.integers(len(bad) // 2, len(bad) + 1))]
        out, error = attempt(ext.entropy_decode_cdfs, method, bytes(bad), cdfs, idx, len(idx), 16)
        if out is None:
            assert "corrupt" in error
        else:
            widths = np.diff(cdfs, axis=1)
            assert np.all(widths[idx, out] > 0)


# ---- occupancy ----------------------------------------------------------------------------


def octree_bytes(coords: np.ndarray) -> list[np.ndarray]:
    """Each batch's and level's occupancy bytes (nodes in lexicographic
    order, bit 4 * bx + 2 * by + bz per child), from NumPy's unique rows of
    the shifted coordinates."""
    levels = []
    for b in np.unique(coords[:, 0]):
        xyz = coords[coords[:, 0] == b, 1:].astype(np.int64)
        xyz = xyz - xyz.min(axis=0)
        depth = int(xyz.max()).bit_length()
        for level in range(depth):
            children = np.unique(xyz >> (depth - 1 - level), axis=0)
            parents, owner = np.unique(children >> 1, axis=0, return_inverse=True)
            bit = (children & 1) @ np.array([4, 2, 1])
            occ = np.zeros(len(parents), np.int64)
            np.bitwise_or.at(occ, owner.reshape(-1), 1 << bit)
            levels.append(occ)
    return levels


def test_occupancy_round_trip(rng: np.random.Generator) -> None:
    i32 = np.iinfo(np.int32)
    cases = {
        "empty3": np.zeros((0, 3), np.int32),
        "empty4": np.zeros((0, 4), np.int32),
        "single": np.array([[5, -7, 9]]),
        "duplicates": np.array([[1, 2, 3], [1, 2, 3], [0, 0, 0]]),
        "extremes": np.array([[i32.min, i32.max, 0], [i32.max, i32.min, -1], [0, 0, 0]]),
        "dense_cube": np.stack(np.meshgrid(*[np.arange(6)] * 3, indexing="ij"), -1).reshape(-1, 3),
        "random3": rng.integers(-500, 500, (3000, 3)),
        "batched": np.concatenate(
            [rng.integers(0, 4, (4000, 1)), rng.integers(-50, 60, (4000, 3))], axis=1
        ),
        "batch_one_point": np.array([[3, 1, 1, 1], [-2, 0, 0, 0], [-2, 9, 9, 9]]),
    }
    for name, coords in cases.items():
        data = coding.encode_occupancy(coords)
        out = coding.decode_occupancy(data)
        expected = np.unique(np.asarray(coords, dtype=np.int64), axis=0).reshape(
            -1, coords.shape[1]
        )
        assert out.dtype == np.int32, name
        assert out.shape == expected.shape, name
        assert np.array_equal(out, expected), name


def test_occupancy_size_on_a_scan() -> None:
    """On the built-in LiDAR scan the adaptive, neighbour-context coder
    spends less than a static per-level table would (each level's empirical
    entropy of its occupancy bytes, table not counted)."""
    from mlx_lattice.data import synthetic_lidar_scan
    from mlx_lattice.geometry import quantize_points

    pts = synthetic_lidar_scan(seed=0).points.astype(np.float64)
    coords = np.array(quantize_points(pts, 0.1).coords)
    data = coding.encode_occupancy(coords)
    assert np.array_equal(coding.decode_occupancy(data), coords)
    static_bits = 0.0
    for occ in octree_bytes(coords):
        counts = np.bincount(occ, minlength=256)
        q = counts[counts > 0] / len(occ)
        static_bits += -len(occ) * float(np.sum(q * np.log2(q)))
    header = 10 + 21 + 4
    assert 8 * (len(data) - header) < static_bits


def test_occupancy_rejects(rng: np.random.Generator) -> None:
    with pytest.raises(CodingError, match=r"\(N, 3\) or \(N, 4\)"):
        coding.encode_occupancy(np.zeros((4, 2), np.int32))
    with pytest.raises(CodingError, match="integers"):
        coding.encode_occupancy(np.zeros((4, 3), np.float32))
    with pytest.raises(CodingError, match="beyond int32"):
        coding.encode_occupancy(np.array([[0, 0, 1 << 40]]))
    data = coding.encode_occupancy(rng.integers(0, 100, (500, 4)))
    for cut in (0, 5, len(data) - 1):
        with pytest.raises(CodingError, match="corrupt"):
            coding.decode_occupancy(data[:cut])
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x10
    with pytest.raises(CodingError, match="corrupt"):
        coding.decode_occupancy(bytes(bad))


def test_native_occupancy_decoder_never_overruns(rng: np.random.Generator) -> None:
    coords = np.concatenate(
        [rng.integers(0, 3, (600, 1)), rng.integers(0, 40, (600, 3))], axis=1
    ).astype(np.int32)
    good = ext.entropy_encode_occupancy(coords)
    expected = np.unique(coords, axis=0)
    assert np.array_equal(ext.entropy_decode_occupancy(good), expected)
    for trial in range(300):
        bad = bytearray(good)
        at = int(rng.integers(len(bad))) if trial % 2 else int(rng.integers(0, 80))
        bad[at] = int(rng.integers(256))
        bad = bad[: int(rng.integers(len(bad) - 8, len(bad) + 1))]
        out, error = attempt(ext.entropy_decode_occupancy, bytes(bad))
        if out is None:
            assert "corrupt" in error
        else:
            assert out.ndim == 2 and out.shape[1] in (3, 4)
            assert len(np.unique(out, axis=0)) == len(out)


def test_bits_per_symbol_of_a_tiny_table() -> None:
    """Smallest possible streams: their length is exact (state + checksum)."""
    assert len(coding.rans_encode([], [1.0])) == 8
    assert len(coding.range_encode([], [1.0])) == 9
    assert math.isclose(entropy_bits(coding.quantize_probabilities([1, 1])), 1.0)
