"""How the selected values travel: value codecs, one small class each.

- FP32: exact. FP16: half precision (relative error <= 2^-11; |v| must stay below 65504).
- INT8 / INT4: symmetric per-block quantisation, one fp32 scale (absmax / 127 or / 7) per
  BLOCK values; the error of each value is at most half its block's scale.
- INT2: a sign and one magnitude bit; two fp32 magnitudes per BLOCK values, fitted to the block
  (INT2Values). Made for top-k'd values (all large, none zero): 2.25 bits a value.
- INT1: a sign bit; one fp32 magnitude per BLOCK values, the block's mean |value| (INT1Values):
  1.125 bits a value. Made for dense deltas under error feedback.
"""

from __future__ import annotations

import abc
import enum

import numpy as np

from shared.errors import DeltaFormatError, DeltaMismatchError

BLOCK = 256  # values per quantisation scale: 1.6% overhead at int8, fine-grained enough for outliers


class ValueKind(enum.IntEnum):
    FP32 = 0
    FP16 = 1
    INT8 = 2
    INT4 = 3
    INT2 = 4
    INT1 = 5


def _finite(arr: np.ndarray, what: str) -> None:
    if not np.all(np.isfinite(arr)):
        raise DeltaMismatchError(f"{what} contain NaN or Inf")


class ValueCodec(abc.ABC):
    kind: ValueKind

    @abc.abstractmethod
    def encode(self, values: np.ndarray) -> bytes:
        """(k,) float32 -> bytes."""

    @abc.abstractmethod
    def decode(self, buf: memoryview, k: int) -> tuple[np.ndarray, int]:
        """(values (k,) float32, bytes consumed); raises DeltaFormatError."""

    @abc.abstractmethod
    def nbytes(self, k: int) -> int:
        """Exact size of the encoded section for k values."""

    def _take(self, buf: memoryview, k: int) -> memoryview:
        n = self.nbytes(k)
        if len(buf) < n:
            raise DeltaFormatError(f"truncated {self.kind.name} values: need {n} bytes, have {len(buf)}")
        return buf[:n]


class FP32Values(ValueCodec):
    kind = ValueKind.FP32

    def encode(self, values):
        return np.ascontiguousarray(values, dtype="<f4").tobytes()

    def decode(self, buf, k):
        out = np.frombuffer(self._take(buf, k), dtype="<f4").astype(np.float32)
        _finite(out, "values")
        return out, self.nbytes(k)

    def nbytes(self, k):
        return 4 * k


class FP16Values(ValueCodec):
    kind = ValueKind.FP16

    def encode(self, values):
        if values.size and np.abs(values).max() > 65504.0:
            raise ValueError("a value exceeds the fp16 range (65504): use fp32 or int8 values")
        return np.ascontiguousarray(values, dtype="<f2").tobytes()

    def decode(self, buf, k):
        out = np.frombuffer(self._take(buf, k), dtype="<f2").astype(np.float32)
        _finite(out, "values")
        return out, self.nbytes(k)

    def nbytes(self, k):
        return 2 * k


class _BlockQuantised(ValueCodec):
    qmax: int

    def _scales(self, values: np.ndarray) -> np.ndarray:
        k = values.size
        padded = np.zeros(-(-k // BLOCK) * BLOCK, dtype=np.float32)
        padded[:k] = np.abs(values)
        return (padded.reshape(-1, BLOCK).max(axis=1) / self.qmax).astype("<f4")  # (nblocks,)

    def _quantise(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(scales, codes): each value / its block's scale (1 for an all-zero block), rounded to the
        nearest even and clipped to +-qmax. Block by block through one padded buffer, in place: the
        same float32 divisions as one per-value scale array, without building three more arrays the
        size of the values (a 124M-parameter model update: 1.1 GB of temporaries)."""
        scales = self._scales(values)
        k = values.size
        safe = np.where(scales > 0, scales, np.float32(1.0)).astype(np.float32)
        work = np.zeros(scales.size * BLOCK, dtype=np.float32)
        work[:k] = values
        blocks = work.reshape(-1, BLOCK)
        np.divide(blocks, safe[:, None], out=blocks)
        np.rint(work, out=work)
        np.clip(work, -self.qmax, self.qmax, out=work)
        return scales, work[:k].astype(np.int8)

    def _read_scales(self, buf: memoryview, k: int) -> np.ndarray:
        scales = np.frombuffer(buf[: 4 * (-(-k // BLOCK))], dtype="<f4").astype(np.float32)
        _finite(scales, "quantisation scales")
        if np.any(scales < 0):
            raise DeltaMismatchError("quantisation scales must not be negative")
        return scales

    def _dequantise(self, q: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
        # A finite scale near the float32 limit times a code overflows to Inf: refuse it here.
        with np.errstate(over="ignore"):
            out = q * np.repeat(scales, BLOCK)[:k]
        _finite(out, "dequantised values")
        return out


class INT8Values(_BlockQuantised):
    kind = ValueKind.INT8
    qmax = 127

    def encode(self, values):
        scales, q = self._quantise(np.asarray(values, dtype=np.float32))
        return scales.tobytes() + q.tobytes()

    def decode(self, buf, k):
        body = self._take(buf, k)
        scales = self._read_scales(body, k)
        q = np.frombuffer(body[4 * scales.size:], dtype=np.int8).astype(np.float32)
        return self._dequantise(q, scales, k), self.nbytes(k)

    def nbytes(self, k):
        return 4 * (-(-k // BLOCK)) + k


class INT4Values(_BlockQuantised):
    kind = ValueKind.INT4
    qmax = 7

    def encode(self, values):
        scales, q = self._quantise(np.asarray(values, dtype=np.float32))
        nib = (q.astype(np.int16) + 8).astype(np.uint8)  # 1..15
        if nib.size % 2:
            nib = np.append(nib, np.uint8(8))  # pad with a zero value
        return scales.tobytes() + (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8).tobytes()

    def decode(self, buf, k):
        body = self._take(buf, k)
        scales = self._read_scales(body, k)
        packed = np.frombuffer(body[4 * scales.size:], dtype=np.uint8)
        nib = np.empty(packed.size * 2, dtype=np.int16)
        nib[0::2], nib[1::2] = packed & 0x0F, packed >> 4
        q = (nib[:k] - 8).astype(np.float32)
        return self._dequantise(q, scales, k), self.nbytes(k)

    def nbytes(self, k):
        return 4 * (-(-k // BLOCK)) + (k + 1) // 2


class INT2Values(ValueCodec):
    """Each value is +-lo or +-hi, two magnitudes per block of BLOCK values (0 <= lo <= hi): the
    sign and which magnitude are its 2 bits. lo and hi are fitted to the block's magnitudes by
    Lloyd's 2-means (ITERATIONS rounds, from the mean magnitude as threshold), the pair with the
    block's least squared error (to a local optimum); each value takes the nearer of the two.

    Why not a grid {-3,-1,1,3} * scale like INT4's: top-k'd values all lie between the k-th
    magnitude and the block's largest, and a grid anchored at 0 wastes its inner levels there.
    Relative L2 error measured (tests/shared/codec/test_codec.py pins upper bounds), against a
    grid {-3,-1,1,3} * absmax/3 and the same grid with its scale fitted by least squares:
        standard normal values            0.34    (grid: 0.60, fitted grid: 0.34)
        top 1% / 2% / 3% of a normal     0.06 / 0.07 / 0.07    (grid: 0.40, fitted: 0.10-0.13)
    A zero value becomes +lo: dense int2 suits only what error feedback corrects.

    Section: nblocks pairs of fp32 (lo, hi), then the codes, 4 to a byte, the first value in the
    low 2 bits; code bit 0: hi (else lo), bit 1: negative."""

    kind = ValueKind.INT2
    ITERATIONS = 4  # measured: 2 already reach the error above, to 4 digits

    @classmethod
    def _fit(cls, mags: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lo, hi, is_hi) for rows of magnitudes (nrows, n): Lloyd's 2-means on each row, then the
        nearer level for each value (a tie takes lo)."""
        total = mags.sum(axis=1, dtype=np.float64)
        n = mags.shape[1]
        threshold = total / n
        big = np.empty(mags.shape, dtype=bool)
        for _ in range(cls.ITERATIONS):
            np.greater(mags, threshold[:, None], out=big)
            n_hi = big.sum(axis=1)
            s_hi = mags.sum(axis=1, dtype=np.float64, where=big)
            with np.errstate(invalid="ignore", divide="ignore"):  # an empty side keeps the threshold
                hi = np.where(n_hi > 0, s_hi / n_hi, threshold)
                lo = np.where(n_hi < n, (total - s_hi) / (n - n_hi), threshold)
            threshold = (lo + hi) / 2
        lo32, hi32 = lo.astype(np.float32), hi.astype(np.float32)
        np.greater(mags, ((lo32.astype(np.float64) + hi32) / 2)[:, None], out=big)
        return lo32, hi32, big

    def _quantise(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(levels: (nblocks, 2) float32 of (lo, hi), codes: uint8, k of them then zeros up to a
        multiple of 4)."""
        k = values.size
        full = k // BLOCK * BLOCK
        mags = np.abs(values)
        parts = [self._fit(mags[:full].reshape(-1, BLOCK))] if full else []
        if k > full:
            parts.append(self._fit(mags[None, full:]))
        del mags
        levels = np.zeros((-(-k // BLOCK), 2), dtype="<f4")
        codes = np.zeros(-(-k // 4) * 4, dtype=np.uint8)
        at = 0
        for lo, hi, big in parts:
            levels[at:at + lo.size, 0], levels[at:at + lo.size, 1] = lo, hi
            codes[at * BLOCK:at * BLOCK + big.size] = big.reshape(-1)
            at += lo.size
        np.bitwise_or(codes[:k], 2, out=codes[:k], where=values < 0)
        return levels, codes

    def encode(self, values):
        levels, codes = self._quantise(np.asarray(values, dtype=np.float32))
        packed = codes[0::4] | (codes[1::4] << 2) | (codes[2::4] << 4) | (codes[3::4] << 6)
        return levels.tobytes() + packed.astype(np.uint8).tobytes()

    def decode(self, buf, k):
        body = self._take(buf, k)
        nblocks = -(-k // BLOCK)
        levels = np.frombuffer(body[:8 * nblocks], dtype="<f4").astype(np.float32).reshape(nblocks, 2)
        _finite(levels, "quantisation scales")
        if np.any(levels < 0):
            raise DeltaMismatchError("quantisation scales must not be negative")
        if np.any(levels[:, 0] > levels[:, 1]):
            raise DeltaMismatchError("INT2 magnitudes out of order: a block's lo exceeds its hi")
        packed = np.frombuffer(body[8 * nblocks:], dtype=np.uint8)
        codes = np.zeros(nblocks * BLOCK, dtype=np.uint8)  # whole blocks: past the k-th, zeros and padding bits
        for j in range(4):
            codes[j:packed.size * 4:4] = (packed >> (2 * j)) & 3
        blocks = codes.reshape(nblocks, BLOCK)
        # each value its block's hi or lo (bit 0: 0 or 1, read as a bool), no per-value index
        out = np.where((blocks & 1).view(bool), levels[:, 1:2], levels[:, 0:1]).reshape(-1)[:k]
        np.negative(out, out=out, where=(codes[:k] >> 1).view(bool))
        return out, self.nbytes(k)

    def nbytes(self, k):
        return 8 * (-(-k // BLOCK)) + (k + 3) // 4


class INT1Values(ValueCodec):
    """Each value is +-m, one magnitude m per block of BLOCK values: the block's mean |value|,
    which of all single magnitudes gives the block the least squared error (d/dm sum(|v| - m)^2 = 0).
    Zero is sent as +m: like INT2, only for what error feedback corrects. The relative L2 error of
    standard normal values is sqrt(1 - 2/pi) = 0.60 (tests/shared/codec/test_int1.py).

    Section: nblocks fp32 magnitudes, then one bit a value, 8 to a byte, the first value in the low
    bit; a set bit is a negative value."""

    kind = ValueKind.INT1

    def encode(self, values):
        values = np.asarray(values, dtype=np.float32)
        k = values.size
        mags = np.zeros(-(-k // BLOCK) * BLOCK, dtype=np.float32)
        mags[:k] = np.abs(values)
        full, rest = k // BLOCK, k % BLOCK
        scales = np.empty(-(-k // BLOCK), dtype=np.float64)
        scales[:full] = mags[:full * BLOCK].reshape(full, BLOCK).mean(axis=1, dtype=np.float64)
        if rest:  # the last, partial block: the mean of its own values
            scales[full] = mags[full * BLOCK:k].mean(dtype=np.float64)
        signs = np.packbits(values < 0, bitorder="little")
        return scales.astype("<f4").tobytes() + signs.tobytes()

    def decode(self, buf, k):
        body = self._take(buf, k)
        nblocks = -(-k // BLOCK)
        scales = np.frombuffer(body[:4 * nblocks], dtype="<f4").astype(np.float32)
        _finite(scales, "quantisation scales")
        if np.any(scales < 0):
            raise DeltaMismatchError("quantisation scales must not be negative")
        negative = np.unpackbits(np.frombuffer(body[4 * nblocks:], dtype=np.uint8), count=k,
                                 bitorder="little").view(bool)
        out = np.repeat(scales, BLOCK)[:k]
        np.negative(out, out=out, where=negative)
        return out, self.nbytes(k)

    def nbytes(self, k):
        return 4 * (-(-k // BLOCK)) + (k + 7) // 8


VALUE_CODECS: dict[ValueKind, ValueCodec] = {
    c.kind: c for c in (FP32Values(), FP16Values(), INT8Values(), INT4Values(), INT2Values(), INT1Values())
}
assert set(VALUE_CODECS) == set(ValueKind), "every ValueKind needs a codec"
