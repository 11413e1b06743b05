"""Sparsification, quantisation and error feedback (shared/algorithms/compress.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shared.algorithms.compress import (
    compress, compress_with_feedback, delta_to_tensors, k_for, quantised, tensor_seed,
)
from shared.codec import IndexKind, ValueKind, decode, encode, seeded_indices
from shared.config import CompressionConfig

SHAPES = {"emb": (40, 8), "w": (7, 5), "b": (13,), "big": (600,)}


def tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}


def cfg(index: str, values: str, *, fraction: float | None = None, ef: bool = True) -> CompressionConfig:
    frac = 1.0 if index == "dense" else (0.1 if fraction is None else fraction)
    return CompressionConfig(index=index, values=values, fraction=frac, error_feedback=ef)


@pytest.mark.parametrize("values", ["fp32", "fp16", "int8", "int4", "int2"])
@pytest.mark.parametrize("index", ["topk", "random", "dense"])
def test_error_feedback_conserves_the_signal(index, values):
    c = cfg(index, values)
    pg, old = tensors(1), tensors(2, scale=0.3)
    delta, new = compress_with_feedback(pg, old, c, base_version=3, round_seed=11)
    sent = delta_to_tensors(delta, SHAPES)
    assert set(new) == set(SHAPES)
    for n in SHAPES:
        torch.testing.assert_close(sent[n] + new[n], pg[n] + old[n], atol=1e-6, rtol=1e-6)
    if index != "dense" or values != "fp32":
        assert any(new[n].abs().max() > 0 for n in SHAPES)  # something was held back
    # a second round with the new residual still conserves the running total
    pg2 = tensors(3)
    delta2, newer = compress_with_feedback(pg2, new, c, base_version=4, round_seed=12)
    sent2 = delta_to_tensors(delta2, SHAPES)
    for n in SHAPES:
        torch.testing.assert_close(sent[n] + sent2[n] + newer[n], pg[n] + pg2[n] + old[n], atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("values", ["fp32", "int2"])
def test_decayed_feedback_keeps_pseudo_gradient_plus_decayed_residual(values):
    """SparseLoCo's accumulator: sent + new_residual == pseudo_grad + decay * old_residual, round
    after round; what was not sent fades by the decay each round it waits."""
    c = CompressionConfig(index="topk", fraction=0.05, values=values, feedback_decay=0.9)
    pg, old = tensors(1), tensors(2, scale=0.3)
    delta, new = compress_with_feedback(pg, old, c, base_version=0, round_seed=1)
    sent = delta_to_tensors(delta, SHAPES)
    for n in SHAPES:
        torch.testing.assert_close(sent[n] + new[n], pg[n] + 0.9 * old[n], atol=1e-6, rtol=1e-6)
    # the decay is applied: the same round at decay 1 keeps a different residual
    _, undecayed = compress_with_feedback(pg, old, c.model_copy(update={"feedback_decay": 1.0}), base_version=0,
                                          round_seed=1)
    assert any(not torch.equal(new[n], undecayed[n]) for n in SHAPES)
    # a second round: the first residual enters decayed once more
    pg2 = tensors(3)
    delta2, newer = compress_with_feedback(pg2, new, c, base_version=1, round_seed=2)
    sent2 = delta_to_tensors(delta2, SHAPES)
    for n in SHAPES:
        torch.testing.assert_close(sent2[n] + newer[n], pg2[n] + 0.9 * new[n], atol=1e-6, rtol=1e-6)
    # with no pseudo-gradient, an unsent element only fades: 0.9 of it stays
    zero = {n: torch.zeros(s) for n, s in SHAPES.items()}
    delta3, faded = compress_with_feedback(zero, newer, c, base_version=2, round_seed=3)
    for e in delta3.entries:
        keep = torch.ones(e.numel, dtype=torch.bool)
        keep[torch.from_numpy(e.indices)] = False
        torch.testing.assert_close(faded[e.name].reshape(-1)[keep], 0.9 * newer[e.name].reshape(-1)[keep])


def test_decay_one_is_plain_error_feedback_bit_for_bit():
    pg, old = tensors(1), tensors(2, scale=0.3)
    c = cfg("topk", "int4")
    assert c.feedback_decay == 1.0
    delta, new = compress_with_feedback(pg, old, c, base_version=0, round_seed=4)
    target = {n: pg[n] + old[n] for n in SHAPES}
    want = quantised(compress(target, c, base_version=0, round_seed=4))
    sent = delta_to_tensors(want, SHAPES)
    for a, b in zip(delta.entries, want.entries):
        assert a.values.tobytes() == b.values.tobytes() and np.array_equal(a.indices, b.indices)
    for n in SHAPES:
        assert torch.equal(new[n], target[n] - sent[n])


def test_feedback_decay_is_validated_and_left_out_of_the_json_at_one():
    with pytest.raises(ValueError, match="error_feedback"):
        CompressionConfig(index="topk", feedback_decay=0.9, error_feedback=False)
    for bad in (0.0, -0.5, 1.01):
        with pytest.raises(ValueError, match="feedback_decay"):
            CompressionConfig(index="topk", feedback_decay=bad)
    assert "feedback_decay" not in CompressionConfig().model_dump_json()  # what a version-2 worker reads
    c = CompressionConfig(index="topk", fraction=0.02, values="int2", feedback_decay=0.95)
    assert CompressionConfig.model_validate_json(c.model_dump_json()) == c
    assert CompressionConfig.model_validate_json(CompressionConfig().model_dump_json()) == CompressionConfig()


def test_error_feedback_first_round_without_residual():
    pg = tensors(1)
    for residual in (None, {}):
        delta, new = compress_with_feedback(pg, residual, cfg("topk", "int8"), base_version=0, round_seed=0)
        sent = delta_to_tensors(delta, SHAPES)
        for n in SHAPES:
            torch.testing.assert_close(sent[n] + new[n], pg[n], atol=1e-6, rtol=1e-6)


def test_residual_is_what_was_not_sent():
    pg = tensors(1)
    delta, new = compress_with_feedback(pg, None, cfg("topk", "fp32"), base_version=0, round_seed=0)
    for e in delta.entries:
        flat_res, flat_pg = new[e.name].reshape(-1), pg[e.name].reshape(-1)
        mask = torch.ones(e.numel, dtype=torch.bool)
        mask[torch.from_numpy(e.indices)] = False
        assert torch.equal(flat_res[mask], flat_pg[mask])  # unsent: kept whole
        assert torch.all(flat_res[~mask] == 0)  # sent exactly (fp32)


@pytest.mark.parametrize("index", ["topk", "random", "dense"])
def test_without_error_feedback_the_residual_is_empty(index):
    c = cfg(index, "int8", ef=False)
    pg = tensors(1)
    delta, res = compress_with_feedback(pg, tensors(2), c, base_version=0, round_seed=5)
    assert res == {}
    # the stale residual offered is ignored: the delta is that of the pseudo-gradient alone
    alone, _ = compress_with_feedback(pg, None, c, base_version=0, round_seed=5)
    for a, b in zip(delta.entries, alone.entries):
        np.testing.assert_array_equal(a.values, b.values)


def test_compress_does_not_mutate_inputs():
    pg, old = tensors(1), tensors(2)
    keep = {n: t.clone() for n, t in pg.items()}
    keep_old = {n: t.clone() for n, t in old.items()}
    _, new = compress_with_feedback(pg, old, cfg("topk", "int4"), base_version=0, round_seed=0)
    for n in SHAPES:
        assert torch.equal(pg[n], keep[n]) and torch.equal(old[n], keep_old[n])
        new[n].add_(1.0)  # the residual is not an alias of anything the caller holds
        assert torch.equal(pg[n], keep[n]) and torch.equal(old[n], keep_old[n])


def test_topk_picks_the_largest_magnitudes():
    rng = np.random.default_rng(0)
    flat = rng.permutation(np.arange(1, 301)).astype(np.float32) * rng.choice([-1, 1], 300)
    t = {"x": torch.from_numpy(flat.copy())}
    delta = compress(t, cfg("topk", "fp32", fraction=0.1), base_version=0, round_seed=0)
    (e,) = delta.entries
    assert e.index_kind is IndexKind.PACKED and e.k == 30
    assert np.all(np.diff(e.indices) > 0)
    assert set(np.abs(flat[e.indices]).tolist()) == set(range(271, 301))
    np.testing.assert_array_equal(e.values, flat[e.indices])


def test_random_selection_is_the_seeded_set_the_receiver_regenerates():
    pg = tensors(1)
    delta = compress(pg, cfg("random", "fp16", fraction=0.2), base_version=9, round_seed=77)
    for e in delta.entries:
        assert e.index_kind is IndexKind.SEEDED and e.seed == tensor_seed(77, e.name)
        assert e.k == k_for(e.numel, 0.2)
        np.testing.assert_array_equal(e.indices, seeded_indices(e.seed, e.numel, e.k))
        np.testing.assert_array_equal(e.values, pg[e.name].reshape(-1).numpy()[e.indices])
    got = decode(encode(delta), schema=SHAPES)
    for a, b in zip(delta.entries, got.entries):
        np.testing.assert_array_equal(a.indices, b.indices)


def test_random_with_fraction_one_equals_dense():
    pg = tensors(1)
    rnd = delta_to_tensors(compress(pg, cfg("random", "fp32", fraction=1.0), base_version=0, round_seed=3), SHAPES)
    dense = delta_to_tensors(compress(pg, cfg("dense", "fp32"), base_version=0, round_seed=3), SHAPES)
    for n in SHAPES:
        assert torch.equal(rnd[n], dense[n]) and torch.equal(dense[n], pg[n])


def test_dense_entries_and_value_kinds():
    delta = compress(tensors(1), cfg("dense", "int4"), base_version=42, round_seed=0)
    assert delta.base_version == 42
    assert [(e.name, e.index_kind, e.value_kind, e.k) for e in delta.entries] == [
        (n, IndexKind.DENSE, ValueKind.INT4, math.prod(s)) for n, s in SHAPES.items()]


def test_quantised_is_what_the_receiver_decodes():
    delta = compress(tensors(1), cfg("topk", "int4", fraction=0.5), base_version=0, round_seed=0)
    q = quantised(delta)
    got = decode(encode(q), schema=SHAPES)
    for a, b in zip(q.entries, got.entries):
        np.testing.assert_array_equal(a.values, b.values)  # quantising twice changes nothing
    assert any(not np.array_equal(a.values, b.values) for a, b in zip(delta.entries, q.entries))


@pytest.mark.parametrize("numel,fraction,k", [
    (100, 0.1, 10), (101, 0.1, 11), (99, 0.1, 10), (10, 0.01, 1), (1, 0.5, 1), (10, 1.0, 10),
    (3, 0.5, 2), (1000, 0.3, 300), (100, 0.07, 7), (200, 0.07, 14), (1100, 0.07, 77), (1_000_003, 0.05, 50_001),
])
def test_k_for_rounds_up_and_stays_in_range(numel, fraction, k):
    assert k_for(numel, fraction) == k


def test_k_for_never_exceeds_numel_or_drops_to_zero():
    for numel in range(1, 400):
        for fraction in (1e-9, 0.01, 0.07, 0.1, 0.3, 0.33, 0.999, 1.0):
            k = k_for(numel, fraction)
            assert 1 <= k <= numel
            assert k >= numel * fraction - 1e-9 and (k == 1 or k - 1 < numel * fraction)


def test_tensor_seed():
    a = tensor_seed(5, "emb")
    assert a == tensor_seed(5, "emb")  # deterministic on both ends
    assert 0 <= a < 2**64
    seeds = {tensor_seed(5, n) for n in ("emb", "w", "b", "big", "blocks.0.attn.qkv.weight")}
    assert len(seeds) == 5  # per name
    assert tensor_seed(6, "emb") != a  # per round
    # equal-sized tensors do not share an index set
    assert seeded_indices(tensor_seed(5, "a"), 1000, 10).tolist() != seeded_indices(tensor_seed(5, "b"), 1000, 10).tolist()


@pytest.mark.parametrize("index,values", [("dense", "int4"), ("topk", "int4"), ("random", "int4"), ("topk", "int2")])
def test_shape_mismatch_accepts_what_compress_makes_and_nothing_less(index, values):
    """The coordinator's check of an upload (issue 18): what compress() makes of a whole model
    passes for every compression; a missing tensor, a short tensor, the wrong index kind or (random)
    another seed is named."""
    from shared.algorithms.compress import shape_mismatch, tensor_seed
    from shared.codec import check_flat

    schema = {"a": (7, 5), "b": (3,), "c": (64,)}
    cfg = (CompressionConfig(index=index, values=values) if index == "dense"
           else CompressionConfig(index=index, fraction=0.3, values=values))
    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(s, generator=gen) for n, s in schema.items()}
    body = encode(compress(grads, cfg, base_version=0, round_seed=11))
    entries = check_flat(body, schema=schema).entries
    assert shape_mismatch(entries, schema, cfg, round_seed=11) is None
    assert "missing ['b']" in shape_mismatch([e for e in entries if e[0] != "b"], schema, cfg, round_seed=11)
    name, kind, vk, numel, k, seed = entries[0]
    short = [(name, kind, vk, numel, k - 1, seed)] + list(entries[1:])
    assert f"{k - 1} values" in shape_mismatch(short, schema, cfg, round_seed=11)
    other_kind = IndexKind.PACKED if kind != IndexKind.PACKED else IndexKind.DENSE
    assert "indices" in shape_mismatch([(name, other_kind, vk, numel, k, None)] + list(entries[1:]), schema, cfg,
                                       round_seed=11)
    if index == "random":
        assert seed == tensor_seed(11, name)
        assert "seed" in shape_mismatch(entries, schema, cfg, round_seed=12)


@pytest.mark.parametrize("run_values", ["fp32", "fp16", "int8", "int4", "int2"])
def test_shape_mismatch_refuses_values_narrower_than_the_runs_and_takes_wider(run_values):
    """A worker may spend more bytes than the run asks (a wider value kind), never fewer: a narrower,
    lossier kind saves its bytes at the run's expense."""
    from shared.algorithms.compress import VALUE_KINDS, shape_mismatch
    from shared.codec import check_flat

    order = ["fp32", "fp16", "int8", "int4", "int2"]  # widest first
    schema = {"a": (7, 5), "b": (300,)}
    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(s, generator=gen) for n, s in schema.items()}
    run = CompressionConfig(index="topk", fraction=0.3, values=run_values)
    for sent in order:
        body = encode(compress(grads, run.model_copy(update={"values": sent}), base_version=0, round_seed=1))
        wrong = shape_mismatch(check_flat(body, schema=schema).entries, schema, run, round_seed=1)
        if order.index(sent) <= order.index(run_values):
            assert wrong is None, (sent, wrong)
        else:
            assert wrong == (f"a: {VALUE_KINDS[sent].name.lower()} values, narrower than the run's compression "
                             f"values {run_values!r}: send {run_values!r} or a wider kind")
