"""worker/sizes.py: what a lease's downloads can weigh. Honest bytes, the least compressible a
coordinator serves, stay within the caps; the caps stay near them (a 3 GiB answer is not)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import zstandard

from shared import codec
from shared.algorithms import sync
from shared.model import ModelConfig, meta_schema
from shared.protocol import MAX_ID
from shared.snapshot import run_snapshot_parts
from worker import memory, sizes

MODELS = [ModelConfig(n_layer=1, d_model=32, n_head=2, context=32),
          ModelConfig(arch="llama", vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, d_model=64, context=64)]


def _random(schema, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in schema.items()}


@pytest.mark.parametrize("cfg", MODELS, ids=["gpt", "llama"])
def test_a_snapshot_of_random_weights_fits_its_cap_and_the_cap_is_near_it(cfg):
    """Random fp32 is what zstd cannot shrink; the longest run name and version make the longest header."""
    schema = meta_schema(cfg)
    params = _random(schema, 0)
    flat = torch.cat([t.reshape(-1) for t in params.values()])
    parts = run_snapshot_parts(flat, schema, run="r" * 64, version=MAX_ID, model=cfg.to_dict())
    size = sum(len(p) for p in parts)
    cap = sizes.snapshot_cap_bytes(schema)
    assert size <= cap < 1.3 * size + (96 << 10)  # zstd takes ~8% off random fp32: its exponents repeat
    assert cap < memory.snapshot_bytes(cfg.n_params())  # tighter than the machine's rule for the same model


@pytest.mark.parametrize("cfg", MODELS, ids=["gpt", "llama"])
def test_an_int8_update_of_random_changes_fits_its_cap(cfg):
    schema = meta_schema(cfg)
    old, new = _random(schema, 1), _random(schema, 2)
    blob = codec.encode(sync.model_update(old, new, from_version=3, values="int8"))
    cap = sizes.update_cap_bytes(schema)
    assert len(blob) <= cap < 1.2 * len(blob) + 4096
    for values in ("int4", "int2", "int1"):  # the narrower update_values weigh less
        assert len(codec.encode(sync.model_update(old, new, from_version=3, values=values))) < cap


@pytest.mark.parametrize("n", [0, 1, 1000, (128 << 10) - 1, 128 << 10, 1 << 20])
def test_zstd_bound_holds_for_random_bytes(n):
    raw = os.urandom(n)
    for level in (1, 3, 19):
        assert len(zstandard.ZstdCompressor(level=level, write_checksum=True,
                                            write_content_size=True).compress(raw)) <= codec.zstd_bound(n)


def test_a_shard_cap_is_the_largest_shard_a_run_may_cut_in_its_dtype():
    for dtype, width in (("uint8", 1), ("uint16", 2), ("uint32", 4)):
        assert sizes.shard_raw_cap_bytes(dtype) == width << 30
        assert width << 30 < sizes.shard_cap_bytes(dtype) < (width << 30) * 1.01
    ids = np.random.default_rng(0).integers(0, 1 << 16, 1 << 16, dtype=np.uint16).tobytes()
    assert len(zstandard.ZstdCompressor(level=3).compress(ids)) <= codec.zstd_bound(len(ids))
