"""Compiled inner loops (numba) for the hot spots of a merge, each with a plain numpy/torch fallback.

- `first_distinct_sorted`: the SEEDED index set of a sparse tensor (4k <= numel): the first k
  distinct values of splitmix64(seed) mod numel, sorted. Specified by `codec.indices.seeded_indices`;
  here one pass over the stream with a hash set, a 64-bit remainder by multiply-high instead of a
  division, and a counting sort (the values are uniform over [0, numel)): several times faster
  than the vectorised numpy form (bench/merge.py times both); a two-level bucket sort and an
  order-preserving hash table measured no faster and were left out.
- `unpack_packed`: the bit-packed indices of every PACKED (top-k) entry of a delta in one pass,
  checked (in range, strictly increasing) as the numpy path checks them.
- `scatter_pair`: t[idx] += a * v and m[idx] += b * v in one loop (a momentum step's two writes),
  float32 arithmetic exactly as `torch.Tensor.index_add_(..., alpha=)` does it, element after element.

numba is imported and the kernels compiled on first use (seconds; less from the cache numba keeps
under __pycache__), so processes that never merge or draw indices pay nothing. Without numba
(`HAVE_NUMBA` False: a platform without its wheels, or IDLETRAIN_NUMBA=0 in the environment), or
with one that fails to compile or to pass `ready()`'s self-check (logged once), the callers keep
their numpy/torch paths, which compute the same results; the tests run both, and bench/merge.py
times both side by side. A process that wants the compilation out of the way (the coordinator, at
start) calls `ready()` early.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import threading
from collections.abc import Iterator

import numpy as np

log = logging.getLogger(__name__)

HAVE_NUMBA = importlib.util.find_spec("numba") is not None and os.environ.get("IDLETRAIN_NUMBA", "1") != "0"


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block the callers take their numpy/torch paths (benchmarks and tests; not thread-safe)."""
    global HAVE_NUMBA
    before, HAVE_NUMBA = HAVE_NUMBA, False
    try:
        yield
    finally:
        HAVE_NUMBA = before


# SplitMix64's constants (Steele et al. 2014), one definition: codec.indices' numpy form uses them too
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_M1 = 0xBF58476D1CE4E5B9
SPLITMIX_M2 = 0x94D049BB133111EB
_LO32 = 0xFFFFFFFF


def _mulhi64(a, b):
    """The high 64 bits of the 128-bit product a * b (uint64 operands), from 32-bit halves."""
    lo32 = np.uint64(_LO32)
    s32 = np.uint64(32)
    a_lo, a_hi = a & lo32, a >> s32
    b_lo, b_hi = b & lo32, b >> s32
    ll = a_lo * b_lo
    lh = a_lo * b_hi
    hl = a_hi * b_lo
    hh = a_hi * b_hi
    mid = (ll >> s32) + (lh & lo32) + (hl & lo32)
    return hh + (lh >> s32) + (hl >> s32) + (mid >> s32)


def _first_distinct_sorted(seeds, numels, ks, offsets, out, table, counts, tmp):
    """For each tensor i: out[pos:pos+k_i] = offsets[i] + the first k_i distinct values of
    splitmix64(seeds[i]) mod numels[i], ascending (pos = sum of the earlier k). Sparse tensors only."""
    gamma, m1, m2 = np.uint64(SPLITMIX_GAMMA), np.uint64(SPLITMIX_M1), np.uint64(SPLITMIX_M2)
    pos = 0
    for i in range(ks.size):
        k = ks[i]
        numel = numels[i]
        if k == 0:
            continue
        un = np.uint64(numel)
        # z mod numel without dividing: q = mulhi(z, floor((2^64 - 1) / numel)) is the quotient or
        # one or two below it, and the remainder is corrected by subtraction.
        recip = np.uint64(0xFFFFFFFFFFFFFFFF) // un
        cap = 1
        bits = 0
        while cap < 2 * k:
            cap <<= 1
            bits += 1
        shift = np.uint64(64 - bits)  # k >= 1, so cap >= 2 and bits >= 1
        mask = cap - 1
        for h in range(cap):
            table[h] = -1
        s = np.uint64(seeds[i])
        z0 = s
        n = 0
        while n < k:
            z0 = z0 + gamma  # state_j = seed + j * gamma, j = 1, 2, ...
            z = (z0 ^ (z0 >> np.uint64(30))) * m1
            z = (z ^ (z >> np.uint64(27))) * m2
            z = z ^ (z >> np.uint64(31))
            r = z - _mulhi64(z, recip) * un
            while r >= un:
                r -= un
            v = np.int64(r)
            h = np.int64((r * gamma) >> shift) & mask
            while True:
                t = table[h]
                if t == -1:
                    table[h] = v
                    tmp[n] = v
                    n += 1
                    break
                if t == v:
                    break
                h = (h + 1) & mask
        # counting sort by a monotone bucket floor(v * k / numel) in [0, k) (about one value per
        # bucket: the draws are uniform), then an insertion pass for the values sharing one
        scale = k / numel
        for b in range(k + 1):
            counts[b] = 0
        for q in range(k):
            counts[min(np.int64(tmp[q] * scale), k - 1) + 1] += 1
        for b in range(k):
            counts[b + 1] += counts[b]
        for q in range(k):
            v = tmp[q]
            b = min(np.int64(v * scale), k - 1)
            out[pos + counts[b]] = v
            counts[b] += 1
        for q in range(pos + 1, pos + k):
            x = out[q]
            j = q - 1
            while j >= pos and out[j] > x:
                out[j + 1] = out[j]
                j -= 1
            out[j + 1] = x
        off = offsets[i]
        if off:
            for q in range(pos, pos + k):
                out[q] += off
        pos += k
    return pos


def _scatter_pair(t, m, idx, vals, a, b):
    n = min(t.size, m.size)
    for j in range(idx.size):  # checked before anything is written (no bounds checks below)
        if idx[j] < 0 or idx[j] >= n:
            return j
    fa = np.float32(a)
    fb = np.float32(b)
    for j in range(idx.size):
        i = idx[j]
        v = vals[j]
        m[i] += fb * v
        t[i] += fa * v
    return -1


def _unpack_packed(padded, starts, widths, ks, numels, offsets, out):
    """Every PACKED entry's k indices of `width` bits (most significant bit first) from the byte at
    starts[e], plus offsets[e], into out. Returns (status, position): 0 all good; 1 the first index
    out of range at `position` (reported before any ordering fault, as the numpy path does); 2 some
    entry not strictly increasing."""
    pos = 0
    first_bad = -1
    increasing = True
    for e in range(ks.size):
        w = np.uint64(widths[e])
        base_bit = starts[e] * 8
        prev = -1
        numel = numels[e]
        off = offsets[e]
        for i in range(ks[e]):
            bitpos = base_bit + i * widths[e]
            byte = bitpos >> 3
            word = np.uint64(0)
            for b in range(8):
                word = (word << np.uint64(8)) | np.uint64(padded[byte + b])
            local = np.int64((word << np.uint64(bitpos & 7)) >> (np.uint64(64) - w))
            if local >= numel and first_bad < 0:
                first_bad = pos + i
            if local <= prev:
                increasing = False
            prev = local
            out[pos + i] = local + off
        pos += ks[e]
    if first_bad >= 0:
        return 1, first_bad
    return (0, -1) if increasing else (2, -1)


_compiled: dict[str, object] = {}
_compile_lock = threading.Lock()
_ready: bool | None = None  # None: not tried yet; False: numba failed here, the plain paths run


def ready() -> bool:
    """Whether the compiled kernels are in use: numba installed and allowed (HAVE_NUMBA), and, the
    first time, every kernel compiled (or loaded from numba's cache) and checked against known
    answers. A numba that fails to import, compile or answer right is logged once and left off, so a
    volunteer's odd install costs speed, never a crash."""
    global _ready
    if not HAVE_NUMBA:
        return False
    if _ready is None:
        with _compile_lock:
            if _ready is None:
                try:
                    _compile()
                    _self_check()
                    _ready = True
                except Exception as exc:  # noqa: BLE001 - any failure means: run without the kernels
                    log.warning("compiled kernels unavailable (%s: %s); using the numpy/torch paths",
                                type(exc).__name__, exc)
                    _ready = False
    return _ready


def _compile() -> None:
    import numba

    g = globals()
    # helpers first: the kernels that call them must see the compiled versions
    # nogil: a kernel runs for milliseconds (a group's scatter on a large model), and the merging
    # process's request threads must not wait for it, as they do not for torch's own ops
    g["_mulhi64"] = numba.njit(cache=True, nogil=True, inline="always")(g["_mulhi64"])
    _compiled["first_distinct_sorted"] = numba.njit(cache=True, nogil=True)(_first_distinct_sorted)
    _compiled["scatter_pair"] = numba.njit(cache=True, nogil=True)(_scatter_pair)
    _compiled["unpack_packed"] = numba.njit(cache=True, nogil=True)(_unpack_packed)


def _self_check() -> None:
    """Each kernel on a tiny input with a known answer (the first call also compiles it)."""
    out = np.empty(20, dtype=np.int64)
    _compiled["first_distinct_sorted"](np.array([42], dtype=np.uint64), np.array([200]), np.array([20]),
                                       np.array([0]), out, np.empty(64, dtype=np.int64),
                                       np.empty(21, dtype=np.int64), np.empty(20, dtype=np.int64))
    # seeded_indices(42, 200, 20), pinned in tests/shared/codec/test_codec.py
    want = [5, 7, 8, 13, 46, 47, 50, 58, 61, 62, 91, 95, 108, 125, 130, 156, 164, 174, 189, 198]
    if out.tolist() != want:
        raise RuntimeError("first_distinct_sorted gave wrong indices")
    got = np.empty(2, dtype=np.int64)  # 0b1010_0111: two 4-bit indices, 10 and 7 (not increasing)
    status, _ = _compiled["unpack_packed"](np.array([0xA7] + [0] * 8, dtype=np.uint8), np.array([0]),
                                           np.array([4]), np.array([2]), np.array([16]), np.array([100]), got)
    if status != 2 or got.tolist() != [110, 107]:
        raise RuntimeError("unpack_packed gave wrong indices")
    t, m = np.zeros(3, dtype=np.float32), np.zeros(3, dtype=np.float32)
    bad = _compiled["scatter_pair"](t, m, np.array([2, 2]), np.array([1.0, 2.0], dtype=np.float32), 0.5, -1.0)
    if bad != -1 or t.tolist() != [0.0, 0.0, 1.5] or m.tolist() != [0.0, 0.0, -3.0]:
        raise RuntimeError("scatter_pair gave wrong sums")


def first_distinct_sorted(seeds, numels, ks, offsets) -> np.ndarray:
    """The concatenation over tensors i of offsets[i] + seeded_indices(seeds[i], numels[i], ks[i])
    (int64), for sparse tensors (0 <= 4 k_i <= numel_i). Only when ready()."""
    if not ready():
        raise RuntimeError("first_distinct_sorted runs only when ready() (numba compiled); "
                           "use codec.indices.seeded_indices_many")
    seeds = np.asarray([int(s) & 0xFFFFFFFFFFFFFFFF for s in seeds], dtype=np.uint64).reshape(-1)
    numels = np.asarray(numels, dtype=np.int64).reshape(-1)
    ks = np.asarray(ks, dtype=np.int64).reshape(-1)
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
    if not seeds.size == numels.size == ks.size == offsets.size:
        raise ValueError("seeds, numels, ks and offsets must have the same length")
    if np.any(ks < 0) or np.any(4 * ks > numels):
        raise ValueError("first_distinct_sorted is for sparse draws only (0 <= 4k <= numel)")
    kmax = int(ks.max(initial=0))
    cap = 1
    while cap < 2 * kmax:
        cap <<= 1
    out = np.empty(int(ks.sum()), dtype=np.int64)
    _compiled["first_distinct_sorted"](seeds, numels, ks, offsets, out, np.empty(cap, dtype=np.int64),
                                       np.empty(kmax + 1, dtype=np.int64), np.empty(kmax, dtype=np.int64))
    return out


def unpack_packed(raw, starts, widths, ks, numels, offsets) -> tuple[np.ndarray, int, int]:
    """Bit-unpack every PACKED entry of a delta body (widths <= 56) onto global indices in one
    compiled pass: (indices, status, position) as `_unpack_packed` returns them, so the caller
    raises its own errors. Only when ready()."""
    if not ready():
        raise RuntimeError("unpack_packed runs only when ready() (numba compiled); use the numpy path")
    starts, widths, ks, numels, offsets = (np.asarray(a, dtype=np.int64).reshape(-1)
                                           for a in (starts, widths, ks, numels, offsets))
    if np.any((widths < 1) | (widths > 56)) or np.any(ks < 0):
        raise ValueError("widths must be within 1..56 and ks not negative")
    # every entry's bits must lie inside raw; +8 bytes of zeros for the last 8-byte windows
    if ks.size and np.any(starts * 8 + ks * widths > len(raw) * 8):
        raise ValueError("packed bits run past the end of the body")
    padded = np.zeros(len(raw) + 8, dtype=np.uint8)
    padded[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    out = np.empty(int(ks.sum()), dtype=np.int64)
    status, at = _compiled["unpack_packed"](padded, starts, widths, ks, numels, offsets, out)
    return out, int(status), int(at)


def scatter_pair(t, m, idx, vals, a: float, b: float) -> None:
    """t[idx] += a * vals and m[idx] += b * vals, element after element (torch tensors: fp32 t, m and
    vals, int64 idx, 1-D). Bit for bit what m.index_add_(0, idx, vals, alpha=b) followed by
    t.index_add_(0, idx, vals, alpha=a) leave, repeated indices included; those two calls are the
    path without numba and for tensors of another layout. An index out of range raises IndexError
    before anything is written."""
    if not (ready() and _fits(t, np.float32) and _fits(m, np.float32) and _fits(idx, np.int64)
            and _fits(vals, np.float32)):
        m.index_add_(0, idx, vals, alpha=b)
        t.index_add_(0, idx, vals, alpha=a)
        return
    if idx.numel() != vals.numel():
        raise ValueError(f"{idx.numel()} indices for {vals.numel()} values")
    bad = _compiled["scatter_pair"](t.numpy(), m.numpy(), idx.numpy(), vals.numpy(), float(a), float(b))
    if bad >= 0:
        raise IndexError(f"index {int(idx[bad])} out of range for {min(t.numel(), m.numel())} elements; "
                         "nothing written")


def _fits(x, dtype) -> bool:
    """A 1-D contiguous CPU torch tensor of `dtype` (what the compiled loop takes as is)."""
    return (x.dim() == 1 and x.device.type == "cpu" and x.is_contiguous() and not x.requires_grad
            and x.numpy().dtype == dtype)
