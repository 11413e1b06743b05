"""Robust merging's screen: clip, reject by norm, reject by direction, and the history it keeps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shared import codec
from shared.algorithms.robust import decide, delta_stats, flat_delta_stats, remember, screen
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
    assert flat_delta_stats(fd, torch.zeros_like(flat_ref))[1] is None
    v = decide(*want, history=[want[0]] * 8, cfg=CFG)
    assert v == screen(d, history=[want[0]] * 8, reference=ref, cfg=CFG)
