"""RunRuntime's merge path (flat decode, flat screen, lazy momentum) against the plain rule it replaces."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest
import safetensors.torch
import torch

from coordinator import checkpoints
from coordinator.runtime import RunRuntime
from coordinator.storage import Storage
from shared import codec
from shared.algorithms import robust, sparta
from shared.algorithms.compress import compress, quantised
from shared.algorithms.outer import OuterState, apply_delta, staleness_weight
from shared.codec import Delta, Entry, IndexKind, ValueKind
from shared.config import CompressionConfig, OuterConfig, RobustConfig, RunConfig
from shared.model import ModelConfig, build_model, get_params, param_schema

MODEL = ModelConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, context=16)


@pytest.fixture(autouse=True, params=[True, False], ids=["lazy", "plain"])
def lazy(request, monkeypatch) -> bool:
    """Every test on both forms: the lazy momentum step (big models) and the plain one (small)."""
    monkeypatch.setattr(RunRuntime, "lazy_momentum", request.param)
    return request.param


def config(**outer) -> RunConfig:
    return RunConfig(name="rt", model=MODEL, seed=3, outer=OuterConfig(**outer),
                     # random deltas: no agreement asked of large ones, or none would be clipped here
                     robust=RobustConfig(min_history=3, window=8, min_agreement=-1.0))


def deltas(n: int, *, seed: int = 0) -> list[Delta]:
    """Seeded int8, packed fp32 and dense int8 deltas, a few of them outsized (clipped or rejected)."""
    params = get_params(build_model(MODEL, seed=3))
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        g = {k: torch.from_numpy(rng.standard_normal(t.shape).astype(np.float32) * 1e-2) for k, t in params.items()}
        if i % 11 == 7:
            g = {k: t * 6 for k, t in g.items()}  # clipped
        if i % 13 == 9:
            g = {k: t * 40 for k, t in g.items()}  # rejected
        if i % 17 == 5:
            g = {k: -t for k, t in g.items()}
        kind = i % 3
        if kind == 0:
            cfg = CompressionConfig(index="random", fraction=0.2, values="int8", error_feedback=False)
            out.append(quantised(compress(g, cfg, base_version=0, round_seed=1000 + i)))
        elif kind == 1:
            entries = []
            for k, t in g.items():
                v = t.reshape(-1).numpy()
                idx = np.sort(rng.choice(v.size, max(1, v.size // 4), replace=False)).astype(np.int64)
                entries.append(Entry(k, v.size, IndexKind.PACKED, ValueKind.FP32, v[idx], idx))
            out.append(Delta(0, tuple(entries)))
        else:
            cfg = CompressionConfig(index="dense", values="int8", error_feedback=False)
            out.append(quantised(compress(g, cfg, base_version=0, round_seed=1000 + i)))
    return out


def runtime(tmp_path, cfg: RunConfig, name: str = "a") -> RunRuntime:
    return RunRuntime.fresh(run_id=1, config=cfg, storage=Storage.local(tmp_path / name))


def store(rt: RunRuntime, ds: list[Delta], bases: list[int]) -> list[tuple[int, int]]:
    items = []
    for seq, (d, base) in enumerate(zip(ds, bases), start=rt.version + 1):
        rt.storage.write(rt.storage.delta(rt.run_id, seq), codec.encode(d))
        items.append((seq, base))
    return items


def plain_reference(cfg: RunConfig, ds: list[Delta], bases: list[int], schema) -> tuple[OuterState, list]:
    """The rule as RunRuntime.merge applied it before the flat form: decode, screen, apply_delta."""
    state = OuterState.fresh(get_params(build_model(cfg.model, seed=cfg.seed)))
    n = sum(t.numel() for t in state.params.values())
    bound = robust.adam_bound(steps=cfg.inner.steps, lr=cfg.inner.lr, n_params=n)
    elements = robust.element_bound(steps=cfg.inner.steps, lr=cfg.inner.lr)
    history: list[float] = []
    out = []
    for version, (d, base) in enumerate(zip(ds, bases)):
        staleness = version - base
        w = staleness_weight(max(0, staleness), cfg.outer)
        if staleness > cfg.outer.max_staleness:
            out.append((False, None, None))
            continue
        delta = codec.decode(codec.encode(d), schema=schema)
        v = robust.screen(delta, history=history, reference=state.momentum, cfg=cfg.robust, bound=bound,
                          elements=elements)
        if v.merged:
            apply_delta(state, delta, weight=w * v.scale, cfg=cfg.outer)
        robust.remember(history, v, cfg.robust)
        out.append((v.merged, v.action, v.norm))
    return state, out


def assert_states_close(a: OuterState, b: OuterState, tol: float = 1e-5) -> None:
    assert (a.in_group, a.groups) == (b.in_group, b.groups)
    for part in ("params", "momentum", "accum"):
        for n, t in getattr(a, part).items():
            torch.testing.assert_close(t, getattr(b, part)[n], atol=tol, rtol=tol)


@pytest.mark.parametrize("outer", [{}, {"momentum": 0.9, "lr": 0.7, "group": 3},
                                   {"momentum": 0.9, "lr": 0.7, "group": 3, "warmup": 8}, {"momentum": 0.0, "group": 2},
                                   {"nesterov": False, "momentum": 0.5}])
def test_merge_equals_the_plain_rule(tmp_path, outer, lazy):
    cfg = config(**outer, max_staleness=6)
    ds = deltas(40)
    bases = [max(0, v - (v * 7) % 9) for v in range(40)]  # stale and very stale deltas too
    rt = runtime(tmp_path, cfg)
    items = store(rt, ds, bases)
    outs = [rt.merge(seq=s, base_version=b, write_snapshot=False) for s, b in items]
    ref_state, ref_out = plain_reference(cfg, ds, bases, rt.schema)
    actions = [("reject" if not o.merged else "clip" if o.clipped else "accept") if o.norm is not None else None
               for o in outs]
    assert actions == [a for _, a, _ in ref_out]
    assert {"accept", "clip", "reject", None} <= set(actions)
    for o, (_, _, norm) in zip(outs, ref_out):
        assert (o.norm is None) == (norm is None) and (norm is None or o.norm == pytest.approx(norm, rel=1e-9))
    assert_states_close(rt.state, ref_state, tol=1e-5 if lazy else 0)


def test_merge_batch_equals_merge_one_by_one(tmp_path):
    cfg = config(momentum=0.9, group=4)
    ds = deltas(30, seed=1)
    bases = [max(0, v - v % 5) for v in range(30)]
    one, batch = runtime(tmp_path, cfg, "one"), runtime(tmp_path, cfg, "batch")
    items = store(one, ds, bases)
    store(batch, ds, bases)
    batch.storage.delete(batch.storage.delta(1, 12))  # an unreadable delta on both sides
    one.storage.delete(one.storage.delta(1, 12))
    outs = [one.merge(seq=s, base_version=b, write_snapshot=s == 30) for s, b in items]
    got = batch.merge_batch(items[:9], write_snapshot=False) + batch.merge_batch(items[9:], prefetch=True)
    got = [dataclasses.replace(o, reason=o.reason and o.reason.replace("/batch/", "/one/")) for o in got]
    assert got == outs  # every decision, norm, cosine, and the last snapshot's hash
    assert "unreadable" in got[11].reason and got[-1].snapshot_sha256 and not got[-2].snapshot_sha256
    assert torch.equal(one.outer.t, batch.outer.t) and torch.equal(one.outer.m, batch.outer.m)
    assert batch.version == 30 and batch.merge_batch([]) == []
    with pytest.raises(RuntimeError, match="merge order"):
        batch.merge_batch([(31, 30), (33, 30)])


def test_checkpoint_mid_group_restarts_bit_for_bit(tmp_path):
    cfg = config(momentum=0.9, group=4)
    ds = deltas(30, seed=2)
    rt = runtime(tmp_path, cfg)
    items = store(rt, ds, [max(0, v - 2) for v in range(30)])
    stop = 12
    for s, b in items[:stop]:
        rt.merge(seq=s, base_version=b, write_snapshot=False)
    while rt.outer.in_group == 0:  # stop mid-group
        rt.merge(seq=items[stop][0], base_version=items[stop][1], write_snapshot=False)
        stop += 1
    assert (rt.outer.carry > 0) == rt.outer.lazy  # in the scaled form when lazy
    checkpoints.write(rt)
    back = checkpoints.load_newest(run_id=1, config=cfg, storage=rt.storage)
    assert back.version == stop and back.norm_history == rt.norm_history
    a = [rt.merge(seq=s, base_version=b, write_snapshot=False) for s, b in items[stop:]]
    b = [back.merge(seq=s, base_version=b, write_snapshot=False) for s, b in items[stop:]]
    assert a == b
    assert torch.equal(rt.outer.t, back.outer.t) and torch.equal(rt.outer.m, back.outer.m)
    assert rt.write_snapshot() == back.write_snapshot()


def test_a_checkpoint_in_the_old_format_still_loads(tmp_path):
    """Checkpoints written before the flat form (params/momentum/accum per tensor) load and continue
    as the plain rule would."""
    cfg = config(momentum=0.9, group=3)
    ds = deltas(12, seed=3)
    bases = list(range(12))
    ref_state, _ = plain_reference(cfg, ds[:7], bases[:7], param_schema(build_model(MODEL, seed=3)))
    assert ref_state.in_group == 1
    storage = Storage.local(tmp_path / "old")
    tensors = {k: v.contiguous() for k, v in ref_state.tensors().items()}
    meta = {"version": "7", "in_group": str(ref_state.in_group), "norm_history": json.dumps([0.1, 0.2]),
            "last_exchange_id": "5", "config": cfg.model_dump_json()}
    raw = safetensors.torch.save(tensors, metadata=meta)
    storage.write(storage.checkpoint(1, 7), hashlib.sha256(raw).hexdigest().encode() + b"\n" + raw)
    rt = checkpoints.load_newest(run_id=1, config=cfg, storage=storage)
    assert (rt.version, rt.norm_history, rt.last_exchange_id) == (7, [0.1, 0.2], 5)
    assert ref_state.groups == rt.outer.groups == 7 // 3  # no counter in it: version // group (all 7 merged)
    assert_states_close(rt.state, ref_state, tol=0)
    checkpoints.write(rt)  # and it writes the new form, which loads again
    again = checkpoints.load_newest(run_id=1, config=cfg, storage=storage)
    assert_states_close(again.state, ref_state, tol=0)


def test_checkpoint_mid_warmup_restarts_at_its_place_in_the_ramp(tmp_path):
    """The momentum steps done (the outer warm-up's place) survive a checkpoint: the restarted run
    continues the ramp bit for bit; one whose checkpoint lacks the counter counts version // group."""
    cfg = config(momentum=0.9, lr=0.7, group=3, warmup=8)
    ds = deltas(36, seed=5)
    rt = runtime(tmp_path, cfg)
    items = store(rt, ds, [max(0, v - 2) for v in range(36)])
    stop = 12
    for s, b in items[:stop]:
        rt.merge(seq=s, base_version=b, write_snapshot=False)
    while rt.outer.in_group == 0:  # stop mid-group (some deltas are rejected), mid-ramp
        rt.merge(seq=items[stop][0], base_version=items[stop][1], write_snapshot=False)
        stop += 1
    assert 0 < rt.outer.groups < cfg.outer.warmup and rt.outer.in_group > 0, (rt.outer.groups, rt.outer.in_group)
    name = checkpoints.write(rt)
    back = checkpoints.load_newest(run_id=1, config=cfg, storage=rt.storage)
    assert (back.outer.groups, back.outer.in_group) == (rt.outer.groups, rt.outer.in_group)
    a = [rt.merge(seq=s, base_version=b, write_snapshot=False) for s, b in items[stop:]]
    b = [back.merge(seq=s, base_version=b, write_snapshot=False) for s, b in items[stop:]]
    assert a == b
    assert torch.equal(rt.outer.t, back.outer.t) and torch.equal(rt.outer.m, back.outer.m)
    assert back.outer.groups > cfg.outer.warmup  # past the ramp
    # the same checkpoint without its counter (as written before it existed): version // group
    blob = rt.storage.read(name)
    raw = blob.partition(b"\n")[2]
    meta = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    del meta["groups"]
    old = safetensors.torch.save(dict(safetensors.torch.load(raw)), metadata=meta)
    storage = Storage.local(tmp_path / "old")
    storage.write(storage.checkpoint(1, stop), hashlib.sha256(old).hexdigest().encode() + b"\n" + old)
    assert checkpoints.load_newest(run_id=1, config=cfg, storage=storage).outer.groups == stop // 3


def test_exchange_on_the_scaled_form_and_its_exact_undo(tmp_path, lazy):
    cfg = config(momentum=0.9, group=2)
    rt = runtime(tmp_path, cfg)
    items = store(rt, deltas(9, seed=4), list(range(9)))
    for s, b in items:
        rt.merge(seq=s, base_version=b, write_snapshot=False)
    assert (rt.outer.carry > 0) == lazy
    centre = rt.state.params
    worker = {n: t + 0.1 for n, t in centre.items()}
    sent = sparta.select(worker, p=0.3, seed=7, values="fp32", base_version=rt.version)
    expected = {n: t.clone() for n, t in centre.items()}
    want = sparta.mix_into_centre(expected, sent, alpha=cfg.sparta.alpha, values=cfg.sparta.values)
    before = rt.centre_at(sent)  # (settles the weights' deferred share of the group in T first)
    t_before = rt.outer.t.clone()
    assert all(torch.equal(t, centre[n]) for n, t in rt.state.params.items())  # which changes nothing
    got, _ = rt.exchange(sent, step=cfg.inner.steps)  # a whole round: within its reach (exchange_screen.py)
    for e, f in zip(got.entries, want.entries):
        assert (e.name, e.value_kind, e.seed) == (f.name, f.value_kind, f.seed)
        np.testing.assert_allclose(e.values, f.values, atol=1e-6)
    for n, t in rt.state.params.items():
        torch.testing.assert_close(t, expected[n], atol=1e-6, rtol=1e-6)
    rt.undo_exchange(sent, before)
    assert torch.equal(rt.outer.t, t_before)
    assert all(torch.equal(t, centre[n]) for n, t in rt.state.params.items())


def test_the_reference_round_is_the_consensus_until_the_momentum_has_one(tmp_path):
    """Before the first momentum step the outer momentum has no direction; the coordinator's own reference
    round stands in: a first delta along it merges, one at the same norm in a random direction does not.
    The reference direction survives a checkpoint while it is needed and is dropped once the momentum
    speaks (a delta's support meets a non-zero momentum)."""
    cfg = RunConfig(name="rt", model=MODEL, seed=3, outer=OuterConfig(group=2), robust=RobustConfig())
    rt = runtime(tmp_path, cfg)
    tokens = torch.randint(0, MODEL.vocab_size, (4096,), generator=torch.Generator().manual_seed(0))
    rt.calibrate(tokens)
    ref = rt.reference_delta
    assert ref is not None and ref.shape == rt.outer.m.shape and rt.reference_norm > 0

    def dense(flat: torch.Tensor) -> Delta:
        return Delta(0, tuple(Entry(n, int(np.prod(s)), IndexKind.DENSE, ValueKind.FP32,
                                    flat[off:off + int(np.prod(s))].numpy().astype(np.float32), None)
                              for n, s in rt.schema.items() for off in [rt.outer.offsets[n]]))

    rng = np.random.default_rng(0)
    scale = 0.9 * rt.reference_norm / float(ref.norm())  # an honest round's size
    random_dir = torch.from_numpy(rng.choice([-1.0, 1.0], ref.numel()).astype(np.float32))
    random_dir *= 0.9 * rt.reference_norm / float(random_dir.norm())
    items = store(rt, [dense(random_dir), dense(ref * scale), dense(ref * scale * 0.8)], [0, 0, 0])
    before = rt.outer.t.clone()
    attack = rt.merge(seq=items[0][0], base_version=0, write_snapshot=False, worker=1)
    assert not attack.merged and "consensus" in attack.reason and attack.cosine == pytest.approx(0.0, abs=0.05)
    assert torch.equal(rt.outer.t, before) and rt.outer.in_group == 0  # it changed nothing
    assert torch.equal(rt.outer.m, torch.zeros_like(rt.outer.m))
    checkpoints.write(rt)
    back = checkpoints.load_newest(run_id=1, config=cfg, storage=rt.storage)
    assert torch.equal(back.reference_delta, ref)  # kept while no momentum exists
    for r in (rt, back):
        honest = r.merge(seq=items[1][0], base_version=0, write_snapshot=False, worker=2)
        assert honest.merged and honest.cosine == pytest.approx(1.0, abs=1e-5)
        r.merge(seq=items[2][0], base_version=0, write_snapshot=False, worker=3)  # the group's end: a momentum
        assert r.reference_delta is not None  # no delta has met the momentum yet
    items = store(rt, [dense(ref * scale * 0.7)], [0])
    store(back, [dense(ref * scale * 0.7)], [0])
    for r in (rt, back):
        r.merge(seq=items[0][0], base_version=0, write_snapshot=False, worker=2)
        assert r.reference_delta is None
    assert torch.equal(rt.outer.t, back.outer.t)


@pytest.mark.parametrize("compression, sparse", [
    (CompressionConfig(index="topk", fraction=0.1, values="int8"), True),  # error feedback: rounds carried
    (CompressionConfig(index="topk", fraction=0.1, values="int8", error_feedback=False), False),
    (CompressionConfig(index="dense", values="int8"), False),
])
def test_the_reference_bound_scales_by_the_rounds_a_sparse_run_carries(tmp_path, compression, sparse):
    """A delta at 1.64x the reference round (the most honest top-k 10% deltas measured: robust.reference_scale)
    merges in a top-k run with error feedback and is refused in a dense one; 10x it is refused in both."""
    cfg = RunConfig(name="rt", model=MODEL, seed=3, outer=OuterConfig(group=2), compression=compression,
                    robust=RobustConfig(min_agreement=-1.0))
    rt = runtime(tmp_path, cfg)
    assert rt.reference_scale == (robust.reference_scale(fraction=0.1) if sparse else 1.0)
    rt.reference_norm = 0.5 * rt.adam_bound  # an honest-sized reference; below the per-element bounds
    n = rt.outer.m.numel()

    def uniform(share: float) -> Delta:  # share x the reference's norm, spread over every element
        value = share * rt.reference_norm / n ** 0.5
        return Delta(0, tuple(Entry(name, int(np.prod(s)), IndexKind.DENSE, ValueKind.FP32,
                                    np.full(int(np.prod(s)), value, dtype=np.float32)) for name, s in rt.schema.items()))

    items = store(rt, [uniform(1.64), uniform(16.4)], [0, 1])
    honest = rt.merge(seq=items[0][0], base_version=0, write_snapshot=False, worker=1)
    assert honest.merged == sparse
    if not sparse:
        assert honest.rejection == robust.Rejection.BOUND and "reference round" in honest.reason
    scaled = rt.merge(seq=items[1][0], base_version=1, write_snapshot=False, worker=1)
    assert not scaled.merged and scaled.rejection == robust.Rejection.BOUND  # dense: its values already
    assert not sparse or "reference round" in scaled.reason
