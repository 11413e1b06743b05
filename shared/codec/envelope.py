"""The delta wire format: a versioned envelope around a zstd frame of entries.

    offset size  field
    0      4     magic b"IDTD"
    4      1     format version (FORMAT_VERSION)
    5      3     reserved, zero
    8      8     declared size of the decompressed body, u64 little-endian
    16     ...   one zstd frame (with content checksum) holding the body:

    body:  u64 base_version | u32 n_entries | entries
    entry: u16 name_len | name (utf-8) | u8 IndexKind | u8 ValueKind | u64 numel | u64 k
           | index section (indices.py) | value section (values.py)

Decoding is bounded: the declared size is checked against the caller's cap (and, for a
volunteer's bytes, against MAX_UPLOAD_RATIO times the frame's size) before any decompression,
decompression is one pass that stops at the declared size, and every field is checked against
the model schema (names, numel, index ranges, finite values). Bytes from a volunteer are
untrusted; nothing here uses pickle.
"""

from __future__ import annotations

import dataclasses
import io
import math
import struct
from collections.abc import Mapping

import numpy as np
import zstandard

from shared import kernels
from shared.codec.indices import INDEX_CODECS, IndexKind, _bits_for, seeded_indices_many
from shared.codec.values import BLOCK, VALUE_CODECS, ValueKind
from shared.errors import DeltaFormatError, DeltaMismatchError

MAGIC = b"IDTD"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sB3xQ")  # magic, version, reserved, declared body size
MAX_NAME_BYTES = 256


@dataclasses.dataclass(frozen=True)
class Entry:
    """The part of one tensor a delta carries (flattened view)."""

    name: str
    numel: int
    index_kind: IndexKind
    value_kind: ValueKind
    values: np.ndarray  # (k,) float32
    indices: np.ndarray | None = None  # (k,) int64 ascending; None = all numel elements
    seed: int | None = None  # SEEDED entries only

    @property
    def k(self) -> int:
        return int(self.values.size)


@dataclasses.dataclass(frozen=True)
class Delta:
    base_version: int
    entries: tuple[Entry, ...]

    def to_dense(self, schema: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """Every schema tensor as a dense float32 array, zero where the delta carries nothing."""
        out = {name: np.zeros(math.prod(shape), dtype=np.float32) for name, shape in schema.items()}
        for e in self.entries:
            if e.indices is None:
                out[e.name][:] = e.values
            else:
                out[e.name][e.indices] = e.values
        return {name: out[name].reshape(shape) for name, shape in schema.items()}


def encode(delta: Delta, *, level: int = 3) -> bytes:
    """Delta -> envelope bytes. Raises ValueError on a delta that cannot be encoded."""
    body = io.BytesIO()
    body.write(struct.pack("<QI", delta.base_version, len(delta.entries)))
    for e in delta.entries:
        name = e.name.encode()
        if not 0 < len(name) <= MAX_NAME_BYTES:
            raise ValueError(f"tensor name {e.name!r} must be 1..{MAX_NAME_BYTES} bytes of utf-8")
        values = np.asarray(e.values, dtype=np.float32).reshape(-1)
        if not np.all(np.isfinite(values)):
            raise ValueError(f"{e.name}: refusing to encode NaN or Inf")
        body.write(struct.pack("<H", len(name)) + name)
        body.write(struct.pack("<BBQQ", e.index_kind, e.value_kind, e.numel, values.size))
        body.write(INDEX_CODECS[e.index_kind].encode(e.indices, numel=e.numel, seed=e.seed))
        body.write(VALUE_CODECS[e.value_kind].encode(values))
    raw = body.getvalue()
    frame = zstandard.ZstdCompressor(level=level, write_checksum=True).compress(raw)
    return HEADER.pack(MAGIC, FORMAT_VERSION, len(raw)) + frame


def max_body_bytes(schema: Mapping[str, tuple[int, ...]]) -> int:
    """The largest body a legitimate delta for this schema can have (every tensor, dense fp32)."""
    per_entry = 2 + MAX_NAME_BYTES + 18 + 9
    return 12 + sum(per_entry + 4 * math.prod(shape) for shape in schema.values())


def decode(buf: bytes, *, schema: Mapping[str, tuple[int, ...]], max_body: int | None = None,
           max_ratio: float | None = None) -> Delta:
    """Envelope bytes -> Delta, checked against `schema` (name -> shape). Raises DeltaFormatError.
    `max_ratio`: the most the declared body may be times the compressed frame (MAX_UPLOAD_RATIO for
    a volunteer's bytes); None: only `max_body` (default: the schema's dense fp32 size) bounds it."""
    raw = _open(buf, max_body_bytes(schema) if max_body is None else max_body, max_ratio)
    return _parse_body(memoryview(raw), schema)


def _open(buf: bytes, cap: int, max_ratio: float | None = None) -> bytes:
    """The body of an envelope: header checked (magic, version, declared size within `cap` and, given
    `max_ratio`, within what its frame's size allows), zstd frame decompressed to exactly the
    declared size in one bounded pass. Raises DeltaFormatError."""
    if len(buf) < HEADER.size:
        raise DeltaFormatError(f"delta of {len(buf)} bytes is shorter than its {HEADER.size}-byte header")
    magic, version, declared = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise DeltaFormatError("not an idletrain delta (bad magic bytes)")
    if version != FORMAT_VERSION:
        raise DeltaFormatError(f"unsupported delta format version {version} (this side speaks {FORMAT_VERSION})")
    if declared > cap:
        raise DeltaFormatError(f"declared body of {declared} bytes exceeds the cap of {cap} bytes")
    frame_bytes = len(buf) - HEADER.size
    if max_ratio is not None and declared > max(RATIO_FLOOR_BYTES, max_ratio * frame_bytes):
        raise DeltaFormatError(f"declared body of {declared} bytes is more than {max_ratio:g} times its "
                               f"{frame_bytes}-byte zstd frame; an honest delta compresses far less")
    return _decompress(memoryview(buf)[HEADER.size:], declared)


# Volunteers' bytes (uploaded deltas, exchange bodies) may declare at most this many times their
# compressed frame's size (`max_ratio`), checked before anything is allocated or decompressed: a
# 3 KB frame of zeros can declare 100 MB, which cost the coordinator the memory and the CPU of
# decompressing it (twice) before the body's checks refused it. Measured (2026-12-03, 5 AdamW
# steps on widths 32 and 128, every index kind x value kind): honest deltas reach 1.02 (dense
# int8) to 1.48 (random int4): their values are noise to zstd. 16 leaves a tenfold margin (a
# delta would need ~94% of its bytes to be zeros to fail it, e.g. a round whose lr was 0: it
# carries nothing); an attacker's 3 KB frame now costs at most max(1 MiB, 48 KB). Not for what
# the coordinator sends: a model update is legitimately mostly zeros (a version that changed
# 0.1% of the parameters), and the worker's own cap (the schema's dense size) bounds it.
MAX_UPLOAD_RATIO = 16.0
# Below this declared size the ratio is not checked: decompressing 1 MiB takes ~1 ms and 1 MiB of
# memory, not worth refusing a small model's delta for (a test model's whole dense fp32 delta is
# 88 KB, and a hand-built one of mostly zeros is honest enough), nor an empty sparta round, whose
# 12-byte body sits in a 21-byte frame.
RATIO_FLOOR_BYTES = 1 << 20


def _decompress(frame: memoryview, declared: int) -> bytes:
    """The frame's content, which must be exactly `declared` bytes, in one pass: never more than
    `declared` bytes are allocated or produced (without a content size in the frame, zstd stops
    as soon as its output would pass them), the frame must be complete (end mark and checksum
    verified) and nothing may follow it."""
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise DeltaFormatError(f"not a zstd frame: {exc}") from None
    known = params.content_size != zstandard.CONTENTSIZE_UNKNOWN
    if known and params.content_size != declared:
        raise DeltaFormatError(f"zstd frame says {params.content_size} bytes, header says {declared}")
    try:
        # max_output_size 0 would mean "no limit": a declared size of 0 gets 1 and the check below
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=max(1, declared),
                                                      allow_extra_data=False)
    except zstandard.ZstdError as exc:
        if not known and "did not decompress full frame" in str(exc):
            raise DeltaFormatError(f"body decompresses to a size other than the declared {declared} bytes, or "
                                   f"its zstd frame is cut short: {exc}") from None
        raise DeltaFormatError(f"corrupt zstd frame: {exc}") from None
    if len(raw) != declared:
        raise DeltaFormatError(f"body decompresses to a size other than the declared {declared} bytes")
    return raw


def _body_header(raw: memoryview, schema: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
    """(base version, number of entries) from the body's first 12 bytes, checked against `schema`."""
    if len(raw) < 12:
        raise DeltaFormatError("truncated body while reading the body header")
    base_version, n_entries = _BODY_HEADER.unpack_from(raw, 0)
    if n_entries > len(schema):
        raise DeltaMismatchError(f"{n_entries} entries but the model has only {len(schema)} tensors")
    return base_version, n_entries


def _entry_header(raw: memoryview, pos: int, schema: Mapping[str, tuple[int, ...]],
                  seen: set[str]) -> tuple[str, IndexKind, ValueKind, int, int, int]:
    """One entry's name and header at `pos`, every check made (a known tensor, not seen before, known
    codecs, its numel, 1 <= k <= numel); returns (name, index kind, value kind, numel, k, next pos)."""
    n_raw = len(raw)
    if pos + 2 > n_raw:
        raise DeltaFormatError("truncated body while reading a name length")
    (name_len,) = _U16.unpack_from(raw, pos)
    pos += 2
    if not 0 < name_len <= MAX_NAME_BYTES:
        raise DeltaFormatError(f"tensor name length {name_len} outside 1..{MAX_NAME_BYTES}")
    if pos + name_len > n_raw:
        raise DeltaFormatError("truncated body while reading a tensor name")
    try:
        name = bytes(raw[pos:pos + name_len]).decode()
    except UnicodeDecodeError:
        raise DeltaFormatError("tensor name is not utf-8") from None
    pos += name_len
    if name not in schema:
        raise DeltaMismatchError(f"unknown tensor {name!r}")
    if name in seen:
        raise DeltaMismatchError(f"tensor {name!r} appears twice")
    seen.add(name)
    if pos + 18 > n_raw:
        raise DeltaFormatError(f"truncated body while reading the header of {name}")
    ik, vk, numel, k = _ENTRY_HEADER.unpack_from(raw, pos)
    index_kind, value_kind = _INDEX_KINDS.get(ik), _VALUE_KINDS.get(vk)
    if index_kind is None or value_kind is None:
        raise DeltaFormatError(f"{name}: unknown codec (index kind {ik}, value kind {vk})")
    expected = math.prod(schema[name])
    if numel != expected:
        raise DeltaMismatchError(f"{name}: numel {numel} but the model's tensor {schema[name]} has {expected}")
    if not 0 < k <= numel:
        raise DeltaMismatchError(f"{name}: carries {k} values, must be 1..{numel}")
    return name, index_kind, value_kind, numel, k, pos + 18


def _parse_body(raw: memoryview, schema: Mapping[str, tuple[int, ...]]) -> Delta:
    base_version, n_entries = _body_header(raw, schema)
    pos = 12
    entries: list[Entry] = []
    seen: set[str] = set()
    for _ in range(n_entries):
        name, index_kind, value_kind, numel, k, pos = _entry_header(raw, pos, schema, seen)
        indices, seed, used = INDEX_CODECS[index_kind].decode(raw[pos:], numel=numel, k=k)
        pos += used
        values, used = VALUE_CODECS[value_kind].decode(raw[pos:], k)
        pos += used
        entries.append(Entry(name, numel, index_kind, value_kind, values, indices, seed))
    if pos != len(raw):
        raise DeltaFormatError(f"{len(raw) - pos} unexpected bytes after the last entry")
    return Delta(base_version=base_version, entries=tuple(entries))


# -- flat decoding: one delta as global indices into the model's parameters laid end to end ------


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
    raw = _open(buf, max_body_bytes(schema) if max_body is None else max_body, max_ratio)
    return _parse_body_flat(memoryview(raw), schema, flat_offsets(schema) if offsets is None else offsets)


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
    raw = _open(buf, max_body_bytes(schema) if max_body is None else max_body, max_ratio)
    return _parse_body_flat(memoryview(raw), schema, flat_offsets(schema) if offsets is None else offsets,
                            materialise=False)


def _parse_body_flat(raw: memoryview, schema: Mapping[str, tuple[int, ...]], offsets: Mapping[str, int], *,
                     materialise: bool = True) -> FlatDelta | DeltaSummary:
    base_version, n_entries = _body_header(raw, schema)
    pos = 12
    seen: set[str] = set()
    headers: list[tuple] = []  # DeltaSummary.entries
    # per sparse entry: (offset, kind, indices or seed, numel, k, values or None, int8 section or None)
    sparse: list[tuple] = []
    dense: list[tuple[int, np.ndarray]] = []
    int8 = VALUE_CODECS[ValueKind.INT8]
    n_raw = len(raw)
    for _ in range(n_entries):  # the checks of _parse_body (the same _entry_header), the bulk work deferred
        name, index_kind, value_kind, numel, k, pos = _entry_header(raw, pos, schema, seen)
        if index_kind == IndexKind.SEEDED:
            if pos + 8 > n_raw:
                raise DeltaFormatError("truncated seed")
            (index,) = _U64.unpack_from(raw, pos)
            pos += 8
        elif index_kind == IndexKind.PACKED and pos < len(raw) and raw[pos] <= 56:
            # the bits are unpacked below, for every packed entry at once; here only the checks
            width = raw[pos]
            if width != _bits_for(numel):
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


_U16, _U64, _ENTRY_HEADER = struct.Struct("<H"), struct.Struct("<Q"), struct.Struct("<BBQQ")
_BODY_HEADER = struct.Struct("<QI")
_INDEX_KINDS = {int(kind): kind for kind in IndexKind}
_VALUE_KINDS = {int(kind): kind for kind in ValueKind}


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
