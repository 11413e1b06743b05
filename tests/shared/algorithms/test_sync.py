"""Incremental model updates: new - old, int8-quantised, through the wire format."""

from __future__ import annotations

import pytest
import torch

from shared import codec
from shared.algorithms.sync import apply_update, model_update


def params(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g) * scale, "a.bias": torch.randn(32, generator=g) * scale}


SCHEMA = {"a.weight": (64, 32), "a.bias": (32,)}


def test_update_brings_old_to_new_within_int8_rounding():
    old = params(0)
    new = {n: t + 0.01 * params(1)[n] for n, t in old.items()}
    body = codec.encode(model_update(old, new, from_version=7))
    update = codec.decode(body, schema=SCHEMA)
    assert update.base_version == 7 and all(e.value_kind == codec.ValueKind.INT8 for e in update.entries)
    got = {n: t.clone() for n, t in old.items()}
    apply_update(got, update)
    for n in new:
        change = (new[n] - old[n]).abs().max()
        err = (got[n] - new[n]).abs().max()
        assert err <= change / 254 * 1.01 + 1e-7, (n, float(err), float(change))
    # the update is much smaller than the model it replaces
    assert len(body) < 0.35 * sum(4 * t.numel() for t in new.values())


def test_no_change_is_exact():
    old = params(0)
    got = {n: t.clone() for n, t in old.items()}
    apply_update(got, codec.decode(codec.encode(model_update(old, old, from_version=0)), schema=SCHEMA))
    assert all(torch.equal(got[n], old[n]) for n in old)


def test_mismatched_versions_are_refused():
    with pytest.raises(ValueError):
        model_update(params(0), {"a.weight": torch.zeros(64, 32)}, from_version=0)
