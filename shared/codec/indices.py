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


_GAMMA, _M1, _M2 = (np.uint64(c) for c in (kernels.SPLITMIX_GAMMA, kernels.SPLITMIX_M1, kernels.SPLITMIX_M2))


def splitmix64(seed: int, count: int, start: int = 0) -> np.ndarray:
    """Outputs start..start+count-1 of the SplitMix64 stream of `seed`: (count,) uint64.

    Specified exactly (Steele et al. 2014) so every platform and version derives the same
    indices: state_j = seed + (j + 1) * 0x9E3779B97F4A7C15, then the standard finaliser.
    """
    with np.errstate(over="ignore"):
        j = np.arange(start + 1, start + count + 1, dtype=np.uint64)
        return _finalise(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) + j * _GAMMA)


def _finalise(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function, in place on a uint64 array of stream states (returns it): the
    one numpy form of it (kernels._first_distinct_sorted is the compiled one, pinned to it by tests)."""
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


def seeded_indices(seed: int, numel: int, k: int) -> np.ndarray:
    """k distinct indices in [0, numel), sorted ascending (int64), a pure function of the seed.

    Sparse case (4k <= numel): the first k distinct values of splitmix64(seed) mod numel.
    Dense case: the k positions with the smallest splitmix64(seed) keys (a seeded permutation).
    The sparse case runs compiled (`shared.kernels`) where numba is installed, the same values.
    """
    if not 0 <= k <= numel:
        raise ValueError(f"k={k} must be within [0, numel={numel}]")
    if 0 < k and 4 * k <= numel and kernels.ready():
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
    offsets[i] + seeded_indices(seeds[i], numels[i], ks[i]) (int64). offsets=None: local indices.

    The sparse tensors (4k <= numel) in one compiled call where numba is installed
    (`kernels.first_distinct_sorted`), the rest (dense draws, k == numel) one by one; without numba,
    one vectorised numpy pass (`_seeded_indices_many_numpy`). The same values either way.
    """
    if not kernels.ready():
        return _seeded_indices_many_numpy(seeds, numels, ks, offsets)
    seeds, numels, ks, offs = _many_args(seeds, numels, ks, offsets)
    e = len(seeds)
    sparse = (ks > 0) & (4 * ks <= numels)
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
    return np.concatenate(pieces).astype(np.int64, copy=False) if pieces else np.zeros(0, dtype=np.int64)


def _seeded_indices_many_numpy(seeds, numels, ks, offsets=None) -> np.ndarray:
    """`seeded_indices_many` in numpy alone, vectorised over every tensor: one stream computation
    and one sort for all of them instead of an np.unique and two sorts per tensor. Tensors outside
    the vectorised case (dense draws, k == numel, too few distinct draws, keys too wide) fall back
    to `_seeded_indices_numpy` one by one."""
    seeds, numels, ks, offs = _many_args(seeds, numels, ks, offsets)
    e = len(seeds)
    pieces: list[np.ndarray | None] = [None] * e
    fast = (ks > 0) & (4 * ks <= numels)
    for i in np.flatnonzero(~fast):
        pieces[i] = _seeded_indices_numpy(seeds[i], int(numels[i]), int(ks[i])) + offs[i]
    fi = np.flatnonzero(fast)
    if fi.size:
        # Work in a private layout (cumulative numels) so the ranges are disjoint and ascending.
        f_numel, f_k = numels[fi], ks[fi]
        base = np.concatenate(([0], np.cumsum(f_numel)[:-1]))
        # Draws to make: k plus a margin for the repeats expected among them (~k^2 / 2 numel); a tensor
        # that gets fewer than k distinct values falls back to seeded_indices, which draws more.
        draws = f_k + 16 + (f_k * (f_k + f_k // 8)) // f_numel
        total = int(draws.sum())
        pos_bits = max(1, total.bit_length())
        span = int(base[-1] + f_numel[-1])
        if span.bit_length() + pos_bits > 63:  # keys would not fit: one by one
            for i in fi:
                pieces[i] = _seeded_indices_numpy(seeds[i], int(numels[i]), int(ks[i])) + offs[i]
        else:
            starts = np.concatenate(([0], np.cumsum(draws)[:-1]))
            pos = np.arange(total, dtype=np.uint64)
            with np.errstate(over="ignore"):
                z = pos - np.repeat((starts - 1).astype(np.uint64), draws)  # j = 1, 2, ... per tensor
                z *= _GAMMA
                z += np.repeat(np.asarray([seeds[i] for i in fi], dtype=np.uint64), draws)
                _finalise(z)
                z %= np.repeat(f_numel.astype(np.uint64), draws)
                z += np.repeat(base.astype(np.uint64), draws)
                z <<= np.uint64(pos_bits)
                z |= pos
                z.sort()  # by value, then by draw position
            keys = z.view(np.int64)
            val = keys >> np.int64(pos_bits)
            p_sorted = keys & np.int64((1 << pos_bits) - 1)
            first = np.empty(total, dtype=bool)  # the earliest draw of each value (ties sort by position)
            first[0] = True
            np.not_equal(val[1:], val[:-1], out=first[1:])  # ranges are disjoint: repeats are within one tensor
            # A tensor keeps its first k distinct draws: those before the position `cutoff` where the k-th
            # distinct draw ends. Repeats are few (~k^2 / 2 numel per tensor), so the cutoff moves past
            # them tensor by tensor: the least c with c = start + k + (repeats drawn before c).
            later = np.sort(p_sorted[~first])  # positions of draws that repeat an earlier one
            cutoff = starts + f_k
            n_later = np.zeros(fi.size, dtype=np.int64)
            if later.size:
                owner = np.searchsorted(starts, later, side="right") - 1
                n_later = np.bincount(owner, minlength=fi.size)
                for t in np.flatnonzero(n_later):
                    mine = later[owner == t]
                    c = int(cutoff[t])
                    while (moved := int(starts[t] + f_k[t] + np.searchsorted(mine, c))) != c:
                        c = moved
                    cutoff[t] = c
            got = draws - n_later  # distinct draws per tensor
            kept = val[first & (p_sorted < np.repeat(cutoff, draws))]  # ascending; segment by segment
            counts = np.minimum(got, f_k)
            bounds = np.concatenate(([0], np.cumsum(counts)))
            for t, i in enumerate(fi):
                if got[t] < f_k[t]:  # too few distinct draws: the reference draws more
                    pieces[i] = _seeded_indices_numpy(seeds[i], int(numels[i]), int(ks[i])) + offs[i]
                else:
                    pieces[i] = kept[bounds[t]:bounds[t + 1]] - (base[t] - offs[i])
    if not pieces:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(pieces).astype(np.int64, copy=False)


def _many_args(seeds, numels, ks, offsets) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """seeded_indices_many's arguments, checked: (64-bit seeds, numels, ks, offsets as int64 arrays)."""
    seeds = [int(x) & 0xFFFFFFFFFFFFFFFF for x in seeds]
    numels = np.asarray(numels, dtype=np.int64).reshape(-1)
    ks = np.asarray(ks, dtype=np.int64).reshape(-1)
    if not numels.size == ks.size == len(seeds):
        raise ValueError("seeds, numels and ks must have the same length")
    offs = np.zeros(len(seeds), dtype=np.int64) if offsets is None else np.asarray(offsets, dtype=np.int64).reshape(-1)
    if offs.size != len(seeds):
        raise ValueError("offsets must have one entry per seed")
    if np.any(ks < 0) or np.any(ks > numels):
        bad = int(np.argmax((ks < 0) | (ks > numels)))
        raise ValueError(f"k={int(ks[bad])} must be within [0, numel={int(numels[bad])}]")
    return seeds, numels, ks, offs


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


def bits_for(numel: int) -> int:
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
        width = bits_for(numel)
        idx = np.asarray(indices, dtype=np.uint64)
        # (k, width) bit matrix, most significant bit first, then packed 8 to a byte.
        shifts = np.arange(width - 1, -1, -1, dtype=np.uint64)
        bits = ((idx[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
        return bytes([width]) + np.packbits(bits.reshape(-1)).tobytes()

    def decode(self, buf, *, numel, k):
        if len(buf) < 1:
            raise DeltaFormatError("truncated index width")
        width = buf[0]
        if width != bits_for(numel):
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
        return 1 + (k * bits_for(numel) + 7) // 8


INDEX_CODECS: dict[IndexKind, IndexCodec] = {c.kind: c for c in (DenseIndices(), SeededIndices(), PackedIndices())}
assert set(INDEX_CODECS) == set(IndexKind), "every IndexKind needs a codec"
