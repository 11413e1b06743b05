"""The replay spot-check's math: the replay is deterministic on CPU, a worker's first round equals it
up to compression, and the bounds pass honest rounds (int4, bf16, carried AdamW state) and fail
zeros, another shard's or seed's delta, and scaled, noisy or flipped ones."""

from __future__ import annotations

import random
from datetime import datetime, timezone

import pytest
import torch

from shared import codec, protocol
from shared.algorithms.spotcheck import (CARRIED, EXACT, SpotCheckBounds, compare, on_support, replay_round,
                                         rounded_on_support)
from shared.config import CompressionConfig, InnerConfig
from shared.model import ModelConfig, build_model, get_params
from worker.fit import FitOptions
from worker.trainer import LocalTrainer

MODEL = ModelConfig(n_layer=1, d_model=32, n_head=2, context=32)
INNER = InnerConfig(steps=10, batch_size=4)  # the default warm-up (50 steps): a first round is all warm-up
WORDS = ("the of and to in is that for it with as was on be by this are def return self import class none "
         "true false if else while").split()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def shard(i: int) -> torch.Tensor:
    rng = random.Random(i)
    text = " ".join(rng.choice(WORDS) for _ in range(2000)).encode()[:8192]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def lease(*, seed: int, shard_id: int = 0, lease_id: int = 1, values: str = "int4") -> protocol.Lease:
    return protocol.Lease(
        lease_id=lease_id, run="t", shard_id=shard_id, shard_sha256="0" * 64, base_version=0, seed=seed, lr=2e-3,
        inner=INNER, compression=CompressionConfig(values=values), model=MODEL.to_dict(),
        deadline=datetime(2030, 1, 1, tzinfo=timezone.utc))


@pytest.fixture(scope="module")
def base() -> dict[str, torch.Tensor]:
    return get_params(build_model(MODEL, seed=1))


@pytest.fixture(scope="module")
def replayed(base) -> dict[str, torch.Tensor]:
    return replay_round(MODEL, INNER, base, shard(0), lr=2e-3, seed=7)


def sent_delta(body: bytes) -> codec.Delta:
    return codec.decode(body, schema={n: tuple(t.shape) for n, t in get_params(build_model(MODEL)).items()})


def verdict(body: bytes, replayed, bounds: SpotCheckBounds = EXACT):
    return compare(*on_support(sent_delta(body), replayed), bounds)


def test_two_replays_on_cpu_are_equal(base, replayed):
    again = replay_round(MODEL, INNER, base, shard(0), lr=2e-3, seed=7)
    assert all(torch.equal(again[n], replayed[n]) for n in replayed)


def test_a_workers_first_round_on_cpu_is_the_replay(base, replayed):
    """fp32 values travel as they are: the delta sent is the replay, bit for bit."""
    body = LocalTrainer(torch.device("cpu")).train_round(lease(seed=7, values="fp32"), base, shard(0)).body
    dense = sent_delta(body).to_dense({n: tuple(t.shape) for n, t in replayed.items()})
    assert all(torch.equal(torch.from_numpy(dense[n]).reshape(replayed[n].shape), replayed[n]) for n in replayed)
    result = verdict(body, replayed)
    assert result.passed and result.cosine == pytest.approx(1.0) and result.norm_ratio == pytest.approx(1.0)


def test_an_honest_int4_or_bf16_round_passes_the_exact_bounds(base, replayed):
    int4 = LocalTrainer(torch.device("cpu")).train_round(lease(seed=7), base, shard(0)).body
    bf16 = LocalTrainer(torch.device("cpu"), fit=FitOptions(precision="bf16")).train_round(
        lease(seed=7), base, shard(0)).body
    for body in (int4, bf16):
        result = verdict(body, replayed)
        assert result.passed, result
        assert result.cosine > 0.99 and 0.95 < result.norm_ratio < 1.05  # EXACT: 0.98, 0.8-1.25


@pytest.mark.parametrize("values", ["int2", "int1"])
def test_an_honest_int2_or_int1_first_round_is_held_to_its_own_rounding(base, replayed, values):
    """int1 keeps 0.8-0.93 of a direction by itself (int2 0.987 here): against the raw replay an honest int1
    first round fails EXACT; against what the same rounding keeps of the replay it passes, and another
    shard's or seed's delta, rounded alike, still fails."""
    def check(body: bytes):
        delta = sent_delta(body)
        return (compare(*on_support(delta, replayed), EXACT),
                compare(*on_support(delta, replayed), EXACT, rounded=rounded_on_support(delta, replayed)))

    raw, held = check(LocalTrainer(torch.device("cpu")).train_round(lease(seed=7, values=values), base, shard(0)).body)
    if values == "int1":  # what the coordinator judged before: an honest round failed
        assert not raw.passed and raw.cosine < EXACT.min_cosine, raw
    assert held.passed, held
    for other in (lease(seed=7, shard_id=3, values=values), lease(seed=8, values=values)):
        body = LocalTrainer(torch.device("cpu")).train_round(other, base, shard(other.shard_id)).body
        _, verdict_ = check(body)
        assert not verdict_.passed and "direction" in verdict_.reason, verdict_


def test_rounding_the_replay_by_fp32_or_int4_changes_next_to_nothing(base, replayed):
    for values, keeps in (("fp32", 1.0), ("int4", 0.997)):
        delta = sent_delta(LocalTrainer(torch.device("cpu")).train_round(lease(seed=7, values=values), base,
                                                                          shard(0)).body)
        sent, ref = on_support(delta, replayed)
        rounded = rounded_on_support(delta, replayed)
        assert float(rounded @ ref) / float(rounded.norm() * ref.norm()) >= keeps - 1e-9
        assert compare(sent, ref, EXACT, rounded=rounded).passed


def test_another_shard_or_seed_zeros_scaled_or_noisy_fail(base, replayed):
    other_shard = LocalTrainer(torch.device("cpu")).train_round(lease(seed=7, shard_id=3), base, shard(3)).body
    other_seed = LocalTrainer(torch.device("cpu")).train_round(lease(seed=8), base, shard(0)).body
    for body in (other_shard, other_seed):
        result = verdict(body, replayed)
        assert not result.passed and "direction" in result.reason and result.cosine < 0.98, result
    honest, ref = on_support(sent_delta(LocalTrainer(torch.device("cpu")).train_round(
        lease(seed=7), base, shard(0)).body), replayed)
    zeros = compare(torch.zeros_like(honest), ref, EXACT)
    assert not zeros.passed and zeros.norm_ratio == 0.0
    half = compare(honest * 0.5, ref, EXACT)
    assert not half.passed and "size" in half.reason
    noisy = compare(honest + torch.randn(honest.shape, generator=torch.Generator().manual_seed(0),
                                         dtype=torch.float64) * honest.std(), ref, EXACT)
    assert not noisy.passed
    for bounds in (EXACT, CARRIED):  # caught whatever the worker's history
        assert not compare(-honest, ref, bounds).passed
        assert not compare(honest * 10, ref, bounds).passed
        assert not compare(torch.zeros_like(honest), ref, bounds).passed
        assert not compare(torch.randn(honest.shape, generator=torch.Generator().manual_seed(1),
                                       dtype=torch.float64) * honest.std(), ref, bounds).passed


def test_later_rounds_with_carried_adamw_state_pass_the_carried_bounds(base):
    """A worker's later rounds start from AdamW state (and error feedback) its earlier rounds left:
    not the replay's fresh AdamW, so only CARRIED holds them; measured 0.94-0.96 here."""
    tr = LocalTrainer(torch.device("cpu"))
    current, steps = dict(base), 0
    for r in range(4):
        le = lease(seed=100 + r, shard_id=r, lease_id=r + 1)
        body = tr.train_round(le, current, shard(r)).body
        replayed = replay_round(MODEL, INNER, current, shard(r), lr=le.lr, seed=le.seed, step_offset=steps)
        result = verdict(body, replayed, CARRIED)
        assert result.passed and result.cosine > 0.8, (r, result)
        steps += INNER.steps
        dense = sent_delta(body).to_dense({n: tuple(t.shape) for n, t in current.items()})
        current = {n: t - torch.from_numpy(dense[n]).reshape(t.shape) for n, t in current.items()}


def test_a_sparse_delta_is_compared_on_its_support(base, replayed):
    le = lease(seed=7).model_copy(update={"compression": CompressionConfig(index="topk", fraction=0.1)})
    body = LocalTrainer(torch.device("cpu")).train_round(le, base, shard(0)).body
    sent, ref = on_support(sent_delta(body), replayed)
    assert sent.numel() < sum(t.numel() for t in replayed.values()) // 5
    assert compare(sent, ref, EXACT).passed


def test_a_round_that_moves_nothing_matches_nothing():
    z = torch.zeros(8, dtype=torch.float64)
    assert compare(z, z, EXACT).passed  # lr 0: nothing to tell apart
    assert not compare(torch.ones(8, dtype=torch.float64), z, EXACT).passed
    with pytest.raises(ValueError):
        SpotCheckBounds(min_cosine=0.5, min_ratio=2.0, max_ratio=1.0)


# -- where a sparta round applied its corrections (protocol.H_EXCHANGES_APPLIED) ----------------------

def test_applied_corrections_round_trip_and_bad_ones_are_named():
    from shared.algorithms.spotcheck import format_applied, parse_applied

    text = format_applied(4, {2: 3, 6: 9, 8: 11})
    assert text == "4;2:3,6:9,8:11" and parse_applied(text, steps=10) == (4, {2: 3, 6: 9, 8: 11})
    assert parse_applied("0;") == (0, {})
    for bad, why in [("", "resumed at"), ("x;1:2", "resumed at"), ("0;1-2", "exchange step"), ("0;3:3", "after its"),
                     ("0;3:2", "after its"), ("0;1:2,1:3", "once"), ("0;1:12", "round's end"), ("11;", "resumed at step"),
                     ("0;" + "1:2," * 20000, "characters")]:
        with pytest.raises(ValueError, match=why):
            parse_applied(bad, steps=10)


def test_later_int1_rounds_with_error_feedback_pass_the_coarse_bounds_and_crude_fakes_do_not(base):
    """int1 with error feedback: a later round also sends the residual its earlier rounds' rounding left
    out, which grows to a round's size; honest rounds drift below CARRIED (0.31-0.45 in bench field's long
    regime; here 0.94 -> ~0.6 over 30 rounds, measured once) and are held to CARRIED_COARSE, which still
    catches zeros, sign-flipped, blown-up and random deltas."""
    from coordinator.spotcheck import bounds
    from shared.algorithms.spotcheck import CARRIED_COARSE
    from shared.config import RunConfig

    cfg = RunConfig(name="t", compression={"values": "int1"})
    assert bounds(cfg, first_lease=False) == CARRIED_COARSE and bounds(cfg, first_lease=True) == EXACT
    assert bounds(RunConfig(name="t"), first_lease=False) == CARRIED  # int4: the residual is small
    tr = LocalTrainer(torch.device("cpu"))
    current, steps, cosines = dict(base), 0, []
    for r in range(12):
        le = lease(seed=100 + r, shard_id=r % 8, lease_id=r + 1, values="int1")
        body = tr.train_round(le, current, shard(r % 8)).body
        replayed = replay_round(MODEL, INNER, current, shard(r % 8), lr=le.lr, seed=le.seed, step_offset=steps)
        delta = sent_delta(body)
        sent, ref = on_support(delta, replayed)
        rounded = rounded_on_support(delta, replayed)
        result = compare(sent, ref, CARRIED_COARSE, rounded=rounded)
        assert result.passed, (r, result)
        cosines.append(result.cosine)
        noise = torch.randn(sent.shape, generator=torch.Generator().manual_seed(r), dtype=sent.dtype) * sent.std()
        for fake in (-sent, sent * 10, torch.zeros_like(sent), noise):
            assert not compare(fake, ref, CARRIED_COARSE, rounded=rounded).passed, r
        steps += INNER.steps
        dense = delta.to_dense({n: tuple(t.shape) for n, t in current.items()})
        current = {n: t - torch.from_numpy(dense[n]).reshape(t.shape) for n, t in current.items()}
    assert min(cosines[8:]) < cosines[0] - 0.1, cosines  # the residual builds up: later rounds drift away
