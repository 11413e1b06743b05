"""Model snapshots: zstd(safetensors), checked on load (shared/snapshot.py)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import safetensors.torch
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import SnapshotError
from shared.snapshot import (decode_snapshot, encode_snapshot, encode_snapshot_flat, encode_snapshot_flat_parts,
                             max_snapshot_bytes, safetensors_parts)

SCHEMA = {"a.weight": (4, 3), "b": (5,)}


def params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SCHEMA.items()}


def framed(tensors: dict[str, torch.Tensor], metadata=None) -> bytes:
    """A snapshot written without encode_snapshot's own conversions (any dtype goes through)."""
    raw = safetensors.torch.save({n: t.contiguous() for n, t in tensors.items()}, metadata=metadata)
    return zstandard.ZstdCompressor().compress(raw)


def test_round_trip():
    p = params()
    buf = encode_snapshot(p, metadata={"version": "7", "run": "t"})
    got, meta = decode_snapshot(buf, schema=SCHEMA)
    assert meta == {"version": "7", "run": "t"}
    assert set(got) == set(SCHEMA)
    for n in SCHEMA:
        assert got[n].dtype == torch.float32 and torch.equal(got[n], p[n])
    # without a schema, and without metadata
    got2, meta2 = decode_snapshot(encode_snapshot(p))
    assert meta2 == {} and all(torch.equal(got2[n], p[n]) for n in SCHEMA)


def test_encode_converts_to_contiguous_fp32_and_does_not_touch_the_input():
    p = {"a.weight": torch.randn(3, 4, dtype=torch.float64).T, "b": torch.arange(5, dtype=torch.float16)}
    got, _ = decode_snapshot(encode_snapshot(p), schema=SCHEMA)
    assert got["a.weight"].dtype == torch.float32 and torch.equal(got["a.weight"], p["a.weight"].float())
    assert got["b"].tolist() == [0, 1, 2, 3, 4]
    assert p["b"].dtype == torch.float16


def test_refuses_wrong_names():
    p = params()
    p["c"] = p.pop("b")
    with pytest.raises(SnapshotError, match=r"missing \['b'\], extra \['c'\]"):
        decode_snapshot(encode_snapshot(p), schema=SCHEMA)
    with pytest.raises(SnapshotError, match="missing"):
        decode_snapshot(encode_snapshot({"a.weight": torch.zeros(4, 3)}), schema=SCHEMA)


def test_refuses_wrong_shapes():
    p = params()
    p["a.weight"] = torch.zeros(3, 4)  # same numel, other shape
    with pytest.raises(SnapshotError, match=r"a.weight: snapshot shape \(3, 4\) != model \(4, 3\)"):
        decode_snapshot(encode_snapshot(p), schema=SCHEMA)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int32, torch.bfloat16])
def test_refuses_wrong_dtype(dtype):
    p = params()
    p["b"] = p["b"].to(dtype)
    with pytest.raises(SnapshotError, match=r"b: dtype torch\.\w+, expected float32"):
        decode_snapshot(framed(p), schema=SCHEMA)
    with pytest.raises(SnapshotError, match="expected float32"):
        decode_snapshot(framed(p))  # checked without a schema too


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_refuses_non_finite(bad):
    p = params()
    p["a.weight"][2, 1] = bad
    with pytest.raises(SnapshotError, match="a.weight: snapshot holds NaN or Inf"):
        decode_snapshot(encode_snapshot(p), schema=SCHEMA)


@pytest.mark.parametrize("buf", [b"", b"garbage bytes that are not zstd", bytes(range(256)) * 4])
def test_refuses_non_zstd_bytes(buf):
    with pytest.raises(SnapshotError):
        decode_snapshot(buf, schema=SCHEMA)


@pytest.mark.parametrize("raw", [
    b"\x00" * 64,  # header length 0
    struct.pack("<Q", 10_000) + b"{}",  # header longer than the data
    struct.pack("<Q", 5) + b"notjs",
    struct.pack("<Q", 2) + b"[]",
])
def test_refuses_garbage_inside_a_valid_frame(raw):
    with pytest.raises(SnapshotError, match="not valid safetensors"):
        decode_snapshot(zstandard.ZstdCompressor().compress(raw), schema=SCHEMA)


def test_refuses_offsets_past_the_data():
    header = json.dumps({"b": {"dtype": "F32", "shape": [5], "data_offsets": [0, 400]}}).encode()
    raw = struct.pack("<Q", len(header)) + header + b"\x00" * 20
    with pytest.raises(SnapshotError, match="not valid safetensors"):
        decode_snapshot(zstandard.ZstdCompressor().compress(raw))


def test_refuses_corrupt_frame():
    buf = bytearray(encode_snapshot(params()))
    buf[len(buf) // 2] ^= 0xFF
    with pytest.raises(SnapshotError):
        decode_snapshot(bytes(buf), schema=SCHEMA)
    with pytest.raises(SnapshotError):
        decode_snapshot(bytes(buf[: len(buf) // 2]), schema=SCHEMA)


def test_refuses_a_frame_whose_checksum_is_wrong():
    buf = bytearray(encode_snapshot(params()))
    buf[-1] ^= 0xFF  # the last byte of the frame's content checksum
    with pytest.raises(SnapshotError, match="not a valid zstd frame"):
        decode_snapshot(bytes(buf), schema=SCHEMA)


def test_unsized_frames_decode_as_sized_ones_do():
    p = params()
    raw = zstandard.ZstdDecompressor().decompress(encode_snapshot(p))
    unsized = zstandard.ZstdCompressor(write_content_size=False, write_checksum=True).compress(raw)
    assert zstandard.get_frame_parameters(unsized).content_size == zstandard.CONTENTSIZE_UNKNOWN
    got, _ = decode_snapshot(unsized, schema=SCHEMA)
    assert all(torch.equal(got[n], p[n]) for n in SCHEMA)
    with pytest.raises(SnapshotError, match="truncated"):
        decode_snapshot(unsized[: len(unsized) - 3], schema=SCHEMA)


def test_size_cap():
    buf = encode_snapshot(params())
    raw_size = len(zstandard.ZstdDecompressor().decompress(buf))
    assert decode_snapshot(buf, max_raw_bytes=raw_size)[0].keys() == set(SCHEMA)
    with pytest.raises(SnapshotError, match=f"past the cap of {raw_size - 1} bytes"):
        decode_snapshot(buf, max_raw_bytes=raw_size - 1)
    # a bomb: a tiny frame of a huge, unsized body stops at the schema's cap
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(64 << 20))
    assert len(bomb) < 64 << 10
    with pytest.raises(SnapshotError, match=f"past the cap of {max_snapshot_bytes(SCHEMA)} bytes"):
        decode_snapshot(bomb, schema=SCHEMA)
    # a sized bomb is refused by what its frame declares, before anything is decompressed
    sized = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    with pytest.raises(SnapshotError, match=f"declares {64 << 20} bytes, past the cap of {max_snapshot_bytes(SCHEMA)}"):
        decode_snapshot(sized, schema=SCHEMA)


def test_max_snapshot_bytes_fits_real_snapshots():
    schema = {f"layer.{i}.weight": (64, 64) for i in range(20)}
    p = {n: torch.zeros(s) for n, s in schema.items()}
    raw = zstandard.ZstdDecompressor().decompress(encode_snapshot(p, metadata={"k": "v" * 1000}))
    assert len(raw) <= max_snapshot_bytes(schema)
    assert max_snapshot_bytes(schema) < 4 * 20 * 64 * 64 + 128 * 1024


def test_from_one_flat_vector_the_same_bytes(monkeypatch):
    """encode_snapshot_flat (the coordinator's flat weights) writes what encode_snapshot writes for
    the same tensors, byte for byte, also when the data goes to zstd in several pieces; safetensors'
    own reader reads it."""
    import shared.snapshot as snap

    p = params(3)
    flat = torch.cat([p[n].reshape(-1) for n in SCHEMA])
    meta = {"version": "9", "run": "t"}
    buf = encode_snapshot_flat(flat, SCHEMA, metadata=meta)
    assert buf == encode_snapshot(p, metadata=meta)
    monkeypatch.setattr(snap, "_CHUNK", 8)  # 8-byte pieces
    assert encode_snapshot_flat(flat, SCHEMA, metadata=meta) == buf
    got, got_meta = decode_snapshot(buf, schema=SCHEMA)
    assert got_meta == meta and all(torch.equal(got[n], p[n]) for n in SCHEMA)
    raw = zstandard.ZstdDecompressor().decompress(buf)
    theirs = safetensors.torch.load(raw)
    assert all(torch.equal(theirs[n], p[n]) for n in SCHEMA)
    with pytest.raises(ValueError, match="hold 16 values"):
        encode_snapshot_flat(flat[:-1], SCHEMA)
    with pytest.raises(ValueError, match="contiguous fp32"):
        encode_snapshot_flat(flat.double(), SCHEMA)


def test_safetensors_parts_are_a_file_safetensors_reads_built_from_the_tensors_own_memory():
    tensors = {"flat/t": torch.randn(7), "idx": torch.arange(5, dtype=torch.int64), "half": torch.randn(3).half(),
               "bf": torch.randn(2, 2).bfloat16(), "mask": torch.tensor([True, False, True]),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    meta = {"version": "12", "outer_form": "flat1"}
    parts = safetensors_parts(tensors, meta)
    raw = b"".join(bytes(p) for p in parts)
    back = safetensors.torch.load(raw)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    head_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + head_len])
    assert header["__metadata__"] == meta and (8 + head_len) % 8 == 0
    starts = {name: header[name]["data_offsets"][0] for name in tensors}
    assert all(starts[n] % tensors[n].element_size() == 0 for n in tensors)  # each aligned to its element
    # the data parts are the tensors' memory, not copies
    assert np.shares_memory(np.asarray(parts[1 + sorted(tensors, key=lambda n: -tensors[n].element_size())
                                                 .index("flat/t")]), tensors["flat/t"].numpy())
    with pytest.raises(ValueError, match="complex"):
        safetensors_parts({"c": torch.zeros(2, dtype=torch.complex64)})


def test_encode_snapshot_flat_parts_join_to_encode_snapshot_flat():
    flat = torch.randn(17)
    parts = encode_snapshot_flat_parts(flat, SCHEMA, metadata={"v": "1"})
    assert len(parts) > 1 and b"".join(parts) == encode_snapshot_flat(flat, SCHEMA, metadata={"v": "1"})


@given(st.integers(1, 5000), st.data())
@settings(max_examples=200, deadline=None)
def test_the_finiteness_check_finds_any_nan_or_inf(n, data):
    # decode_snapshot's one-pass check (min and max) against the elementwise definition
    from shared.snapshot import _all_finite

    t = torch.randn(n)
    for _ in range(data.draw(st.integers(0, 3), label="bad values")):
        t[data.draw(st.integers(0, n - 1), label="where")] = data.draw(
            st.sampled_from([float("nan"), float("inf"), float("-inf")]), label="what")
    assert _all_finite(t) == bool(torch.isfinite(t).all())
