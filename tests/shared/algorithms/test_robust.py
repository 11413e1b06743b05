"""Robust merging's screen: clip, reject by norm, reject by direction, and the history it keeps."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from shared import codec
from shared.algorithms.robust import decide, remember, screen
from shared.algorithms.robust_stats import delta_stats, flat_delta_stats
from shared.codec import Delta, Entry, IndexKind, ValueKind
from shared.config import RobustConfig

CFG = RobustConfig(min_history=4, window=8, clip_factor=3.0, reject_factor=10.0, min_cosine=-0.1)


def dense(values) -> Delta:
    v = np.asarray(values, dtype=np.float32)
    return Delta(0, (Entry("w", v.size, IndexKind.DENSE, ValueKind.FP32, v),))


def sparse(values, indices, numel) -> Delta:
    v = np.asarray(values, dtype=np.float32)
    return Delta(0, (Entry("w", numel, IndexKind.PACKED, ValueKind.FP32, v, np.asarray(indices, dtype=np.int64)),))


REF = {"w": torch.tensor([1.0, 1.0, 0.0, 0.0])}


def test_stats_norm_and_cosine_on_the_support():
    norm, cos = delta_stats(dense([3.0, 4.0, 0.0, 0.0]), REF)
    assert norm == pytest.approx(5.0)
    assert cos == pytest.approx(7 / (5 * math.sqrt(2)))
    # sparse: only the sent positions are compared
    norm, cos = delta_stats(sparse([2.0], [2], 4), REF)
    assert norm == pytest.approx(2.0) and cos is None  # the reference is zero there
    norm, cos = delta_stats(sparse([-1.0, -1.0], [0, 1], 4), REF)
    assert cos == pytest.approx(-1.0)
    assert delta_stats(dense([1, 0, 0, 0]), None)[1] is None
    assert delta_stats(dense([1, 0, 0, 0]), {"w": torch.zeros(4)})[1] is None


def test_accepts_everything_finite_until_history_is_known():
    v = screen(dense([1e6, 0, 0, 0]), history=[1.0, 1.0, 1.0], reference=None, cfg=CFG)
    assert v.action == "accept" and v.scale == 1.0
    v = screen(dense([math.inf, 0, 0, 0]), history=[], reference=None, cfg=CFG)
    assert v.action == "reject" and "not finite" in v.reason


@pytest.mark.parametrize("scale, action", [(1.0, "accept"), (2.9, "accept"), (5.0, "clip"), (9.9, "clip"),
                                           (10.5, "reject"), (100.0, "reject")])
def test_norm_thresholds_against_the_median(scale, action):
    history = [1.0, 0.9, 1.1, 1.0, 1.2]  # median 1.0
    v = screen(dense([scale, 0, 0, 0]), history=history, reference=None, cfg=CFG)
    assert v.action == action
    if action == "clip":
        assert v.scale == pytest.approx(3.0 / scale)
        assert "clipped" in v.reason
    if action == "reject":
        assert "median" in v.reason and v.scale == 0.0


def test_direction_against_the_consensus():
    history = [1.0] * 5
    honest = screen(dense([0.7, 0.7, 0.1, 0.0]), history=history, reference=REF, cfg=CFG)
    flipped = screen(dense([-0.7, -0.7, -0.1, 0.0]), history=history, reference=REF, cfg=CFG)
    assert honest.action == "accept" and honest.cosine > 0.9
    assert flipped.action == "reject" and "consensus" in flipped.reason and flipped.cosine < -0.9
    # orthogonal is not evidence of malice
    assert screen(dense([0, 0, 1.0, 0]), history=history, reference=REF, cfg=CFG).action == "accept"


def test_disabled_screen_accepts_finite_deltas():
    cfg = CFG.model_copy(update={"enabled": False})
    assert screen(dense([100.0, 0, 0, 0]), history=[1.0] * 8, reference=None, cfg=cfg).action == "accept"


def test_history_keeps_merged_norms_only_within_the_window():
    history: list[float] = []
    for i in range(12):
        remember(history, screen(dense([1.0 + i / 100, 0, 0, 0]), history=history, reference=None, cfg=CFG), CFG)
    assert len(history) == CFG.window and history[-1] == pytest.approx(1.11)
    rejected = screen(dense([1000.0, 0, 0, 0]), history=history, reference=None, cfg=CFG)
    remember(history, rejected, CFG)
    assert max(history) < 2  # a rejected delta never shifts what counts as normal
    clipped = screen(dense([5.0, 0, 0, 0]), history=history, reference=None, cfg=CFG)
    assert clipped.action == "clip"


def test_config_orders_its_thresholds():
    with pytest.raises(ValueError):
        RobustConfig(clip_factor=5, reject_factor=4)
    with pytest.raises(ValueError):
        RobustConfig(throttle_after=3, ban_after=2)


def test_adam_bound_rejects_from_the_first_delta():
    from shared.algorithms.robust import adam_bound

    bound = adam_bound(steps=10, lr=1e-3, n_params=4)  # 10 * 1e-3 * 2 = 0.02
    assert bound == pytest.approx(0.02)
    ok = screen(dense([0.01, 0.01, 0, 0]), history=[], reference=None, cfg=CFG, bound=bound)
    assert ok.action == "accept"
    big = screen(dense([1.0, 0, 0, 0]), history=[], reference=None, cfg=CFG, bound=bound)
    assert big.action == "reject" and "AdamW" in big.reason
    off = CFG.model_copy(update={"bound_factor": 0})
    assert screen(dense([1.0, 0, 0, 0]), history=[], reference=None, cfg=off, bound=bound).action == "accept"


SCHEMA = {"a": (3, 4), "w": (4,), "b": (50,)}


@pytest.mark.parametrize("seed", range(6))
def test_flat_delta_stats_equal_delta_stats(seed):
    """The coordinator's flat path: same norm and cosine as delta_stats, and a positive multiple of the
    reference (FlatOuter keeps the momentum as m = s M) changes nothing."""
    rng = np.random.default_rng(seed)
    ref = {n: torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for n, s in SCHEMA.items()}
    entries = []
    for i, (n, s) in enumerate(SCHEMA.items()):
        numel = math.prod(s)
        v = rng.standard_normal(numel).astype(np.float32)
        if (i + seed) % 3 == 0:
            entries.append(Entry(n, numel, IndexKind.DENSE, ValueKind.FP32, v))
        elif (i + seed) % 3 == 1:
            idx = np.sort(rng.choice(numel, max(1, numel // 3), replace=False)).astype(np.int64)
            entries.append(Entry(n, numel, IndexKind.PACKED, ValueKind.FP32, v[idx], idx))
    d = Delta(0, tuple(entries))
    fd = codec.decode_flat(codec.encode(d), schema=SCHEMA)
    flat_ref = torch.cat([ref[n].reshape(-1) for n in SCHEMA])
    want = delta_stats(d, ref)
    for scale in (1.0, 0.37, 1e-3):
        got = flat_delta_stats(fd, flat_ref / scale)
        assert got[0] == pytest.approx(want[0], rel=1e-12)
        assert (got[1] is None) == (want[1] is None)
        if want[1] is not None:
            assert got[1] == pytest.approx(want[1], rel=1e-6, abs=1e-9)
    assert flat_delta_stats(fd, None) == (pytest.approx(want[0], rel=1e-12), None)
    want_agreement, got_agreement = delta_direction(d, ref).agreement, flat_delta_direction(fd, flat_ref * 3).agreement
    assert (got_agreement is None) == (want_agreement is None)
    if want_agreement is not None:
        assert got_agreement == pytest.approx(want_agreement, rel=1e-6, abs=1e-9)
    assert flat_delta_stats(fd, torch.zeros_like(flat_ref))[1] is None
    v = decide(*want, history=[want[0]] * 8, cfg=CFG)
    assert v == screen(d, history=[want[0]] * 8, reference=ref, cfg=CFG)


# -- from the first delta on, and each worker once (issue 18's "Critical" items) ------------------

from shared.algorithms.robust import Norms, Rejection, element_bound, ramp_weight, reference_scale  # noqa: E402
from shared.algorithms.robust_stats import max_abs  # noqa: E402

DEFAULTS = RobustConfig()


def test_element_bound_rejects_one_outsized_value_from_the_first_delta():
    elements = element_bound(steps=10, lr=1e-3)  # 0.01 per element
    assert elements == pytest.approx(0.01)
    ok = screen(dense([0.02, -0.02, 0.001, 0]), history=[], reference=None, cfg=DEFAULTS, elements=elements)
    assert ok.action == "accept"  # 2x: Adam's overshoot, a carried-over round
    spike = screen(dense([0.05, 0, 0, 0]), history=[], reference=None, cfg=DEFAULTS, elements=elements)
    assert spike.action == "reject" and "one element" in spike.reason
    # sparse compression carries an element's unsent rounds: ~1/fraction of them
    assert element_bound(steps=10, lr=1e-3, fraction=0.1) == pytest.approx(0.1)
    assert max_abs(dense([0.5, -3.0])) == 3.0 and math.isnan(max_abs(dense([math.nan, 1.0])))


def test_reference_round_bounds_the_norm_before_any_history():
    ref = 1.0
    assert screen(dense([1.4, 0, 0, 0]), history=[], reference=None, cfg=DEFAULTS, reference_norm=ref).merged
    v = screen(dense([1.6, 0, 0, 0]), history=[], reference=None, cfg=DEFAULTS, reference_norm=ref)
    assert v.action == "reject" and "reference round" in v.reason


def test_reference_scale_is_the_rounds_a_sparse_delta_carries():
    assert reference_scale(fraction=1.0) == 1.0  # dense: one round
    assert reference_scale(fraction=1.0, feedback_decay=0.9, random=True) == pytest.approx(1.0)
    assert reference_scale(fraction=0.1) == pytest.approx(1 / math.sqrt(0.1))  # top-k: 1/fraction rounds per value
    # with decay d a value kept 1/fraction rounds carries 1 + d + ... + d^(1/fraction - 1) of them
    assert reference_scale(fraction=0.02, feedback_decay=0.95) == pytest.approx(
        math.sqrt(0.02) * sum(0.95 ** j for j in range(50)))
    # a random subset keeps a value p ~ Geometric(fraction) rounds: the series, summed term by term
    for d in (1.0, 0.95):
        series = sum(0.1 * 0.9 ** (p - 1) * sum(d ** j for j in range(p)) ** 2 for p in range(1, 2000))
        assert reference_scale(fraction=0.1, feedback_decay=d, random=True) == pytest.approx(math.sqrt(0.1 * series))
    assert reference_scale(fraction=0.001, feedback_decay=0.5) == 1.0  # never below a dense round


@pytest.mark.parametrize("fraction, decay, measured", [
    (0.1, 1.0, 1.64),  # the most honest top-k deltas measured (robust.reference_scale's docstring)
    (0.02, 1.0, 1.97),
    (0.02, 0.95, 1.29),  # SparseLoCo: under the dense bound too
])
def test_a_sparse_runs_reference_bound_scales_by_the_rounds_it_carries(fraction, decay, measured):
    ref = 2.0
    scale = reference_scale(fraction=fraction, feedback_decay=decay)

    def delta(share):  # a top-k delta of share x the reference's norm
        return sparse([share * ref / math.sqrt(2)] * 2, [0, 3], 10)

    kw = {"history": [], "reference": None, "cfg": DEFAULTS, "reference_norm": ref}
    assert screen(delta(measured), **kw, reference_scale=scale).merged
    dense_run = screen(delta(measured), **kw)  # the same delta where the run is dense
    assert dense_run.merged == (measured <= DEFAULTS.reference_factor)
    assert dense_run == screen(delta(measured), **kw, reference_scale=1.0)  # dense: exactly as before
    for share in (10 * measured, 1.01 * DEFAULTS.reference_factor * scale):  # scaled up, or just past the bound
        v = screen(delta(share), **kw, reference_scale=scale)
        assert v.rejection == Rejection.BOUND and "rounds a sparse delta can carry" in v.reason, share
    # the idle check and the early agreement keep the plain reference round
    assert decide(1e-4 * ref, None, history=[], cfg=DEFAULTS, reference_norm=ref,
                  reference_scale=scale).rejection == Rejection.IDLE
    assert decide(0.6 * ref, 0.0, history=[], cfg=DEFAULTS, reference_norm=ref,
                  reference_scale=scale).rejection == Rejection.DIRECTION


@pytest.mark.parametrize("values", [[0.0, 0, 0, 0], [1e-7, 0, 0, 0]])
def test_too_small_is_no_rounds_work(values):
    v = screen(dense(values), history=[], reference=None, cfg=DEFAULTS, reference_norm=1.0)
    assert v.action == "reject" and "too small" in v.reason
    # against the workers' median too, once it exists
    norms = Norms({str(w): [1.0, 1.0] for w in range(4)})  # min_history 8, min_workers 4
    v = screen(dense([0.005, 0, 0, 0]), history=norms, reference=None, cfg=DEFAULTS)
    assert v.action == "reject" and "too small" in v.reason and "median" in v.reason
    assert screen(dense([0.05, 0, 0, 0]), history=norms, reference=None, cfg=DEFAULTS).merged


def test_the_median_counts_each_worker_once_and_needs_several():
    norms = Norms()
    for _ in range(50):  # one worker alone sets nothing, however many deltas it sends
        norms.add("evil", 100.0, DEFAULTS)
    assert norms.median() == (100.0, 1) and len(norms) == 8  # PER_WORKER kept
    assert screen(dense([100.0, 0, 0, 0]), history=norms, reference=None, cfg=DEFAULTS).action == "accept"
    for w in ("a", "b", "c"):
        norms.add(w, 1.0, DEFAULTS)
    assert norms.median()[1] == 4
    # 1 of 4 workers cannot move the median of the workers' medians: the honest norm stays "normal"
    assert norms.median()[0] == pytest.approx(1.0)
    v = screen(dense([100.0, 0, 0, 0]), history=norms, reference=None, cfg=DEFAULTS)
    assert v.action == "reject" and "median" in v.reason and "4 workers" in v.reason
    # the window keeps the most recently seen workers
    small = DEFAULTS.model_copy(update={"window": 2})
    n2 = Norms()
    for w in ("x", "y", "z"):
        n2.add(w, 1.0, small)
    assert list(n2.by_worker) == ["y", "z"]
    assert Norms.from_json(norms.to_json()) == norms


def test_a_random_direction_above_the_median_is_refused_an_aligned_one_clipped():
    norms = Norms({str(w): [1.0, 1.0] for w in range(4)})  # min_history 8, min_workers 4
    ref = {"w": torch.tensor([1.0, 1.0, 1.0, 1.0])}
    random_dir = screen(dense([2.9, -2.9, 2.9, -2.9]), history=norms, reference=ref, cfg=DEFAULTS)  # cosine 0
    assert random_dir.action == "reject" and "does not agree" in random_dir.reason
    aligned = screen(dense([2.0, 2.0, 1.9, 2.1]), history=norms, reference=ref, cfg=DEFAULTS)
    assert aligned.action == "clip" and aligned.cosine > 0.9
    # below the median a weak agreement is not evidence of anything
    assert screen(dense([0.4, -0.4, 0.4, -0.4]), history=norms, reference=ref, cfg=DEFAULTS).action == "accept"


def test_the_consensus_test_applies_before_any_history():
    v = screen(dense([-1.0, -1.0, 0, 0]), history=[], reference=REF, cfg=DEFAULTS)
    assert v.action == "reject" and "consensus" in v.reason


def test_ramp_weight_grows_with_the_record():
    assert [ramp_weight(n, DEFAULTS) for n in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert ramp_weight(0, DEFAULTS.model_copy(update={"ramp": 1})) == 1.0
    assert ramp_weight(0, DEFAULTS.model_copy(update={"enabled": False})) == 1.0


@pytest.mark.parametrize("norm_share, cosine, merged", [
    (0.95 * 1.5, 0.0, False),  # the early-fit burst: at the reference bound, a random direction
    (0.9, 0.01, False),  # as large as an honest round, not along it
    (0.9, 0.5, True),  # as large as an honest round, along it
    (0.4, 0.0, True),  # below half the reference: no larger than noise of an honest size
    (0.9, None, True),  # no consensus direction at all (no reference round either)
])
def test_before_a_median_a_large_delta_must_agree_with_the_reference(norm_share, cosine, merged):
    """With no median of workers yet, half the coordinator's reference round stands in for it: above
    it, a delta must point along the consensus (min_agreement), which is the reference round's own
    direction until the outer momentum has one."""
    reference = 2.0
    v = decide(norm_share * reference, cosine, history=[], cfg=DEFAULTS, reference_norm=reference)
    assert v.merged is merged, v
    if not merged:
        assert "consensus" in v.reason and "reference round" in v.reason


# -- agreement where the consensus speaks: sparse deltas that barely meet the momentum -------------

from shared.algorithms.robust_stats import AGREEMENT_Z, delta_direction, flat_delta_direction  # noqa: E402

N, K, REFERENCE_NORM = 22090, 2209, 3.39  # the loopback tests' model: top-k 10% of its values


def two_worker_case(overlap: int, *, seed: int = 0, cosine: float = 0.047) -> tuple[Delta, dict]:
    """An honest top-k delta as measured in a two-worker run (robust.py's docstring): `overlap` of its
    K values where the momentum (two rounds' supports) is nonzero, along it there (similar magnitudes:
    top-k values); the rest where it is zero. Its cosine on its support is `cosine`, norm 0.84x the reference."""
    rng = np.random.default_rng(seed)
    m = np.zeros(N)
    m_support = rng.choice(N, 2 * K, replace=False)
    m[m_support] = rng.uniform(0.7, 1.0, 2 * K) * rng.choice([-1.0, 1.0], 2 * K)
    off = rng.choice(np.setdiff1d(np.arange(N), m_support), K - overlap, replace=False)
    on = m_support[:overlap]
    v_on = m[on] * rng.uniform(0.95, 1.05, overlap)  # cosine ~0.999 with m there
    v_on *= cosine / math.sqrt(1 - cosine ** 2) / np.linalg.norm(v_on)  # |v_O| / |v_rest| for that cosine
    v_off = rng.uniform(0.7, 1.0, K - overlap) * rng.choice([-1.0, 1.0], K - overlap)
    v_off /= np.linalg.norm(v_off)
    idx = np.concatenate([on, off])
    order = np.argsort(idx)
    values = np.concatenate([v_on, v_off])[order]
    values *= 0.84 * REFERENCE_NORM / np.linalg.norm(values)
    return sparse(values, idx[order], N), {"w": torch.from_numpy(m.astype(np.float32))}


def test_an_honest_sparse_delta_barely_meeting_the_momentum_is_merged():
    """The CI false positive: 0.84x the reference, cosine 0.047 on its support (below min_agreement),
    16 of its values where the momentum is nonzero and along it there."""
    delta, m = two_worker_case(16)
    norm, cosine, agreement = delta_direction(delta, m)
    assert norm == pytest.approx(0.84 * REFERENCE_NORM, rel=1e-5) and cosine < DEFAULTS.min_agreement
    assert agreement > DEFAULTS.min_agreement
    assert screen(delta, history=[], reference=m, cfg=DEFAULTS, reference_norm=REFERENCE_NORM).merged
    # once a median exists the same holds above it
    norms = Norms({str(w): [0.6 * REFERENCE_NORM] * 2 for w in range(4)})
    assert screen(delta, history=norms, reference=m, cfg=DEFAULTS, reference_norm=REFERENCE_NORM).merged
    # scaled up beyond what the reference round moves, it is refused all the same
    big = Delta(0, (dataclasses.replace(delta.entries[0], values=delta.entries[0].values * 2),))
    v = screen(big, history=[], reference=m, cfg=DEFAULTS, reference_norm=REFERENCE_NORM)
    assert not v.merged and "reference round" in v.reason


@pytest.mark.parametrize("magnitudes", ["honest", "equal"])
def test_a_random_direction_of_honest_norm_on_the_same_support_is_refused(magnitudes):
    """Random signs on the honest delta's support, at its norm: refused unless its cosine on the
    support alone reaches min_agreement (+-1/sqrt(K) = 0.021: ~1% of them, as before the agreement);
    the agreement where the momentum speaks lets none of them through."""
    delta, m = two_worker_case(16)
    e = delta.entries[0]
    refused = 0
    for seed in range(40):
        signs = np.random.default_rng(100 + seed).choice([-1.0, 1.0], e.k)
        size = np.abs(e.values) if magnitudes == "honest" else np.full(e.k, np.linalg.norm(e.values) / math.sqrt(e.k))
        rand = Delta(0, (dataclasses.replace(e, values=(size * signs).astype(np.float32)),))
        v = screen(rand, history=[], reference=m, cfg=DEFAULTS, reference_norm=REFERENCE_NORM)
        assert v.merged is (v.cosine >= DEFAULTS.min_agreement), (seed, v)
        assert delta_direction(rand, m).agreement < DEFAULTS.min_agreement, seed
        refused += "does not agree" in (v.reason or "")
    assert refused >= 36  # 40 draws, about 0.4 expected through


def test_a_handful_of_aligned_values_is_no_evidence():
    """Along the momentum on 3 values only: a random direction does as well one time in 8, so it counts
    for nothing (their agreement is below zero) and the cosine alone decides."""
    delta, m = two_worker_case(3)
    _, cosine, agreement = delta_direction(delta, m)
    assert cosine < DEFAULTS.min_agreement and agreement < 0
    assert not screen(delta, history=[], reference=m, cfg=DEFAULTS, reference_norm=REFERENCE_NORM).merged


def test_agreement_is_the_overlap_cosine_less_z_random_spreads():
    """By hand on 4 values: the momentum is zero on one, the delta along it on the others."""
    m = {"w": torch.tensor([1.0, 1.0, 1.0, 0.0])}
    v = np.array([2.0, 2.0, 2.0, 5.0])
    _, cosine, agreement = delta_direction(dense(v), m)
    assert cosine == pytest.approx(6 / (math.sqrt(37) * math.sqrt(3)))
    # v.m = 6, sqrt(sum v_i^2 m_i^2) = sqrt(12), |v_O| = sqrt(12), |m| = sqrt(3)
    assert agreement == pytest.approx((6 - AGREEMENT_Z * math.sqrt(12)) / (math.sqrt(12) * math.sqrt(3)))
    # dense, where the consensus is nonzero everywhere: the agreement is the cosine less Z spreads, below it
    full = delta_direction(dense([0.7, 0.7, 0.1, 0.3]), {"w": torch.tensor([1.0, 1.0, 0.5, 0.2])})
    assert full.agreement < full.cosine
    assert delta_direction(dense([1.0, 0, 0, 0]), None) == (1.0, None, None)
    assert delta_direction(sparse([1.0], [3], 4), m)[1:] == (None, None)  # no consensus on its support
