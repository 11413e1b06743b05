"""The merge rule (shared/algorithms/outer.py, and its flat form flat_outer.py), checked against torch's own SGD."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from shared import codec
from shared.algorithms.flat_outer import FlatOuter
from shared.algorithms.outer import OuterState, apply_delta, group_lr, lookahead_gain, published, staleness_weight
from shared.codec import Delta, Entry, IndexKind, ValueKind
from shared.config import OuterConfig

SHAPES = {"emb": (6, 4), "w": (5,), "b": (3, 2, 2)}


def params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def dense_delta(grads: dict[str, torch.Tensor], base_version: int = 0) -> Delta:
    return Delta(base_version, tuple(
        Entry(n, t.numel(), IndexKind.DENSE, ValueKind.FP32, t.reshape(-1).numpy().astype(np.float32))
        for n, t in grads.items()))


def sparse_delta(grads: dict[str, torch.Tensor], keep: float, seed: int) -> tuple[Delta, Delta]:
    """(PACKED delta of a random subset, the DENSE delta of the same values with zeros elsewhere)."""
    rng = np.random.default_rng(seed)
    sparse, dense = [], []
    for n, t in grads.items():
        flat = t.reshape(-1).numpy().astype(np.float32)
        k = max(1, int(flat.size * keep))
        idx = np.sort(rng.choice(flat.size, k, replace=False)).astype(np.int64)
        sparse.append(Entry(n, flat.size, IndexKind.PACKED, ValueKind.FP32, flat[idx], idx))
        full = np.zeros_like(flat)
        full[idx] = flat[idx]
        dense.append(Entry(n, flat.size, IndexKind.DENSE, ValueKind.FP32, full))
    return Delta(0, tuple(sparse)), Delta(0, tuple(dense))


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("group", [1, 3])
def test_one_group_of_deltas_is_one_synchronous_outer_step(nesterov, group):
    """G deltas from the same base, weight 1 == torch SGD on their average, group after group."""
    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=nesterov, group=group)
    p0 = params(0)
    state = OuterState.fresh(p0)
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in p0.items()}
    opt = torch.optim.SGD(list(ref.values()), lr=cfg.lr, momentum=cfg.momentum, nesterov=nesterov)
    for rnd in range(3):  # momentum must carry across groups
        grads = [params(100 * rnd + i + 1) for i in range(group)]
        for i, g in enumerate(grads):
            apply_delta(state, dense_delta(g), weight=1.0, cfg=cfg)
            assert state.in_group == (i + 1) % group
        for n, p in ref.items():
            p.grad = torch.stack([g[n] for g in grads]).mean(0)
        opt.step()
        for n in SHAPES:
            torch.testing.assert_close(state.params[n], ref[n].detach(), atol=1e-5, rtol=1e-5)
            assert not state.accum[n].any()


def test_mid_group_each_delta_applies_its_share_at_once():
    cfg = OuterConfig(lr=0.5, momentum=0.9, group=4)
    p0 = params(0)
    state = OuterState.fresh(p0)
    g = params(1)
    apply_delta(state, dense_delta(g), weight=0.5, cfg=cfg)
    for n in SHAPES:
        torch.testing.assert_close(state.params[n], p0[n] - 0.5 / 4 * 0.5 * g[n])
        torch.testing.assert_close(state.accum[n], 0.5 * g[n])
        assert not state.momentum[n].any()  # no momentum step until the group is full
    assert state.in_group == 1


def test_weight_scales_the_delta():
    cfg = OuterConfig(group=2)
    g = params(1)
    a, b = OuterState.fresh(params(0)), OuterState.fresh(params(0))
    for _ in range(3):
        apply_delta(a, dense_delta(g), weight=0.25, cfg=cfg)
        apply_delta(b, dense_delta({n: 0.25 * t for n, t in g.items()}), weight=1.0, cfg=cfg)
    for n in SHAPES:
        torch.testing.assert_close(a.params[n], b.params[n])
        torch.testing.assert_close(a.momentum[n], b.momentum[n])


@pytest.mark.parametrize("nesterov", [True, False])
def test_sparse_deltas_equal_their_dense_equivalent(nesterov):
    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=nesterov, group=2)
    s_state, d_state = OuterState.fresh(params(0)), OuterState.fresh(params(0))
    for i in range(5):
        sparse, dense = sparse_delta(params(10 + i), keep=0.3, seed=i)
        w = staleness_weight(i, cfg)
        apply_delta(s_state, sparse, weight=w, cfg=cfg)
        apply_delta(d_state, dense, weight=w, cfg=cfg)
    assert s_state.in_group == d_state.in_group == 1
    for n in SHAPES:
        torch.testing.assert_close(s_state.params[n], d_state.params[n], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(s_state.momentum[n], d_state.momentum[n], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(s_state.accum[n], d_state.accum[n], atol=1e-6, rtol=1e-6)


def test_partial_delta_touches_only_its_tensors_but_counts_for_the_group():
    cfg = OuterConfig(group=2)
    p0 = params(0)
    state = OuterState.fresh(p0)
    apply_delta(state, dense_delta({"w": torch.ones(5)}), weight=1.0, cfg=cfg)
    assert state.in_group == 1
    assert torch.equal(state.params["emb"], p0["emb"]) and not torch.equal(state.params["w"], p0["w"])


def test_fresh_copies_its_input():
    p0 = params(0)
    state = OuterState.fresh(p0)
    p0["w"].add_(100.0)
    assert state.params["w"].abs().max() < 50
    apply_delta(state, dense_delta(params(1)), weight=1.0, cfg=OuterConfig(group=1))
    assert p0["w"].min() > 50  # and the merge never writes into the caller's tensors


def test_staleness_weight():
    cfg = OuterConfig(group=4, staleness_exponent=0.5)
    for s in range(4):
        assert staleness_weight(s, cfg) == 1.0  # within one round of the group
    assert staleness_weight(7, cfg) == pytest.approx(2 ** -0.5)  # one full round behind
    assert staleness_weight(4, cfg) == pytest.approx(1.25 ** -0.5)
    assert staleness_weight(3 + 4 * 8, cfg) == pytest.approx(1 / 3)  # 8 rounds: (1 + 8)^-0.5
    ws = [staleness_weight(s, cfg) for s in range(3, 200)]
    assert all(a > b for a, b in zip(ws, ws[1:]))
    assert 0 < ws[-1] < 1
    assert staleness_weight(50, OuterConfig(group=4, staleness_exponent=0.0)) == 1.0
    assert staleness_weight(1, OuterConfig(group=1, staleness_exponent=1.0)) == 0.5
    assert staleness_weight(0, OuterConfig(group=1)) == 1.0
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_weight(-1, cfg)


def test_outer_state_tensors_round_trip():
    cfg = OuterConfig(group=3)
    state = OuterState.fresh(params(0))
    for i in range(4):  # one momentum step, then one delta into the next group
        apply_delta(state, dense_delta(params(i + 1)), weight=1.0, cfg=cfg)
    assert state.in_group == 1
    flat = state.tensors()
    assert set(flat) == {f"{kind}/{n}" for kind in ("params", "momentum", "accum") for n in SHAPES}
    assert all(t.dtype == torch.float32 for t in flat.values())
    # through a real checkpoint format, so nothing depends on aliasing
    import safetensors.torch
    loaded = safetensors.torch.load(safetensors.torch.save({k: v.contiguous() for k, v in flat.items()}))
    back = OuterState.from_tensors(loaded, in_group=state.in_group, groups=state.groups)
    assert (back.in_group, back.groups) == (1, 1)
    for part in ("params", "momentum", "accum"):
        a, b = getattr(state, part), getattr(back, part)
        assert set(a) == set(b) == set(SHAPES)
        for n in SHAPES:
            assert torch.equal(a[n], b[n])
    assert any(state.momentum[n].any() for n in SHAPES) and any(state.accum[n].any() for n in SHAPES)
    # and the restored state continues exactly like the original
    for i in range(4):
        d = dense_delta(params(50 + i))
        apply_delta(state, d, weight=0.8, cfg=cfg)
        apply_delta(back, d, weight=0.8, cfg=cfg)
    for n in SHAPES:
        assert torch.equal(state.params[n], back.params[n])


def test_outer_step_moves_against_the_pseudo_gradient():
    """Sanity of signs: a pseudo-gradient of base - local pulls the model toward local."""
    cfg = OuterConfig(lr=1.0, momentum=0.0, group=1)
    base, local = params(0), params(1)
    state = OuterState.fresh(base)
    apply_delta(state, dense_delta({n: base[n] - local[n] for n in SHAPES}), weight=1.0, cfg=cfg)
    for n in SHAPES:
        torch.testing.assert_close(state.params[n], local[n])


# -- FlatOuter: the coordinator's lazy form of the same rule -------------------------------------

def flat(delta: Delta):
    """The FlatDelta the coordinator decodes from `delta` (through the real wire format)."""
    return codec.decode_flat(codec.encode(delta), schema=SHAPES)


def random_delta(rng: np.random.Generator, i: int) -> Delta:
    """Sparse (packed, seeded), dense or partial deltas, to cover every pending kind."""
    g = params(1000 + i)
    kind = i % 4
    entries = []
    for n, t in g.items():
        v = t.reshape(-1).numpy().astype(np.float32)
        if kind == 3 and n == "w":
            continue  # a partial delta
        if kind == 0 or (kind == 3 and n == "b"):
            entries.append(Entry(n, v.size, IndexKind.DENSE, ValueKind.FP32, v))
        elif kind == 1:
            idx = np.sort(rng.choice(v.size, max(1, v.size // 3), replace=False)).astype(np.int64)
            entries.append(Entry(n, v.size, IndexKind.PACKED, ValueKind.FP32, v[idx], idx))
        else:
            seed = int(rng.integers(0, 2**63))
            idx = codec.seeded_indices(seed, v.size, max(1, v.size // 5))
            entries.append(Entry(n, v.size, IndexKind.SEEDED, ValueKind.FP32, v[idx], idx, seed))
    return Delta(0, tuple(entries))


def assert_same_state(flat_state: FlatOuter, ref: OuterState, tol: float = 2e-5) -> None:
    """Close within tol, absolute errors measured against the momentum's size (the lazy form's
    rounding is a few ulps of FOLD_GAIN * |m|)."""
    got = flat_state.to_state()
    assert (got.in_group, got.groups) == (ref.in_group, ref.groups)
    size = max([1.0] + [float(t.abs().max()) for t in ref.momentum.values()])
    for part in ("params", "momentum", "accum"):
        for n in SHAPES:
            torch.testing.assert_close(getattr(got, part)[n], getattr(ref, part)[n], atol=tol * size, rtol=tol,
                                       msg=lambda m, part=part, n=n: f"{part}/{n}: {m}")


@pytest.mark.parametrize("momentum", [0.0, 0.2, 0.9, 0.99])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_flat_outer_equals_apply_delta(momentum, nesterov, group):
    """Many groups, every delta kind, weights and clipping scales: the lazy form tracks the plain rule
    (weights, momentum, accumulator, count) after every delta, through its folds."""
    cfg = OuterConfig(lr=0.8, momentum=momentum, nesterov=nesterov, group=group)
    ref = OuterState.fresh(params(0))
    lazy = FlatOuter.from_state(ref, lazy=True)
    rng = np.random.default_rng(group)
    scales, carries = [lazy.scale], [lazy.carry]
    for i in range(60):
        d = random_delta(rng, i)
        w = staleness_weight(i % 9, cfg) * (0.5 if i % 7 == 0 else 1.0)
        apply_delta(ref, d, weight=w, cfg=cfg)
        lazy.apply(flat(d), weight=w, cfg=cfg)
        scales.append(lazy.scale)
        carries.append(lazy.carry)
        assert_same_state(lazy, ref)
    if momentum > 0:
        assert min(scales) < 1  # it went lazy
    if momentum == 0.2 or (momentum == 0.9 and group == 1):  # enough groups to fold C into the weights (C fell)
        assert any(b < a for a, b in zip(carries, carries[1:]))
    if momentum == 0.2 and group == 1:  # 60 steps of 0.2: past MIN_SCALE, M was rescaled (s rose)
        assert any(b > a for a, b in zip(scales, scales[1:]))


def test_flat_outer_matches_torch_sgd():
    """G deltas from one base == torch's Nesterov SGD on their average, through the lazy form."""
    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=True, group=3)
    p0 = params(0)
    lazy = FlatOuter.from_state(OuterState.fresh(p0), lazy=True)
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in p0.items()}
    opt = torch.optim.SGD(list(ref.values()), lr=cfg.lr, momentum=cfg.momentum, nesterov=True)
    for rnd in range(30):  # past several folds
        grads = [params(100 * rnd + i + 1) for i in range(3)]
        for g in grads:
            lazy.apply(flat(dense_delta(g)), weight=1.0, cfg=cfg)
        for n, p in ref.items():
            p.grad = torch.stack([g[n] for g in grads]).mean(0)
        opt.step()
        got = lazy.params()
        for n in SHAPES:
            torch.testing.assert_close(got[n], ref[n].detach(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("warmup", [0, 6])
@pytest.mark.parametrize("stop", [0, 5, 6, 13])
def test_flat_outer_checkpoint_continues_bit_for_bit(stop, warmup):
    import safetensors.torch
    cfg = OuterConfig(lr=0.8, momentum=0.5, group=4, warmup=warmup)
    lazy = FlatOuter.from_state(OuterState.fresh(params(0)), lazy=True)
    rng = np.random.default_rng(0)
    deltas = [flat(random_delta(rng, i)) for i in range(30)]
    for d in deltas[:stop]:
        lazy.apply(d, weight=0.9, cfg=cfg)
    tensors, meta = lazy.checkpoint()
    raw = safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    back = FlatOuter.from_checkpoint(safetensors.torch.load(raw), header, in_group=lazy.in_group,
                                     groups=lazy.groups, lazy=True)
    assert (back.scale, back.carry, back.in_group, back.groups, len(back.pending), back.applied) == \
        (lazy.scale, lazy.carry, lazy.in_group, lazy.groups, len(lazy.pending), lazy.applied)
    assert set(back.dense_acc) == set(lazy.dense_acc)
    assert all(torch.equal(back.dense_acc[key], run) for key, run in lazy.dense_acc.items())
    for d in deltas[stop:]:
        lazy.apply(d, weight=0.9, cfg=cfg)
        back.apply(d, weight=0.9, cfg=cfg)
    assert torch.equal(lazy.t, back.t) and torch.equal(lazy.m, back.m)
    assert (lazy.scale, lazy.carry, lazy.groups) == (back.scale, back.carry, back.groups)
    assert back.groups == 30 // 4  # one per momentum step


def test_flat_outer_from_a_mid_group_plain_state():
    """A plain OuterState in the middle of a group (an old checkpoint) continues as the plain rule does."""
    cfg = OuterConfig(lr=0.8, momentum=0.9, group=4)
    ref = OuterState.fresh(params(0))
    rng = np.random.default_rng(1)
    deltas = [random_delta(rng, i) for i in range(20)]
    for d in deltas[:6]:
        apply_delta(ref, d, weight=1.0, cfg=cfg)
    assert ref.in_group == 2
    lazy = FlatOuter.from_state(ref, lazy=True)
    assert_same_state(lazy, ref, tol=0)
    for d in deltas[6:]:
        apply_delta(ref, d, weight=1.0, cfg=cfg)
        lazy.apply(flat(d), weight=1.0, cfg=cfg)
        assert_same_state(lazy, ref)


def test_flat_outer_sparse_reads_and_views():
    cfg = OuterConfig(lr=0.8, momentum=0.9, group=2)
    lazy = FlatOuter.from_state(OuterState.fresh(params(0)), lazy=True)
    rng = np.random.default_rng(2)
    for i in range(9):
        lazy.apply(flat(random_delta(rng, i)), weight=1.0, cfg=cfg)
    assert lazy.carry > 0 and lazy.scale < 1  # in the scaled form
    theta = torch.cat([lazy.params()[n].reshape(-1) for n in SHAPES])
    idx = torch.tensor([0, 3, 24, 25, 30, 39])
    torch.testing.assert_close(lazy.weights_at(idx), theta[idx], atol=1e-6, rtol=1e-6)
    assert [tuple(t.shape) for t in lazy.params().values()] == list(SHAPES.values())
    p0 = {n: t.clone() for n, t in lazy.params().items()}
    lazy.fold()
    assert (lazy.scale, lazy.carry) == (1.0, 0.0)
    for n in SHAPES:
        torch.testing.assert_close(lazy.params()[n], p0[n], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("nesterov", [True, False])
def test_flat_outer_not_lazy_is_apply_delta_bit_for_bit(momentum, nesterov):
    """lazy=False (small models): the plain rule's own arithmetic, so the weights are equal, not close."""
    cfg = OuterConfig(lr=0.8, momentum=momentum, nesterov=nesterov, group=3)
    ref = OuterState.fresh(params(0))
    plain = FlatOuter.from_state(ref, lazy=False)
    assert not plain.lazy and not FlatOuter.from_state(ref).lazy  # the default for a model this small
    rng = np.random.default_rng(5)
    for i in range(40):
        d = random_delta(rng, i)
        w = 0.5 if i % 5 == 0 else 1.0
        apply_delta(ref, d, weight=w, cfg=cfg)
        plain.apply(flat(d), weight=w, cfg=cfg)
        assert (plain.scale, plain.carry) == (1.0, 0.0)
        assert_same_state(plain, ref, tol=0)


def test_flat_outer_flush_mid_group_changes_nothing_but_where_the_share_sits():
    """An exchange flushes the deferred share into T mid-group; the state it describes is the same."""
    cfg = OuterConfig(lr=0.8, momentum=0.9, group=4)
    ref = OuterState.fresh(params(0))
    lazy = FlatOuter.from_state(ref, lazy=True)
    rng = np.random.default_rng(7)
    for i in range(23):
        d = random_delta(rng, i)
        apply_delta(ref, d, weight=1.0, cfg=cfg)
        lazy.apply(flat(d), weight=1.0, cfg=cfg)
        if i % 3 == 1:
            before = lazy.params()
            before = {n: t.clone() for n, t in before.items()}
            lazy.flush()
            assert lazy.applied == len(lazy.pending)
            for n, t in lazy.params().items():
                torch.testing.assert_close(t, before[n], atol=1e-6, rtol=1e-6)
        assert_same_state(lazy, ref)


def test_flat_outer_dense_deltas_share_one_buffer_per_run():
    """Lazy form, dense deltas (the default diloco compression): the group's dense runs are summed
    in place, not kept one copy per delta, and the rule is unchanged."""
    cfg = OuterConfig(lr=0.8, momentum=0.9, group=4)
    ref = OuterState.fresh(params(0))
    lazy = FlatOuter.from_state(ref, lazy=True)
    for i in range(11):
        d = dense_delta(params(300 + i))
        apply_delta(ref, d, weight=0.7, cfg=cfg)
        lazy.apply(flat(d), weight=0.7, cfg=cfg)
        assert not lazy.pending and len(lazy.dense_acc) == (len(SHAPES) if lazy.in_group else 0)
        assert_same_state(lazy, ref)
    plain_mid_group = OuterState.fresh(params(0))
    for i in range(2):
        apply_delta(plain_mid_group, dense_delta(params(400 + i)), weight=1.0, cfg=cfg)
    converted = FlatOuter.from_state(plain_mid_group, lazy=True)  # an old checkpoint's dense accumulator
    assert list(converted.dense_acc) == [(0, converted.n)] and not converted.pending
    assert_same_state(converted, plain_mid_group, tol=0)


# -- what the coordinator publishes mid-group (the look-ahead) ------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3])
def test_published_mid_group_is_the_mean_of_the_group_so_far(k):
    """k of G deltas from one base, plain averaging: published = base - mean of those k, which is
    what a synchronous DiLoCo group of those k workers would give; theta holds only k/G of it."""
    cfg = OuterConfig(lr=1.0, momentum=0.0, group=4)
    p0 = params(0)
    state = OuterState.fresh(p0)
    grads = [params(i + 1) for i in range(k)]
    for g in grads:
        apply_delta(state, dense_delta(g), weight=1.0, cfg=cfg)
    pub = published(state, cfg)
    for n in SHAPES:
        mean = torch.stack([g[n] for g in grads]).mean(0)
        torch.testing.assert_close(pub[n], p0[n] - mean)
        torch.testing.assert_close(state.params[n], p0[n] - mean * k / cfg.group)  # the rule itself unchanged


def test_published_is_theta_at_a_group_boundary_and_without_lookahead():
    cfg = OuterConfig(lr=0.8, momentum=0.5, group=2)
    state = OuterState.fresh(params(0))
    for i in range(2):
        apply_delta(state, dense_delta(params(i + 1)), weight=1.0, cfg=cfg)
    assert state.in_group == 0
    assert all(torch.equal(published(state, cfg)[n], state.params[n]) for n in SHAPES)
    apply_delta(state, dense_delta(params(9)), weight=1.0, cfg=cfg)
    assert state.in_group == 1
    assert any(not torch.equal(published(state, cfg)[n], state.params[n]) for n in SHAPES)
    off = cfg.model_copy(update={"lookahead": False})
    assert all(torch.equal(published(state, off)[n], state.params[n]) for n in SHAPES)
    pub = published(state, cfg)
    pub["w"].add_(1.0)  # a copy: the state is untouched
    assert not torch.equal(pub["w"], state.params["w"])


def test_lookahead_gain():
    cfg = OuterConfig(lr=0.8, group=4)
    assert lookahead_gain(0, cfg, groups=0) == 0.0 and lookahead_gain(4, cfg, groups=0) == 0.0
    assert lookahead_gain(1, cfg, groups=0) == pytest.approx(0.8 * 0.75)
    assert lookahead_gain(3, cfg, groups=9) == pytest.approx(0.8 * (1 / 3 - 1 / 4))
    assert lookahead_gain(1, OuterConfig(group=1), groups=0) == 0.0  # every delta closes its group


def test_stale_deltas_pull_the_published_model_by_their_weight():
    cfg = OuterConfig(lr=1.0, momentum=0.0, group=4)
    p0 = params(0)
    state = OuterState.fresh(p0)
    g1, g2 = params(1), params(2)
    apply_delta(state, dense_delta(g1), weight=1.0, cfg=cfg)
    apply_delta(state, dense_delta(g2), weight=0.5, cfg=cfg)
    pub = published(state, cfg)
    for n in SHAPES:
        torch.testing.assert_close(pub[n], p0[n] - (g1[n] + 0.5 * g2[n]) / 2)


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("momentum", [0.0, 0.2, 0.9])
def test_flat_outer_publishes_what_the_plain_rule_does(lazy, momentum):
    """published_flat == published after every delta (bit for bit in the plain form), every delta kind."""
    cfg = OuterConfig(lr=0.8, momentum=momentum, group=3)
    ref = OuterState.fresh(params(0))
    fl = FlatOuter.from_state(ref, lazy=lazy)
    rng = np.random.default_rng(7)
    for i in range(20):
        d = random_delta(rng, i)
        w = staleness_weight(i % 5, cfg)
        apply_delta(ref, d, weight=w, cfg=cfg)
        fl.apply(flat(d), weight=w, cfg=cfg)
        want, got = published(ref, cfg), fl.views(fl.published_flat(cfg))
        for n in SHAPES:
            if lazy:
                torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(got[n], want[n]), (i, n)
    before = fl.weights_flat().clone()
    fl.published_flat(cfg)
    assert torch.equal(fl.weights_flat(), before)  # reading it changes nothing


# -- the outer warm-up: the first `warmup` groups ramp the outer lr ---------------------------------


def test_group_lr_ramps_linearly_then_holds():
    cfg = OuterConfig(lr=0.7, warmup=4)
    assert [group_lr(k, cfg) for k in range(6)] == [0.7 * 1 / 4, 0.7 * 2 / 4, 0.7 * 3 / 4, 0.7, 0.7, 0.7]
    assert all(group_lr(k, OuterConfig(lr=0.7)) == 0.7 for k in (0, 1, 10**9))  # warmup 0: none
    assert group_lr(0, OuterConfig(lr=0.7, warmup=1)) == 0.7
    with pytest.raises(ValueError, match="groups"):
        group_lr(-1, cfg)
    with pytest.raises(ValidationError, match="warmup"):
        OuterConfig(warmup=-1)


def rule_with_lrs(p0: dict[str, torch.Tensor], rounds: list[list[dict[str, torch.Tensor]]], lrs: list[float],
                  cfg: OuterConfig) -> dict[str, torch.Tensor]:
    """The module docstring's arithmetic written out, one explicit lr per group (dense deltas, weight 1):
    the same float operations in the same order as apply_delta, so the two agree bit for bit."""
    theta = {n: t.clone() for n, t in p0.items()}
    m = {n: torch.zeros_like(t) for n, t in p0.items()}
    for grads, lr in zip(rounds, lrs, strict=True):
        acc = {n: torch.zeros_like(t) for n, t in p0.items()}
        for g in grads:
            for n in p0:
                theta[n].view(-1).sub_(g[n].reshape(-1), alpha=lr / cfg.group)
                acc[n].view(-1).add_(g[n].reshape(-1))
        for n in p0:
            if cfg.nesterov:
                m[n].mul_(cfg.momentum).add_(acc[n], alpha=1.0 / cfg.group)
                theta[n].sub_(m[n], alpha=lr * cfg.momentum)
            else:
                theta[n].sub_(m[n], alpha=lr * cfg.momentum)
                m[n].mul_(cfg.momentum).add_(acc[n], alpha=1.0 / cfg.group)
    return theta


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_group_k_runs_at_exactly_its_ramped_lr(warmup, nesterov):
    """warmup 0 (and 1) is the rule without a warm-up bit for bit; warmup N runs group k at exactly
    lr * (k + 1) / N until it reaches lr."""
    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=nesterov, group=2, warmup=warmup)
    p0 = params(0)
    rounds = [[params(100 * r + i + 1) for i in range(2)] for r in range(5)]
    state = OuterState.fresh(p0)
    for k, grads in enumerate(rounds):
        assert state.groups == k
        for g in grads:
            apply_delta(state, dense_delta(g), weight=1.0, cfg=cfg)
    assert (state.groups, state.in_group) == (5, 0)
    lrs = [0.7 * (k + 1) / warmup if k + 1 < warmup else 0.7 for k in range(5)]
    assert (lrs[:2] == [0.7 / 3, 0.7 * 2 / 3]) == (warmup == 3)
    want = rule_with_lrs(p0, rounds, lrs, cfg)
    for n in SHAPES:
        assert torch.equal(state.params[n], want[n]), n
    if warmup == 3:  # and a rule that ignored the warm-up would differ
        flat_lr = rule_with_lrs(p0, rounds, [0.7] * 5, cfg)
        assert not all(torch.equal(state.params[n], flat_lr[n]) for n in SHAPES)


def test_warmup_matches_torch_sgd_with_the_lr_ramped_per_step():
    """G deltas from one base per group == torch's Nesterov SGD on their average, its lr set per step."""
    cfg = OuterConfig(lr=0.7, momentum=0.9, group=3, warmup=4)
    p0 = params(0)
    state = OuterState.fresh(p0)
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in p0.items()}
    opt = torch.optim.SGD(list(ref.values()), lr=cfg.lr, momentum=cfg.momentum, nesterov=True)
    for rnd in range(6):
        grads = [params(100 * rnd + i + 1) for i in range(3)]
        for g in grads:
            apply_delta(state, dense_delta(g), weight=1.0, cfg=cfg)
        for n, p in ref.items():
            p.grad = torch.stack([g[n] for g in grads]).mean(0)
        opt.param_groups[0]["lr"] = cfg.lr * min(1.0, (rnd + 1) / 4)
        opt.step()
        for n in SHAPES:
            torch.testing.assert_close(state.params[n], ref[n].detach(), atol=1e-5, rtol=1e-5)


def test_the_lookahead_uses_the_open_groups_lr():
    """Mid-group, published = the group's start - its lr * the mean of its deltas so far."""
    cfg = OuterConfig(lr=1.0, momentum=0.0, group=4, warmup=4)
    state = OuterState.fresh(params(0))
    for i in range(4):  # group 0, at lr 1/4
        apply_delta(state, dense_delta(params(i + 1)), weight=1.0, cfg=cfg)
    start = {n: t.clone() for n, t in state.params.items()}
    g1, g2 = params(11), params(12)
    for g in (g1, g2):  # group 1, at lr 2/4
        apply_delta(state, dense_delta(g), weight=1.0, cfg=cfg)
    assert (state.groups, state.in_group) == (1, 2)
    assert lookahead_gain(2, cfg, groups=1) == 0.5 * (1 / 2 - 1 / 4)
    pub = published(state, cfg)
    for n in SHAPES:
        torch.testing.assert_close(state.params[n], start[n] - 0.5 * (g1[n] + g2[n]) / 4)
        torch.testing.assert_close(pub[n], start[n] - 0.5 * (g1[n] + g2[n]) / 2)


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("momentum", [0.2, 0.9])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("group", [1, 3])
def test_flat_outer_warms_up_as_apply_delta_does(lazy, momentum, nesterov, group):
    """Through and past a warm-up, every delta kind: the lazy form within the usual tolerance, the
    plain form bit for bit, weights, momentum, counters and the published model alike."""
    cfg = OuterConfig(lr=0.7, momentum=momentum, nesterov=nesterov, group=group, warmup=7)
    ref = OuterState.fresh(params(0))
    fl = FlatOuter.from_state(ref, lazy=lazy)
    rng = np.random.default_rng(group)
    for i in range(45):
        d = random_delta(rng, i)
        w = staleness_weight(i % 9, cfg) * (0.5 if i % 7 == 0 else 1.0)
        apply_delta(ref, d, weight=w, cfg=cfg)
        fl.apply(flat(d), weight=w, cfg=cfg)
        assert_same_state(fl, ref, tol=2e-5 if lazy else 0)
        want, got = published(ref, cfg), fl.views(fl.published_flat(cfg))
        for n in SHAPES:
            if lazy:
                torch.testing.assert_close(got[n], want[n], atol=2e-5, rtol=2e-5)
            else:
                assert torch.equal(got[n], want[n]), (i, n)
    assert fl.groups == ref.groups == 45 // group > cfg.warmup  # through the ramp and past it


@pytest.mark.parametrize("lazy", [True, False])
def test_flat_outer_takes_a_warmup_change_mid_group(lazy):
    """The config's warm-up changed between two deltas of one group: the deferred shares are settled
    at the old lr, the rest at the new, as apply_delta does with the config of each call."""
    cfgs = [OuterConfig(lr=0.8, momentum=0.9, group=4, warmup=w) for w in (10, 0, 30)]
    ref = OuterState.fresh(params(0))
    fl = FlatOuter.from_state(ref, lazy=lazy)
    rng = np.random.default_rng(3)
    for i in range(30):
        cfg = cfgs[0] if i < 10 else cfgs[1] if i < 18 else cfgs[2]  # switches at deltas 10 and 18: mid-group
        d = random_delta(rng, i)
        apply_delta(ref, d, weight=1.0, cfg=cfg)
        fl.apply(flat(d), weight=1.0, cfg=cfg)
        assert_same_state(fl, ref, tol=2e-5 if lazy else 0)


# -- compensation: a merged delta taken back later ----------------------------------------------

def weights_gap(a: FlatOuter, b: FlatOuter) -> float:
    return float((a.weights_flat() - b.weights_flat()).norm())


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("nesterov", [True, False])
def test_compensating_a_delta_without_momentum_undoes_it_exactly(lazy, nesterov):
    """Momentum 0: the weights after (false delta, others, its compensation) are the clean run's, to
    float rounding, whatever the group and the delta's weight; the compensation is no member of its
    group."""
    cfg = OuterConfig(lr=0.8, momentum=0.0, nesterov=nesterov, group=3)
    rng = np.random.default_rng(7)
    deltas = [flat(random_delta(rng, i)) for i in range(14)]
    clean, dirty = (FlatOuter.from_state(OuterState.fresh(params(0)), lazy=lazy) for _ in range(2))
    false = flat(random_delta(rng, 99))
    for i, d in enumerate(deltas):
        if i == 4:
            applied = 1.7 * dirty.open_share(cfg)
            dirty.apply(false, weight=1.7, cfg=cfg)
        if i == 9:
            before = dirty.in_group
            dirty.compensate(false, applied=applied, cfg=cfg)
            assert dirty.in_group == before
        clean.apply(d, weight=0.9, cfg=cfg)
        dirty.apply(d, weight=0.9, cfg=cfg)
    gap = weights_gap(dirty, clean)
    assert gap < 1e-5 * float(clean.weights_flat().norm()), gap


@pytest.mark.parametrize("lazy", [False, True])
def test_a_compensation_takes_back_the_step_at_the_share_it_was_merged_with(lazy):
    """Under the outer warm-up a later group's share is larger: the compensation takes back what the
    delta moved (applied), not its weight at today's share."""
    cfg = OuterConfig(lr=0.8, momentum=0.0, group=2, warmup=6)
    rng = np.random.default_rng(5)
    start = FlatOuter.from_state(OuterState.fresh(params(0)), lazy=lazy)
    run = FlatOuter.from_state(OuterState.fresh(params(0)), lazy=lazy)
    false = flat(random_delta(rng, 1))
    applied = 2.0 * run.open_share(cfg)
    run.apply(false, weight=2.0, cfg=cfg)
    for _ in range(7):  # weightless deltas: only the groups (and the warm-up's share) move on
        run.apply(flat(random_delta(rng, 2)), weight=0.0, cfg=cfg)
    assert run.open_share(cfg) > 3 * applied / 2.0
    run.compensate(false, applied=applied, cfg=cfg)
    run.apply(flat(random_delta(rng, 3)), weight=0.0, cfg=cfg)  # the group closes: its share is in T
    assert weights_gap(run, start) < 1e-5 * float(start.weights_flat().norm())


@pytest.mark.parametrize("momentum", [0.2, 0.9])
def test_compensating_a_delta_cancels_its_momentum_trail_as_groups_go_on(momentum):
    """With momentum the compensation undoes the false delta's direct step at once and feeds its
    negation to the momentum, so the gap to the clean run shrinks by the momentum's decay; left alone,
    the false delta's trail only grows to lr * g / (1 - mu)."""
    cfg = OuterConfig(lr=0.8, momentum=momentum, group=1)
    rng = np.random.default_rng(3)
    runs = {k: FlatOuter.from_state(OuterState.fresh(params(0)), lazy=True) for k in ("clean", "left", "taken")}
    false = flat(random_delta(rng, 0))
    gaps_left, gaps_taken = [], []
    for i in range(60):
        d = flat(random_delta(rng, i + 1))
        if i == 0:
            for k in ("left", "taken"):
                runs[k].apply(false, weight=1.0, cfg=cfg)
        if i == 3:  # found false three versions later
            runs["taken"].compensate(false, applied=1.0 * runs["taken"].open_share(cfg), cfg=cfg)
        for r in runs.values():
            r.apply(d, weight=0.5, cfg=cfg)
        gaps_left.append(weights_gap(runs["left"], runs["clean"]))
        gaps_taken.append(weights_gap(runs["taken"], runs["clean"]))
    # the two trails' gap decays as mu ** groups: at mu 0.9, 56 groups on, 0.9 ** 56 = 0.003
    assert gaps_taken[-1] < 0.01 * gaps_left[-1], (gaps_taken[-1], gaps_left[-1])
    assert gaps_taken[3] < gaps_left[3]  # at once: its direct step is gone, its momentum's steps remain
