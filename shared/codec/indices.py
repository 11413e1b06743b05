"""Which elements of a tensor a delta carries: index codecs, one small class each.

- DENSE: every element, in order; nothing travels.
- SEEDED: a pseudo-random subset drawn from a 64-bit seed; only the seed travels (8 bytes),
  never the indices. Both ends regenerate the same set with `seeded_indices`.
- PACKED: an explicit sorted index list, bit-packed at ceil(log2(numel)) bits per index
  (what top-k selection needs).
"""

from __future__ import annotations

import abc
import enum
import struct

import numpy as np

from shared import kernels
from shared.errors import DeltaFormatError, DeltaMismatchError


class IndexKind(enum.IntEnum):
    DENSE = 0
    SEEDED = 1
    PACKED = 2


_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(seed: int, count: int, start: int = 0) -> np.ndarray:
    """Outputs start..start+count-1 of the SplitMix64 stream of `seed`: (count,) uint64.

    Specified exactly (Steele et al. 2014) so every platform and version derives the same
    indices: state_j = seed + (j + 1) * 0x9E3779B97F4A7C15, then the standard finaliser.
    """
    with np.errstate(over="ignore"):
        j = np.arange(start + 1, start + count + 1, dtype=np.uint64)
        z = np.uint64(seed & 0xFFFFFFFFFFFFFFFF) + j * _GAMMA
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def seeded_indices(seed: int, numel: int, k: int) -> np.ndarray:
    """k distinct indices in [0, numel), sorted ascending (int64), a pure function of the seed.

    Sparse case (4k <= numel): the first k distinct values of splitmix64(seed) mod numel.
    Dense case: the k positions with the smallest splitmix64(seed) keys (a seeded permutation).
    The sparse case runs compiled (`shared.kernels`) where numba is installed, the same values.
    """
    if not 0 <= k <= numel:
        raise ValueError(f"k={k} must be within [0, numel={numel}]")
    if 0 < k and 4 * k <= numel and kernels.HAVE_NUMBA:
        return kernels.first_distinct_sorted([seed], [numel], [k], [0])
    return _seeded_indices_numpy(seed, numel, k)


def _seeded_indices_numpy(seed: int, numel: int, k: int) -> np.ndarray:
    """`seeded_indices` in numpy alone: the specification, and the path without numba."""
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    if k == numel:
        return np.arange(numel, dtype=np.int64)
    if 4 * k > numel:
        keys = splitmix64(seed, numel)
        return np.sort(np.argsort(keys, kind="stable")[:k]).astype(np.int64)
    draws = k + 16 + k // 8  # a few spare draws cover the expected collisions
    while True:
        cand = (splitmix64(seed, draws) % np.uint64(numel)).astype(np.int64)
        uniq, first = np.unique(cand, return_index=True)
        if uniq.size >= k:
            return np.sort(cand[np.sort(first)[:k]])
        draws *= 2


def seeded_indices_many(seeds, numels, ks, offsets=None) -> np.ndarray:
    """Many `seeded_indices` at once: the concatenation, in the order given, of
    offsets[i] + seeded_indices(seeds[i], numels[i], ks[i]) (int64).

    The sparse tensors (4k <= numel) in one compiled call where numba is installed, the rest
    (dense draws, k == numel) one by one. offsets=None: local indices (offset 0 each).
    """
    seeds = [int(x) & 0xFFFFFFFFFFFFFFFF for x in seeds]
    numels = np.asarray(numels, dtype=np.int64).reshape(-1)
    ks = np.asarray(ks, dtype=np.int64).reshape(-1)
    e = len(seeds)
    if not numels.size == ks.size == e:
        raise ValueError("seeds, numels and ks must have the same length")
    offs = np.zeros(e, dtype=np.int64) if offsets is None else np.asarray(offsets, dtype=np.int64).reshape(-1)
    if offs.size != e:
        raise ValueError("offsets must have one entry per seed")
    if np.any(ks < 0) or np.any(ks > numels):
        bad = int(np.argmax((ks < 0) | (ks > numels)))
        raise ValueError(f"k={int(ks[bad])} must be within [0, numel={int(numels[bad])}]")
    if e == 0:
        return np.zeros(0, dtype=np.int64)
    sparse = (ks > 0) & (4 * ks <= numels)
    if not kernels.HAVE_NUMBA or not sparse.any():
        return np.concatenate([_seeded_indices_numpy(seeds[i], int(numels[i]), int(ks[i])) + offs[i]
                               for i in range(e)]).astype(np.int64, copy=False)
    fi = np.flatnonzero(sparse)
    drawn = kernels.first_distinct_sorted([seeds[i] for i in fi], numels[fi], ks[fi], offs[fi])
    if fi.size == e:
        return drawn
    bounds = np.concatenate(([0], np.cumsum(ks[fi])))
    pieces, j = [], 0
    for i in range(e):
        if sparse[i]:
            pieces.append(drawn[bounds[j]:bounds[j + 1]])
            j += 1
        else:
            pieces.append(_seeded_indices_numpy(seeds[i], int(numels[i]), int(ks[i])) + offs[i])
    return np.concatenate(pieces).astype(np.int64, copy=False)


def unpack_indices(buf, *, width: int, k: int) -> np.ndarray:
    """k indices of `width` bits each, most significant bit first, from bytes `buf` (int64)."""
    nbytes = (k * width + 7) // 8
    if width > 56:  # an 8-byte window cannot hold the bits: the bit matrix
        bits = np.unpackbits(np.frombuffer(buf[:nbytes], dtype=np.uint8))[: k * width]
        weights = np.uint64(1) << np.arange(width - 1, -1, -1, dtype=np.uint64)
        return (bits.reshape(k, width).astype(np.uint64) * weights).sum(axis=1, dtype=np.uint64).astype(np.int64)
    padded = np.zeros(nbytes + 8, dtype=np.uint8)
    padded[:nbytes] = np.frombuffer(buf[:nbytes], dtype=np.uint8)
    # Overlapping big-endian 8-byte windows, one starting at every byte (a strided view, no copy).
    windows = np.ndarray(shape=(nbytes + 1,), dtype=">u8", buffer=padded.data, strides=(1,))
    bitpos = np.arange(k, dtype=np.int64) * width
    word = windows[bitpos >> 3].astype(np.uint64)
    return ((word << (bitpos & 7).astype(np.uint64)) >> np.uint64(64 - width)).astype(np.int64)


def _bits_for(numel: int) -> int:
    return max(1, int(numel - 1).bit_length())


class IndexCodec(abc.ABC):
    kind: IndexKind

    @abc.abstractmethod
    def encode(self, indices: np.ndarray | None, *, numel: int, seed: int | None) -> bytes:
        """The index section for k indices (sorted ascending) of a tensor of `numel` elements."""

    @abc.abstractmethod
    def decode(self, buf: memoryview, *, numel: int, k: int) -> tuple[np.ndarray | None, int | None, int]:
        """(indices or None for all, seed or None, bytes consumed); raises DeltaFormatError."""

    def estimate_bytes(self, *, numel: int, k: int) -> int:
        raise NotImplementedError


class DenseIndices(IndexCodec):
    kind = IndexKind.DENSE

    def encode(self, indices, *, numel, seed):
        return b""

    def decode(self, buf, *, numel, k):
        if k != numel:
            raise DeltaMismatchError(f"a dense entry must carry all {numel} values, not {k}")
        return None, None, 0

    def estimate_bytes(self, *, numel, k):
        return 0


class SeededIndices(IndexCodec):
    kind = IndexKind.SEEDED

    def encode(self, indices, *, numel, seed):
        if seed is None:
            raise ValueError("a SEEDED entry needs its seed")
        return struct.pack("<Q", seed & 0xFFFFFFFFFFFFFFFF)

    def decode(self, buf, *, numel, k):
        if len(buf) < 8:
            raise DeltaFormatError("truncated seed")
        (seed,) = struct.unpack_from("<Q", buf)
        return seeded_indices(seed, numel, k), seed, 8

    def estimate_bytes(self, *, numel, k):
        return 8


class PackedIndices(IndexCodec):
    kind = IndexKind.PACKED

    def encode(self, indices, *, numel, seed):
        if indices is None:
            raise ValueError("a PACKED entry needs its indices")
        width = _bits_for(numel)
        idx = np.asarray(indices, dtype=np.uint64)
        # (k, width) bit matrix, most significant bit first, then packed 8 to a byte.
        shifts = np.arange(width - 1, -1, -1, dtype=np.uint64)
        bits = ((idx[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
        return bytes([width]) + np.packbits(bits.reshape(-1)).tobytes()

    def decode(self, buf, *, numel, k):
        if len(buf) < 1:
            raise DeltaFormatError("truncated index width")
        width = buf[0]
        if width != _bits_for(numel):
            raise DeltaMismatchError(f"index width {width} bits does not fit numel {numel}")
        nbytes = (k * width + 7) // 8
        if len(buf) < 1 + nbytes:
            raise DeltaFormatError("truncated packed indices")
        idx = unpack_indices(buf[1:1 + nbytes], width=width, k=k)
        if k and idx.max() >= numel:
            raise DeltaMismatchError(f"index {int(idx.max())} out of range for numel {numel}")
        if k > 1 and not np.all(idx[1:] > idx[:-1]):
            raise DeltaMismatchError("indices must be strictly increasing (sorted, no duplicates)")
        return idx, None, 1 + nbytes

    def estimate_bytes(self, *, numel, k):
        return 1 + (k * _bits_for(numel) + 7) // 8


INDEX_CODECS: dict[IndexKind, IndexCodec] = {c.kind: c for c in (DenseIndices(), SeededIndices(), PackedIndices())}
assert set(INDEX_CODECS) == set(IndexKind), "every IndexKind needs a codec"
