"""Model snapshots on the wire and on disk: zstd(safetensors), never pickle.

A worker must be safe from a malicious coordinator too, so decoding checks the size before
and while decompressing, then names, shapes, dtype and finiteness against the model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

import numpy as np
import safetensors.torch
import torch
import zstandard

from shared.codec import zstd_bound
from shared.errors import SnapshotError
from shared.model import ModelConfig, build_model, get_params


def snapshot_metadata(run: str, version: int, model: Mapping) -> dict[str, str]:
    """The header metadata of a coordinator's snapshot (one definition: a worker that builds
    version 0 itself encodes the same bytes, to compare hashes instead of downloading)."""
    return {"run": run, "version": str(version), "model": json.dumps(dict(model))}


def run_snapshot_parts(flat: torch.Tensor, shapes: Mapping[str, tuple[int, ...]], *, run: str, version: int,
                       model: Mapping) -> list[bytes]:
    """The bytes (in parts) of a run's snapshot of `version`: the one encoder of what the coordinator
    serves, so that a worker building version 0 itself gets the same bytes, hash and all."""
    return encode_snapshot_flat_parts(flat, shapes, metadata=snapshot_metadata(run, version, model))


def version_zero(run: str, model: ModelConfig, seed: int) -> tuple[dict[str, torch.Tensor], str]:
    """(weights, sha256 of the snapshot bytes) of a run's version 0, built here from the run's seed:
    the same bytes as the coordinator's snapshot 0 (the same model and run_snapshot_parts)."""
    params = get_params(build_model(model, seed=seed))
    flat = torch.cat([t.reshape(-1) for t in params.values()])
    parts = run_snapshot_parts(flat, {n: tuple(t.shape) for n, t in params.items()}, run=run, version=0,
                               model=model.to_dict())
    return params, parts_sha256(parts)


def parts_sha256(parts: Sequence[bytes | memoryview]) -> str:
    """The sha256 (hex) of parts written back to back, without joining them."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def encode_snapshot(params: Mapping[str, torch.Tensor], *, metadata: Mapping[str, str] | None = None,
                    level: int = 3) -> bytes:
    """zstd(safetensors) of `params` as fp32, the tensors in the mapping's order."""
    tensors = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in params.items()}
    return _encode([(n, tuple(t.shape), t.reshape(-1).numpy()) for n, t in tensors.items()], metadata, level)


def encode_snapshot_flat(flat: torch.Tensor, shapes: Mapping[str, tuple[int, ...]], *,
                         metadata: Mapping[str, str] | None = None, level: int = 3) -> bytes:
    """The same snapshot as encode_snapshot(views of `flat` by `shapes`), straight from one flat fp32
    vector laid out in the order of `shapes` (the coordinator's flat weights): the data section is
    `flat` itself, handed to zstd in pieces, never copied into a second 0.5 GB buffer (124M params)."""
    return b"".join(encode_snapshot_flat_parts(flat, shapes, metadata=metadata, level=level))


def encode_snapshot_flat_parts(flat: torch.Tensor, shapes: Mapping[str, tuple[int, ...]], *,
                               metadata: Mapping[str, str] | None = None, level: int = 3) -> list[bytes]:
    """encode_snapshot_flat's bytes as the compressor's pieces, to hash and write one after another
    (shared.files.atomic_write takes them): joining them is one more copy of the whole snapshot,
    made holding the GIL (a pause for every request the process serves)."""
    if flat.dtype != torch.float32 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("flat weights must be one contiguous fp32 vector")
    numel = sum(int(torch.Size(s).numel()) for s in shapes.values())
    if flat.numel() != numel:
        raise ValueError(f"flat weights hold {flat.numel()} values, the shapes {numel}")
    data = flat.detach().cpu().numpy()
    pieces, pos = [], 0
    for name, shape in shapes.items():
        n = int(torch.Size(shape).numel())
        pieces.append((name, tuple(shape), data[pos:pos + n]))
        pos += n
    return _encode_parts(pieces, metadata, level)


_CHUNK = 1 << 20  # bytes handed to zstd at a time (small pieces stay in cache: faster than one 0.5 GB call)


def _encode(pieces: list[tuple[str, tuple[int, ...], np.ndarray]], metadata: Mapping[str, str] | None,
            level: int) -> bytes:
    return b"".join(_encode_parts(pieces, metadata, level))


def _encode_parts(pieces: list[tuple[str, tuple[int, ...], np.ndarray]], metadata: Mapping[str, str] | None,
                  level: int) -> list[bytes]:
    """The safetensors layout written by hand: an 8-byte header length, a JSON header (padded with
    spaces to a multiple of 8) naming each tensor's dtype, shape and byte range, then the tensors'
    bytes back to back in the order given. Every byte is a pure function of the contents (one
    metadata key holding sorted JSON, keys in a fixed order), so the snapshot's hash is too; and
    safetensors' own reader (decode_snapshot) checks it all on the way back."""
    head = _safetensors_header([(name, "F32", shape, arr.nbytes) for name, shape, arr in pieces],
                               {"idletrain": json.dumps(dict(metadata or {}), sort_keys=True)})
    total = len(head) + sum(arr.nbytes for _, _, arr in pieces)
    cobj = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True).compressobj(size=total)
    out = [cobj.compress(head)]
    for _, _, arr in pieces:
        raw = memoryview(np.ascontiguousarray(arr, dtype="<f4")).cast("B")
        for i in range(0, len(raw), _CHUNK):
            out.append(cobj.compress(raw[i:i + _CHUNK]))
    out.append(cobj.flush())
    return out


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def safetensors_parts(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
                      ) -> list[bytes | memoryview]:
    """The safetensors file of `tensors` (CPU) as parts to write back to back: the header, then each
    tensor's own memory, not copied. safetensors.torch.save builds the whole file in one new buffer
    while holding the GIL (a pause for every request the process serves); this copies nothing.
    safetensors.torch.load reads the parts joined. Tensors are laid out in the order given, widest
    elements first, so each starts aligned to its element size."""
    if np.little_endian is False:  # safetensors is little-endian; a big-endian host takes the slow way
        return [safetensors.torch.save(dict(tensors), metadata=dict(metadata) if metadata else None)]
    order = sorted(tensors, key=lambda name: -tensors[name].element_size())  # stable: same width keeps its order
    fields, datas = [], []
    for name in order:
        t = tensors[name].detach()
        if t.device.type != "cpu" or t.dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: a {t.dtype} tensor on {t.device} cannot be written as safetensors here")
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        fields.append((name, _ST_DTYPES[t.dtype], tuple(t.shape), raw.nbytes))
        datas.append(memoryview(raw))
    return [_safetensors_header(fields, dict(metadata) if metadata else None), *datas]


def _safetensors_header(fields: list[tuple[str, str, tuple[int, ...], int]],
                        metadata: Mapping[str, str] | None) -> bytes:
    """The start of a safetensors file whose tensors (name, dtype, shape, bytes) follow back to back
    in the order given: the 8-byte header length, then the JSON header (metadata first, if any),
    padded with spaces to a multiple of 8."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    pos = 0
    for name, dtype, shape, nbytes in fields:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head


def max_snapshot_bytes(schema: Mapping[str, tuple[int, ...]]) -> int:
    """Largest raw safetensors a snapshot of this schema can be (fp32 + a generous header)."""
    numel = sum(int(torch.Size(s).numel()) for s in schema.values())
    return 4 * numel + 64 * 1024 + 256 * len(schema)


def max_snapshot_wire_bytes(schema: Mapping[str, tuple[int, ...]]) -> int:
    """The most a snapshot of this schema weighs on the wire: its largest safetensors in one zstd
    frame, which grows data it cannot shrink by no more than its compress bound."""
    return zstd_bound(max_snapshot_bytes(schema))


def _decompress(buf: bytes, cap: int) -> bytes:
    """The one zstd frame of `buf`, at most `cap` bytes of it, its end mark and checksum checked."""
    declared = zstandard.get_frame_parameters(buf).content_size
    if declared not in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        # what encode_snapshot writes: the frame says its size, so it is checked against the cap
        # before anything is allocated, and one pass decompresses it into that size and refuses a
        # frame that ends early, holds another size or fails its checksum
        if declared > cap:
            raise SnapshotError(f"snapshot declares {declared} bytes, past the cap of {cap} bytes")
        return zstandard.ZstdDecompressor().decompress(buf)
    # a frame that does not say its size: a bounded read, which stops quietly at the end of its
    # input even mid-frame, then a second pass, now known to be bounded, insists on the frame's end
    raw = zstandard.ZstdDecompressor().stream_reader(buf, read_across_frames=False).read(cap + 1)
    if len(raw) > cap:
        raise SnapshotError(f"snapshot decompresses past the cap of {cap} bytes")
    dobj = zstandard.ZstdDecompressor().decompressobj()
    dobj.decompress(buf)
    if not dobj.eof:
        raise SnapshotError("snapshot is truncated: its zstd frame ends early")
    return raw


def decode_snapshot(buf: bytes, *, schema: Mapping[str, tuple[int, ...]] | None = None,
                    max_raw_bytes: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """-> (params, metadata). With a schema, names and shapes must match it exactly."""
    cap = max_raw_bytes if max_raw_bytes is not None else (
        max_snapshot_bytes(schema) if schema is not None else 1 << 34)
    try:
        raw = _decompress(buf, cap)
    except zstandard.ZstdError as exc:
        raise SnapshotError(f"snapshot is not a valid zstd frame: {exc}") from None
    try:
        tensors = safetensors.torch.load(raw)
        header_len = int.from_bytes(raw[:8], "little")
        outer = json.loads(raw[8:8 + header_len]).get("__metadata__", {}) or {}
        metadata = json.loads(outer["idletrain"]) if "idletrain" in outer else outer
    except Exception as exc:  # safetensors raises its own error types for any malformed header
        raise SnapshotError(f"snapshot is not valid safetensors: {exc}") from None
    if schema is not None:
        if set(tensors) != set(schema):
            missing, extra = sorted(set(schema) - set(tensors)), sorted(set(tensors) - set(schema))
            raise SnapshotError(f"snapshot tensors differ from the model: missing {missing[:3]}, extra {extra[:3]}")
        for name, shape in schema.items():
            if tuple(tensors[name].shape) != tuple(shape):
                raise SnapshotError(f"{name}: snapshot shape {tuple(tensors[name].shape)} != model {tuple(shape)}")
    for name, t in tensors.items():
        if t.dtype != torch.float32:
            raise SnapshotError(f"{name}: dtype {t.dtype}, expected float32")
        if not _all_finite(t):
            raise SnapshotError(f"{name}: snapshot holds NaN or Inf")
    return tensors, dict(metadata)


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in t: its min and max are finite exactly then (NaN propagates through both).
    One pass without a mask, many times faster than isfinite(t).all() on a large tensor."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
