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
untrusted; nothing here uses pickle. flat.py decodes the same bytes, with the same checks, onto
the model's parameters laid end to end.
"""

from __future__ import annotations

import dataclasses
import io
import math
import struct
from collections.abc import Mapping, Sequence

import numpy as np
import zstandard

from shared.codec.indices import INDEX_CODECS, IndexKind
from shared.codec.values import VALUE_CODECS, ValueKind
from shared.errors import DeltaFormatError, DeltaMismatchError

MAGIC = b"IDTD"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sB3xQ")  # magic, version, reserved, declared body size
MAX_NAME_BYTES = 256
_U16, _ENTRY_HEADER, _BODY_HEADER = struct.Struct("<H"), struct.Struct("<BBQQ"), struct.Struct("<QI")
_INDEX_KINDS = {int(kind): kind for kind in IndexKind}
_VALUE_KINDS = {int(kind): kind for kind in ValueKind}


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


def encoded_bound(entries: Sequence[tuple[str, IndexKind, ValueKind, int, int]]) -> int:
    """The most bytes `encode` can return for a delta of these entries (name, index kind, value kind,
    numel, k): the exact body (the value codecs' sizes, the index codecs' upper bounds) plus what
    zstd adds to a frame it cannot shrink (its compress bound) and the envelope's header."""
    raw = 12 + sum(2 + len(name.encode()) + 18 + INDEX_CODECS[ik].estimate_bytes(numel=numel, k=k)
                   + VALUE_CODECS[vk].nbytes(k) for name, ik, vk, numel, k in entries)
    return HEADER.size + zstd_bound(raw)


def zstd_bound(n: int) -> int:
    """The most bytes one zstd frame of `n` bytes of content can take: zstd's compress bound (what it
    adds to data it cannot shrink) plus 32 for the frame's header and checksum."""
    return n + (n >> 8) + ((128 << 10) - n >> 11 if n < 128 << 10 else 0) + 32


def max_body_bytes(schema: Mapping[str, tuple[int, ...]]) -> int:
    """The largest body a legitimate delta for this schema can have (every tensor, dense fp32)."""
    per_entry = 2 + MAX_NAME_BYTES + 18 + 9
    return 12 + sum(per_entry + 4 * math.prod(shape) for shape in schema.values())


def decode(buf: bytes, *, schema: Mapping[str, tuple[int, ...]], max_body: int | None = None,
           max_ratio: float | None = None) -> Delta:
    """Envelope bytes -> Delta, checked against `schema` (name -> shape). Raises DeltaFormatError.
    `max_ratio`: the most the declared body may be times the compressed frame (MAX_UPLOAD_RATIO for
    a volunteer's bytes); None: only `max_body` (default: the schema's dense fp32 size) bounds it."""
    return _parse_body(open_body(buf, schema=schema, max_body=max_body, max_ratio=max_ratio), schema)


def open_body(buf: bytes, *, schema: Mapping[str, tuple[int, ...]], max_body: int | None = None,
              max_ratio: float | None = None) -> memoryview:
    """The body of an envelope: header checked (magic, version, declared size within the cap, `max_body`
    or the schema's max_body_bytes, and, given `max_ratio`, within what its frame's size allows), zstd
    frame decompressed to exactly the declared size in one bounded pass. Raises DeltaFormatError."""
    cap = max_body_bytes(schema) if max_body is None else max_body
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
    return memoryview(_decompress(memoryview(buf)[HEADER.size:], declared))


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
# Below this declared size the ratio is not checked: decompressing 1 MiB costs little time and 1 MiB
# of memory, not worth refusing a small model's delta for (a test model's whole dense fp32 delta is
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


def body_header(raw: memoryview, schema: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
    """(base version, number of entries) from the body's first 12 bytes, checked against `schema`."""
    if len(raw) < 12:
        raise DeltaFormatError("truncated body while reading the body header")
    base_version, n_entries = _BODY_HEADER.unpack_from(raw, 0)
    if n_entries > len(schema):
        raise DeltaMismatchError(f"{n_entries} entries but the model has only {len(schema)} tensors")
    return base_version, n_entries


def entry_header(raw: memoryview, pos: int, schema: Mapping[str, tuple[int, ...]],
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
    base_version, n_entries = body_header(raw, schema)
    pos = 12
    entries: list[Entry] = []
    seen: set[str] = set()
    for _ in range(n_entries):
        name, index_kind, value_kind, numel, k, pos = entry_header(raw, pos, schema, seen)
        indices, seed, used = INDEX_CODECS[index_kind].decode(raw[pos:], numel=numel, k=k)
        pos += used
        values, used = VALUE_CODECS[value_kind].decode(raw[pos:], k)
        pos += used
        entries.append(Entry(name, numel, index_kind, value_kind, values, indices, seed))
    if pos != len(raw):
        raise DeltaFormatError(f"{len(raw) - pos} unexpected bytes after the last entry")
    return Delta(base_version=base_version, entries=tuple(entries))
