"""Flat decoding: one delta as global indices into the model's parameters laid end to end
(`flat_offsets` order), what the coordinator merges. The same checks as envelope.decode (a delta
one refuses, the other refuses, with the same error), but the bulk work done for every entry at
once: SEEDED indices regenerated together (`seeded_indices_many`), PACKED indices unpacked in one
pass, INT8 values dequantised in one pass.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Mapping

import numpy as np

from shared import kernels
from shared.codec.envelope import body_header, entry_header, open_body
from shared.codec.indices import INDEX_CODECS, IndexKind, bits_for, seeded_indices_many
from shared.codec.values import BLOCK, VALUE_CODECS, ValueKind
from shared.errors import DeltaFormatError, DeltaMismatchError

_U64 = struct.Struct("<Q")


def flat_offsets(schema: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """Where each tensor starts when the schema's tensors are laid end to end, in schema order."""
    out, pos = {}, 0
    for name, shape in schema.items():
        out[name] = pos
        pos += math.prod(shape)
    return out


@dataclasses.dataclass(frozen=True)
class FlatDelta:
    """A decoded delta over the flat parameter vector (tensors end to end, `flat_offsets` order).

    indices/values: every sparse (SEEDED or PACKED) entry, ascending global indices (entries in
    offset order, each ascending); dense: (offset, values) per DENSE entry."""

    base_version: int
    n_entries: int
    indices: np.ndarray  # (K,) int64
    values: np.ndarray  # (K,) float32
    dense: tuple[tuple[int, np.ndarray], ...] = ()

    @property
    def k(self) -> int:
        return int(self.values.size) + sum(int(v.size) for _, v in self.dense)


def decode_flat(buf: bytes, *, schema: Mapping[str, tuple[int, ...]], offsets: Mapping[str, int] | None = None,
                max_body: int | None = None, max_ratio: float | None = None) -> FlatDelta:
    """Envelope bytes -> FlatDelta: what `decode` checks and returns, on global indices.

    The same checks as `decode` (a delta one refuses, the other refuses, with a DeltaFormatError),
    but SEEDED indices are regenerated for all entries at once (`seeded_indices_many`) and INT8
    values dequantised in one pass, instead of entry by entry."""
    raw = open_body(buf, schema=schema, max_body=max_body, max_ratio=max_ratio)
    return _parse_body_flat(raw, schema, flat_offsets(schema) if offsets is None else offsets)


@dataclasses.dataclass(frozen=True)
class DeltaSummary:
    """What `check_flat` tells of a delta it accepts: its base version, entries and values carried."""

    base_version: int
    n_entries: int
    k: int
    # (name, IndexKind, ValueKind, numel, k, seed or None) of each entry, in body order: what a
    # receiver checks against what the sender was asked to send (the coordinator: the lease's compression)
    entries: tuple[tuple[str, IndexKind, ValueKind, int, int, int | None], ...] = dataclasses.field(
        default=(), compare=False)


def check_flat(buf: bytes, *, schema: Mapping[str, tuple[int, ...]], offsets: Mapping[str, int] | None = None,
               max_body: int | None = None, max_ratio: float | None = None) -> DeltaSummary:
    """Envelope bytes -> DeltaSummary, refusing exactly what `decode_flat` refuses (the same
    DeltaFormatError) without building the delta: SEEDED indices are not regenerated (any seed
    gives a valid set) and INT8 values are not dequantised (each block's largest code times its
    scale is checked instead, which overflows exactly when one of its values would). What the
    coordinator runs on an upload before acknowledging it; the merger decodes it later."""
    raw = open_body(buf, schema=schema, max_body=max_body, max_ratio=max_ratio)
    return _parse_body_flat(raw, schema, flat_offsets(schema) if offsets is None else offsets, materialise=False)


def _parse_body_flat(raw: memoryview, schema: Mapping[str, tuple[int, ...]], offsets: Mapping[str, int], *,
                     materialise: bool = True) -> FlatDelta | DeltaSummary:
    base_version, n_entries = body_header(raw, schema)
    pos = 12
    seen: set[str] = set()
    headers: list[tuple] = []  # DeltaSummary.entries
    # per sparse entry: (offset, kind, indices or seed, numel, k, values or None, int8 section or None)
    sparse: list[tuple] = []
    dense: list[tuple[int, np.ndarray]] = []
    int8 = VALUE_CODECS[ValueKind.INT8]
    n_raw = len(raw)
    for _ in range(n_entries):  # the checks of envelope.decode (the same entry_header), the bulk work deferred
        name, index_kind, value_kind, numel, k, pos = entry_header(raw, pos, schema, seen)
        if index_kind == IndexKind.SEEDED:
            if pos + 8 > n_raw:
                raise DeltaFormatError("truncated seed")
            (index,) = _U64.unpack_from(raw, pos)
            pos += 8
        elif index_kind == IndexKind.PACKED and pos < len(raw) and raw[pos] <= 56:
            # the bits are unpacked below, for every packed entry at once; here only the checks
            width = raw[pos]
            if width != bits_for(numel):
                raise DeltaMismatchError(f"index width {width} bits does not fit numel {numel}")
            nbytes = (k * width + 7) // 8
            if pos + 1 + nbytes > len(raw):
                raise DeltaFormatError("truncated packed indices")
            index = (pos + 1, width)
            pos += 1 + nbytes
        else:
            index, _, used = INDEX_CODECS[index_kind].decode(raw[pos:], numel=numel, k=k)
            pos += used
        headers.append((name, index_kind, value_kind, numel, k, index if index_kind == IndexKind.SEEDED else None))
        if value_kind == ValueKind.INT8:
            n_int8 = 4 * (-(-k // BLOCK)) + k
            if pos + n_int8 > n_raw:
                raise DeltaFormatError(f"truncated INT8 values: need {n_int8} bytes, have {n_raw - pos}")
            section = raw[pos:pos + n_int8]
            pos += n_int8
            values = None
        else:
            section = None
            values, used = VALUE_CODECS[value_kind].decode(raw[pos:], k)
            pos += used
        if index_kind == IndexKind.DENSE:
            if section is not None:
                values, _ = int8.decode(section, k)
            dense.append((offsets[name], values))
        else:
            sparse.append((offsets[name], index_kind, index, numel, k, values, section))
    if pos != len(raw):
        raise DeltaFormatError(f"{len(raw) - pos} unexpected bytes after the last entry")
    sparse.sort(key=lambda item: item[0])
    dense.sort(key=lambda item: item[0])
    if not materialise:
        _unpack_many(raw, [item for item in sparse if isinstance(item[2], tuple)])  # its checks only
        _int8_sections(sparse, dequantise=False)
        return DeltaSummary(base_version, n_entries, sum(item[4] for item in sparse) + sum(v.size for _, v in dense),
                            entries=tuple(headers))
    return FlatDelta(base_version, n_entries, _flat_indices(sparse, raw), _flat_values(sparse), tuple(dense))


def _flat_indices(sparse: list[tuple], raw: memoryview) -> np.ndarray:
    if not sparse:
        return np.zeros(0, dtype=np.int64)
    seeded = [item for item in sparse if item[1] == IndexKind.SEEDED]
    regenerated = seeded_indices_many([item[2] for item in seeded], [item[3] for item in seeded],
                                      [item[4] for item in seeded], [item[0] for item in seeded])
    packed = [item for item in sparse if isinstance(item[2], tuple)]
    unpacked = _unpack_many(raw, packed)
    pieces, at, at_p = [], 0, 0
    for off, kind, index, _numel, k, _values, _section in sparse:
        if kind == IndexKind.SEEDED:
            pieces.append(regenerated[at:at + k])
            at += k
        elif isinstance(index, tuple):
            pieces.append(unpacked[at_p:at_p + k])
            at_p += k
        else:
            pieces.append(index + off)
    return np.concatenate(pieces)


def _unpack_many(raw: memoryview, packed: list[tuple]) -> np.ndarray:
    """Every PACKED entry's indices (widths <= 56 bits), as global indices, checked as
    PackedIndices.decode checks them: in range, strictly increasing."""
    if not packed:
        return np.zeros(0, dtype=np.int64)
    if kernels.ready():
        out, status, at = kernels.unpack_packed(raw, [item[2][0] for item in packed], [item[2][1] for item in packed],
                                                [item[4] for item in packed], [item[3] for item in packed],
                                                [item[0] for item in packed])
        if status == 1:
            e = int(np.searchsorted(np.cumsum([item[4] for item in packed]), at, side="right"))
            raise DeltaMismatchError(f"index {int(out[at]) - packed[e][0]} out of range for numel {packed[e][3]}")
        if status == 2:
            raise DeltaMismatchError("indices must be strictly increasing (sorted, no duplicates)")
        return out
    ks = np.asarray([item[4] for item in packed], dtype=np.int64)
    widths = np.asarray([item[2][1] for item in packed], dtype=np.int64)
    starts = np.asarray([item[2][0] for item in packed], dtype=np.int64)  # byte where each entry's bits begin
    padded = np.zeros(len(raw) + 8, dtype=np.uint8)
    padded[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    # overlapping big-endian 8-byte windows, one starting at every byte of the body (a strided view)
    windows = np.ndarray(shape=(len(raw) + 1,), dtype=">u8", buffer=padded.data, strides=(1,))
    entry = np.repeat(np.arange(ks.size), ks)
    first = np.concatenate(([0], np.cumsum(ks)[:-1]))
    i = np.arange(int(ks.sum()), dtype=np.int64) - first[entry]
    w = widths[entry]
    bitpos = starts[entry] * 8 + i * w
    word = windows[bitpos >> 3].astype(np.uint64)
    local = ((word << (bitpos & 7).astype(np.uint64)) >> (64 - w).astype(np.uint64)).astype(np.int64)
    numels = np.asarray([item[3] for item in packed], dtype=np.int64)
    bad = local >= numels[entry]
    if bad.any():
        j = int(np.argmax(bad))
        raise DeltaMismatchError(f"index {int(local[j])} out of range for numel {int(numels[entry[j]])}")
    step_ok = local[1:] > local[:-1]
    step_ok |= entry[1:] != entry[:-1]  # a new entry starts over
    if not step_ok.all():
        raise DeltaMismatchError("indices must be strictly increasing (sorted, no duplicates)")
    return local + np.asarray([item[0] for item in packed], dtype=np.int64)[entry]


def _int8_sections(sparse: list[tuple], *, dequantise: bool = True) -> np.ndarray | None:
    """Every INT8 section's values dequantised together (None if none, or dequantise=False), after
    the checks: scales finite and not negative, no value overflowing. Without dequantising, the
    overflow check takes each block's largest code times its scale: float32 products are monotone
    in the code, so that one is finite exactly when all of the block's are."""
    sections = [(item[6], item[4]) for item in sparse if item[6] is not None]
    if not sections:
        return None
    nblocks = [-(-k // BLOCK) for _, k in sections]
    scales = np.frombuffer(b"".join(bytes(s[: 4 * nb]) for (s, _), nb in zip(sections, nblocks)),
                           dtype="<f4").astype(np.float32)
    if not np.all(np.isfinite(scales)):
        raise DeltaMismatchError("quantisation scales contain NaN or Inf")
    if np.any(scales < 0):
        raise DeltaMismatchError("quantisation scales must not be negative")
    q = np.frombuffer(b"".join(bytes(s[4 * nb:]) for (s, _), nb in zip(sections, nblocks)), dtype=np.int8)
    ks = np.asarray([k for _, k in sections], dtype=np.int64)
    # values per scale: BLOCK, but an entry's last block holds what is left of its k
    per_scale = np.full(scales.size, BLOCK, dtype=np.int64)
    per_scale[np.cumsum(nblocks) - 1] = ks - BLOCK * (np.asarray(nblocks, dtype=np.int64) - 1)
    with np.errstate(over="ignore"):
        if dequantise:
            deq = q.astype(np.float32) * np.repeat(scales, per_scale)
        else:
            starts = np.concatenate(([0], np.cumsum(per_scale)[:-1]))
            biggest = np.maximum.reduceat(np.abs(q.astype(np.int16)), starts) if q.size else np.zeros(0, np.int16)
            deq = biggest.astype(np.float32) * scales
    if not np.all(np.isfinite(deq)):
        raise DeltaMismatchError("dequantised values contain NaN or Inf")
    return deq if dequantise else None


def _flat_values(sparse: list[tuple]) -> np.ndarray:
    """Every sparse entry's values, in order; INT8 sections dequantised together."""
    deq = _int8_sections(sparse)
    pieces, at = [], 0
    for item in sparse:
        if item[6] is not None:
            pieces.append(deq[at:at + item[4]])
            at += item[4]
        else:
            pieces.append(np.asarray(item[5], dtype=np.float32))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
