"""INT1 values: a sign bit per value and one magnitude per block, the block's mean |value|."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shared.codec import BLOCK, ValueKind
from shared.codec.values import VALUE_CODECS
from shared.errors import DeltaFormatError, DeltaMismatchError

CODEC = VALUE_CODECS[ValueKind.INT1]


def section(scales, negative) -> bytes:
    """The documented layout, spelled out: fp32 scales, then one bit a value, low bit first."""
    bits = list(negative) + [0] * (-len(negative) % 8)
    return struct.pack(f"<{len(scales)}f", *scales) + bytes(
        sum(b << j for j, b in enumerate(bits[i:i + 8])) for i in range(0, len(bits), 8))


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 700),
                  elements=st.floats(-2.0 ** 100, 2.0 ** 100, allow_nan=False, allow_subnormal=False, width=32)))
def test_each_value_is_its_sign_times_its_blocks_mean_magnitude(values):
    sent = CODEC.encode(values)
    k = values.size
    assert len(sent) == CODEC.nbytes(k) == 4 * -(-k // BLOCK) + -(-k // 8)
    got, used = CODEC.decode(memoryview(sent), k)
    assert used == len(sent) and got.dtype == np.float32 and got.shape == (k,)
    mags = np.abs(values.astype(np.float64))
    means = np.repeat([mags[i:i + BLOCK].mean() for i in range(0, k, BLOCK)], BLOCK)[:k]
    np.testing.assert_allclose(np.abs(got), means, rtol=1e-6, atol=1e-44)  # a mean may round to a subnormal
    assert np.all(got[values < 0] <= 0) and np.all(got[values >= 0] >= 0)


def test_hand_built_section():
    # two blocks: the first all +-2, the second's four values at mean magnitude 0.5
    first = [2.0 if i % 3 else -2.0 for i in range(BLOCK)]
    values = np.array(first + [0.25, -0.75, 1.0, 0.0], np.float32)
    want = section([2.0, 0.5], [v < 0 for v in values])
    assert CODEC.encode(values) == want
    got, _ = CODEC.decode(memoryview(want), values.size)
    assert got.tolist() == first + [0.5, -0.5, 0.5, 0.5]  # zero goes out as +m


def test_the_mean_is_the_least_squares_magnitude_and_gaussian_error_is_as_stated():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(200 * BLOCK).astype(np.float32)
    got, _ = CODEC.decode(memoryview(CODEC.encode(x)), x.size)
    rel = np.linalg.norm(got - x) / np.linalg.norm(x)
    assert abs(rel - math.sqrt(1 - 2 / math.pi)) < 0.01
    # any other magnitude for the first block does worse
    block, m = x[:BLOCK], abs(got[0])
    for other in (0.9 * m, 1.1 * m, np.abs(block).max()):
        assert np.linalg.norm(np.where(block < 0, -m, m) - block) < np.linalg.norm(
            np.where(block < 0, -other, other) - block)


@pytest.mark.parametrize("scale,match", [(-1.0, "must not be negative"), (math.nan, "NaN or Inf"),
                                         (math.inf, "NaN or Inf")])
def test_bad_scales_are_refused(scale, match):
    with pytest.raises(DeltaMismatchError, match=match):
        CODEC.decode(memoryview(section([1.0, scale], [0] * 300)), 300)


def test_truncated_section_is_refused():
    whole = section([1.0], [1, 0, 1])
    with pytest.raises(DeltaFormatError, match="truncated INT1 values"):
        CODEC.decode(memoryview(whole[:-1]), 3)


@given(st.integers(1, 600), st.binary(min_size=0, max_size=200))
@settings(max_examples=150, deadline=None)
def test_decoder_on_random_sections_refuses_or_returns_finite_values(k, raw):
    try:
        got, used = CODEC.decode(memoryview(raw), k)
    except (DeltaFormatError, DeltaMismatchError):
        return
    assert used == CODEC.nbytes(k) <= len(raw)
    assert got.shape == (k,) and got.dtype == np.float32 and np.all(np.isfinite(got))
