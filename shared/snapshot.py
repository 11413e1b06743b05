"""Model snapshots on the wire and on disk: zstd(safetensors), never pickle.

A worker must be safe from a malicious coordinator too, so decoding checks the size before
and while decompressing, then names, shapes, dtype and finiteness against the model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import safetensors.torch
import torch
import zstandard

from shared.errors import SnapshotError


def encode_snapshot(params: Mapping[str, torch.Tensor], *, metadata: Mapping[str, str] | None = None,
                    level: int = 3) -> bytes:
    tensors = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in params.items()}
    # safetensors writes a metadata map in arbitrary order; one key holding sorted JSON keeps
    # the bytes (and so the snapshot's hash) a pure function of its contents.
    meta = {"idletrain": json.dumps(dict(metadata or {}), sort_keys=True)}
    raw = safetensors.torch.save(tensors, metadata=meta)
    return zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True).compress(raw)


def max_snapshot_bytes(schema: Mapping[str, tuple[int, ...]]) -> int:
    """Largest raw safetensors a snapshot of this schema can be (fp32 + a generous header)."""
    numel = sum(int(torch.Size(s).numel()) for s in schema.values())
    return 4 * numel + 64 * 1024 + 256 * len(schema)


def decode_snapshot(buf: bytes, *, schema: Mapping[str, tuple[int, ...]] | None = None,
                    max_raw_bytes: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """-> (params, metadata). With a schema, names and shapes must match it exactly."""
    cap = max_raw_bytes if max_raw_bytes is not None else (
        max_snapshot_bytes(schema) if schema is not None else 1 << 34)
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(buf, read_across_frames=False)
        raw = reader.read(cap + 1)
        if len(raw) > cap:
            raise SnapshotError(f"snapshot decompresses past the cap of {cap} bytes")
        # The reader stops quietly at the end of its input, even mid-frame; a second pass, now
        # known to be bounded, insists on the frame's end mark and checksum.
        dobj = zstandard.ZstdDecompressor().decompressobj()
        dobj.decompress(buf)
        if not dobj.eof:
            raise SnapshotError("snapshot is truncated: its zstd frame ends early")
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
        if not torch.isfinite(t).all():
            raise SnapshotError(f"{name}: snapshot holds NaN or Inf")
    return tensors, dict(metadata)
