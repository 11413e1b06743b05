"""The delta wire format.

    envelope.py  the versioned envelope: encode(Delta) -> bytes, decode(bytes, schema) -> Delta;
                 MAX_UPLOAD_RATIO: how much a volunteer's frame may expand (max_ratio=); encoded_bound
                 and zstd_bound: the most bytes an encoded delta, or any zstd frame, can take
    flat.py      decode_flat(bytes, schema) -> FlatDelta (global indices over the tensors end to end);
                 check_flat(bytes, schema): decode_flat's checks alone (an upload's, before its 202)
    indices.py   which elements travel: DENSE, SEEDED (only a seed travels), PACKED (bit-packed list)
    values.py    how values travel: FP32, FP16, INT8 and INT4 with per-block scales, INT2 (two magnitudes
                 per block), INT1 (a sign bit and one magnitude per block)

A golden file (tests/golden/delta_v1.bin) pins the bytes of format version 1.
"""

from shared.codec.envelope import (FORMAT_VERSION, MAGIC, MAX_UPLOAD_RATIO, Delta, Entry, decode, encode,
                                   encoded_bound, max_body_bytes, zstd_bound)
from shared.codec.flat import DeltaSummary, FlatDelta, check_flat, decode_flat, flat_offsets
from shared.codec.indices import IndexKind, seeded_indices, seeded_indices_many, splitmix64
from shared.codec.values import BLOCK, ValueKind

__all__ = [
    "BLOCK", "FORMAT_VERSION", "MAGIC", "MAX_UPLOAD_RATIO", "Delta", "DeltaSummary", "Entry",
    "encoded_bound", "FlatDelta", "IndexKind",
    "ValueKind", "check_flat", "decode", "decode_flat", "encode", "flat_offsets", "max_body_bytes", "seeded_indices",
    "seeded_indices_many", "splitmix64", "zstd_bound",
]
