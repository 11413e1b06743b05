"""What each download of a lease can weigh, from the lease alone, never from what the answer claims:
the client reads each answer under its kind's cap (worker/reading.py), and within the machine's
own cap (memory.download_cap_bytes) always.

    snapshot    the lease model's fp32 safetensors (shared/snapshot.py) in one zstd frame
    update      a dense int8 change of every tensor (int8 is the widest of update_values) in its envelope
    shard       the largest shard a run may cut (MAX_SHARD_TOKENS ids of the lease's token dtype) in one
                zstd frame: a lease does not name its run's shard_tokens
    tokenizer   a tokenizer.json of the model's vocab (shared/tokenizer.py's max_json_bytes)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from shared import codec
from shared.config import MAX_SHARD_TOKENS
from shared.snapshot import max_snapshot_wire_bytes
from shared.tokenizer import max_json_bytes

Schema = Mapping[str, tuple[int, ...]]


def snapshot_cap_bytes(schema: Schema) -> int:
    """The most a snapshot of a model of this schema (shared.model.meta_schema) weighs on the wire."""
    return max_snapshot_wire_bytes(schema)


def update_cap_bytes(schema: Schema) -> int:
    """The most a model update of this schema weighs: every tensor dense at int8, its envelope and zstd."""
    return codec.encoded_bound([(name, codec.IndexKind.DENSE, codec.ValueKind.INT8, math.prod(shape),
                                 math.prod(shape)) for name, shape in schema.items()])


def shard_raw_cap_bytes(token_dtype: str) -> int:
    """The most a shard's tokens (decompressed) can weigh in this dtype."""
    return MAX_SHARD_TOKENS * np.dtype(token_dtype).itemsize


def shard_cap_bytes(token_dtype: str) -> int:
    """The most a shard's zstd frame weighs on the wire."""
    return codec.zstd_bound(shard_raw_cap_bytes(token_dtype))


def tokenizer_cap_bytes(vocab_size: int) -> int:
    """The most a run's tokenizer.json of `vocab_size` tokens weighs."""
    return max_json_bytes(vocab_size)
