"""Golden files pin delta format version 1, so the wire format cannot change silently.

    tests/golden/delta_v1.body  the decompressed body: pins the format itself
    tests/golden/delta_v1.bin   the whole envelope as encode(..., level=3) wrote it

zstd's output may legitimately change between libzstd releases, so the envelope is compared
as header + decompressed body; the raw compressed bytes are compared only under the libzstd
version that wrote them. The body is also rebuilt by hand from the layout documented in
shared/codec/envelope.py, so the golden file, the encoder and the documentation must all agree.

Regenerate (only for a deliberate format change, which also needs a new FORMAT_VERSION):

    python tests/shared/codec/test_golden.py --regenerate
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import zstandard

from shared.codec import FORMAT_VERSION, Delta, Entry, IndexKind, ValueKind, decode, encode, seeded_indices

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
BIN, BODY = GOLDEN / "delta_v1.bin", GOLDEN / "delta_v1.body"
GOLDEN_ZSTD_VERSION = (1, 5, 7)  # libzstd that wrote delta_v1.bin; update together with the file

SCHEMA = {"tok.weight": (16, 8), "attn.qkv": (300,), "mlp.weight": (20, 30), "ln.bias": (9,)}
BASE_VERSION = 12345
SEED = 0x0123456789ABCDEF

# Every value below is exactly representable by its codec, so decoding gives them back bit for bit.
TOK = ((np.arange(128) % 29 - 14) / 4).astype(np.float32)  # fp32
QKV = ((np.arange(40) - 20) / 8).astype(np.float32)  # fp16
MLP_IDX = 2 * np.arange(300, dtype=np.int64)  # 0, 2, .., 598: 10-bit indices, two int8 blocks
MLP_Q = np.concatenate([np.arange(256) % 255 - 127, 127 - 5 * np.arange(44)]).astype(np.int8)
MLP_SCALES = np.array([0.5, 0.25], np.float32)  # each block's absmax / 127
MLP = (MLP_Q.astype(np.float32) * np.repeat(MLP_SCALES, 256)[:300]).astype(np.float32)
LN_IDX = np.array([0, 2, 3, 7, 8], np.int64)  # 4-bit indices, odd k pads the last nibble
LN_Q = np.array([7, -7, 3, 0, -1], np.int8)
LN = (LN_Q * np.float32(0.25)).astype(np.float32)
PINNED_QKV_HEAD = [4, 9, 18, 22, 46, 47, 68, 75]  # seeded_indices(SEED, 300, 40)[:8]


def golden_delta() -> Delta:
    return Delta(base_version=BASE_VERSION, entries=(
        Entry("tok.weight", 128, IndexKind.DENSE, ValueKind.FP32, TOK),
        Entry("attn.qkv", 300, IndexKind.SEEDED, ValueKind.FP16, QKV, seeded_indices(SEED, 300, 40), SEED),
        Entry("mlp.weight", 600, IndexKind.PACKED, ValueKind.INT8, MLP, MLP_IDX),
        Entry("ln.bias", 9, IndexKind.PACKED, ValueKind.INT4, LN, LN_IDX),
    ))


def _bitpack(indices, width: int) -> bytes:
    bits = "".join(format(int(i), f"0{width}b") for i in indices)
    bits += "0" * (-len(bits) % 8)
    return bytes([width]) + int(bits, 2).to_bytes(len(bits) // 8, "big")


def hand_built_body() -> bytes:
    """The body, written from the documented layout with struct alone."""
    def head(name: str, ik: int, vk: int, numel: int, k: int) -> bytes:
        return struct.pack("<H", len(name)) + name.encode() + struct.pack("<BBQQ", ik, vk, numel, k)

    nib = [int(q) + 8 for q in LN_Q] + [8]
    return b"".join([
        struct.pack("<QI", BASE_VERSION, 4),
        head("tok.weight", 0, 0, 128, 128), struct.pack("<128f", *TOK),
        head("attn.qkv", 1, 1, 300, 40), struct.pack("<Q", SEED), struct.pack("<40e", *QKV),
        head("mlp.weight", 2, 2, 600, 300), _bitpack(MLP_IDX, 10),
        struct.pack("<2f", *MLP_SCALES), struct.pack("<300b", *MLP_Q),
        head("ln.bias", 2, 3, 9, 5), _bitpack(LN_IDX, 4),
        struct.pack("<f", 0.25), bytes(lo | hi << 4 for lo, hi in zip(nib[0::2], nib[1::2])),
    ])


def split(buf: bytes) -> tuple[bytes, bytes]:
    """(16-byte header, decompressed body) of an envelope."""
    return buf[:16], zstandard.ZstdDecompressor().decompress(buf[16:])


def test_body_is_the_documented_layout():
    assert BODY.read_bytes() == hand_built_body()


def test_encoder_writes_the_golden_body():
    header, body = split(encode(golden_delta(), level=3))
    assert body == BODY.read_bytes()
    assert header == b"IDTD" + bytes([FORMAT_VERSION, 0, 0, 0]) + struct.pack("<Q", len(body))


def test_golden_envelope_header_and_body():
    assert FORMAT_VERSION == 1, "a new format version needs its own golden file; keep delta_v1 decodable or refuse it"
    assert split(BIN.read_bytes()) == split(encode(golden_delta(), level=3))
    assert split(BIN.read_bytes())[1] == BODY.read_bytes()


def test_golden_envelope_exact_bytes():
    if zstandard.ZSTD_VERSION != GOLDEN_ZSTD_VERSION:
        import pytest
        pytest.skip(f"libzstd {zstandard.ZSTD_VERSION} may compress differently from {GOLDEN_ZSTD_VERSION}")
    assert encode(golden_delta(), level=3) == BIN.read_bytes()


def test_decode_golden_file():
    d = decode(BIN.read_bytes(), schema=SCHEMA)
    assert d.base_version == BASE_VERSION
    assert [(e.name, e.index_kind, e.value_kind, e.numel, e.k) for e in d.entries] == [
        ("tok.weight", IndexKind.DENSE, ValueKind.FP32, 128, 128),
        ("attn.qkv", IndexKind.SEEDED, ValueKind.FP16, 300, 40),
        ("mlp.weight", IndexKind.PACKED, ValueKind.INT8, 600, 300),
        ("ln.bias", IndexKind.PACKED, ValueKind.INT4, 9, 5),
    ]
    tok, qkv, mlp, ln = d.entries
    assert tok.indices is None and tok.values.tolist() == TOK.tolist()
    assert qkv.seed == SEED and qkv.values.tolist() == QKV.tolist()
    # the seeded index set itself is pinned too (not just "whatever seeded_indices says today")
    assert qkv.indices[:8].tolist() == PINNED_QKV_HEAD
    assert mlp.indices.tolist() == MLP_IDX.tolist() and mlp.values.tolist() == MLP.tolist()
    assert ln.indices.tolist() == [0, 2, 3, 7, 8] and ln.values.tolist() == [1.75, -1.75, 0.75, 0.0, -0.25]
    dense = d.to_dense(SCHEMA)
    assert dense["mlp.weight"].reshape(-1)[1::2].tolist() == [0.0] * 300
    assert dense["ln.bias"].tolist() == [1.75, 0, -1.75, 0.75, 0, 0, 0, 0.0, -0.25]


def regenerate() -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    buf = encode(golden_delta(), level=3)
    BIN.write_bytes(buf)
    BODY.write_bytes(split(buf)[1])
    print(f"wrote {BIN} ({len(buf)} bytes) and {BODY}; libzstd {zstandard.ZSTD_VERSION}: "
          f"set GOLDEN_ZSTD_VERSION to match")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(f"usage: python {sys.argv[0]} --regenerate   (rewrites the golden files)")
    regenerate()
