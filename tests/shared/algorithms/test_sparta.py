"""Sparse elastic averaging with the global model (shared/algorithms/sparta.py)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import zstandard

from shared import codec
from shared.algorithms.compress import k_for, tensor_seed
from shared.algorithms.sparta import apply_correction, exchange_seed, mix_into_centre, select
from shared.codec.envelope import HEADER
from shared.codec.values import VALUE_CODECS

SHAPES = {"emb": (40, 8), "w": (7, 5), "b": (13,), "big": (600,)}


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def clone(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in ts.items()}


def test_exchange_seed_is_deterministic_and_distinct():
    assert exchange_seed(123, 4) == exchange_seed(123, 4)
    seeds = {exchange_seed(lease, step) for lease in (1, 2, 2**62) for step in range(1, 50)}
    assert len(seeds) == 3 * 49
    assert all(0 <= s < 2**63 for s in seeds)


def test_select_takes_the_seeded_indices_of_every_tensor():
    w = tensors(0)
    sent = select(w, p=0.1, seed=99, values="fp16", base_version=7)
    assert sent.base_version == 7
    assert [e.name for e in sent.entries] == list(SHAPES)
    for e in sent.entries:
        numel = w[e.name].numel()
        assert e.index_kind == codec.IndexKind.SEEDED and e.value_kind == codec.ValueKind.FP16
        assert e.seed == tensor_seed(99, e.name)
        assert e.k == k_for(numel, 0.1)
        np.testing.assert_array_equal(e.indices, codec.seeded_indices(e.seed, numel, e.k))
        np.testing.assert_array_equal(e.values, w[e.name].reshape(-1).numpy()[e.indices])
    # another seed, other indices
    other = select(w, p=0.1, seed=100, values="fp16")
    assert any(not np.array_equal(a.indices, b.indices) for a, b in zip(sent.entries, other.entries))


def test_sent_bytes_carry_a_seed_not_indices():
    w = tensors(1)
    sent = select(w, p=0.25, seed=5, values="fp16")
    blob = codec.encode(sent)
    raw = zstandard.ZstdDecompressor().decompress(blob[HEADER.size:])
    fp16 = VALUE_CODECS[codec.ValueKind.FP16]
    # body header, then per tensor: name, kinds/numel/k, an 8-byte seed and the values; nothing else
    expected = 12 + sum(2 + len(e.name) + 18 + 8 + fp16.nbytes(e.k) for e in sent.entries)
    assert len(raw) == expected
    back = codec.decode(blob, schema=SHAPES)
    for a, b in zip(sent.entries, back.entries):
        assert b.index_kind == codec.IndexKind.SEEDED and b.seed == a.seed
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_allclose(a.values, b.values, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("alpha", [0.5, 0.25])
def test_mix_changes_only_the_selected_coordinates(alpha):
    w, c = tensors(2), tensors(3)
    c0 = clone(c)
    sent = select(w, p=0.1, seed=11, values="fp32")
    corr = mix_into_centre(c, sent, alpha=alpha, values="fp32")
    for e, d in zip(sent.entries, corr.entries):
        assert d.name == e.name and d.seed == e.seed and d.index_kind == codec.IndexKind.SEEDED
        np.testing.assert_array_equal(d.indices, e.indices)
        flat0, flat = c0[e.name].reshape(-1), c[e.name].reshape(-1)
        mask = torch.zeros(flat.numel(), dtype=torch.bool)
        mask[torch.from_numpy(e.indices)] = True
        assert torch.equal(flat[~mask], flat0[~mask])
        want_d = alpha * (torch.from_numpy(e.values) - flat0[mask])
        torch.testing.assert_close(torch.from_numpy(d.values), want_d)
        torch.testing.assert_close(flat[mask], flat0[mask] + want_d)


def test_p1_alpha_half_meets_at_the_average():
    w, c = tensors(4), tensors(5)
    avg = {n: (w[n] + c[n]) / 2 for n in w}
    sent = select(w, p=1.0, seed=3, values="fp32")
    assert all(e.k == w[e.name].numel() for e in sent.entries)
    corr = mix_into_centre(c, sent, alpha=0.5, values="fp32")
    apply_correction(w, codec.decode(codec.encode(corr), schema=SHAPES))
    for n in w:
        torch.testing.assert_close(c[n], avg[n])
        torch.testing.assert_close(w[n], avg[n])


def test_correction_keeps_progress_made_while_it_was_in_flight():
    w, c = tensors(6), tensors(7)
    sent = select(w, p=0.3, seed=8, values="fp32")
    corr = mix_into_centre(c, sent, alpha=0.5, values="fp32")
    # the worker trains on while the answer travels
    g = torch.Generator().manual_seed(9)
    progress = {n: torch.randn(t.shape, generator=g) * 0.1 for n, t in w.items()}
    for n in w:
        w[n] += progress[n]
    moved = clone(w)
    apply_correction(w, corr)
    sent_by_name = {e.name: e for e in sent.entries}
    for e in corr.entries:
        idx = torch.from_numpy(e.indices)
        d = torch.from_numpy(e.values)
        want = moved[e.name].reshape(-1).clone()
        want[idx] -= d  # w -= d: nothing is overwritten
        torch.testing.assert_close(w[e.name].reshape(-1), want)
        # at the exchanged indices: what was sent, pulled halfway to the centre, plus the later progress
        sent_vals = torch.from_numpy(sent_by_name[e.name].values)
        torch.testing.assert_close(w[e.name].reshape(-1)[idx], sent_vals - d + progress[e.name].reshape(-1)[idx])


def test_empty_delta_round_trips():
    blob = codec.encode(codec.Delta(base_version=12, entries=()))
    assert struct.unpack_from("<4sB3xQ", blob)[2] == 12  # just the body header
    back = codec.decode(blob, schema=SHAPES)
    assert back.base_version == 12 and back.entries == ()
    assert all(not a.any() for a in back.to_dense(SHAPES).values())
