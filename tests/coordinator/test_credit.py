"""Credit: the formula (coordinator/credit.py), and that only merged deltas earn it, once."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from coordinator import credit
from coordinator.models import DeltaRecord, Lease, Worker
from tests.conftest import API, schema_of


@pytest.mark.parametrize(("return_s", "bonus"), [
    (600.0, 1.0), (150.0, 1.0),  # a quarter of the deadline and later: the tokens alone
    (60.0, math.sqrt(2.5)),  # sqrt(0.25 * 600 / 60)
    (15.0, math.sqrt(10.0)),
    (600 / 64, 4.0), (1.0, 4.0), (0.0, 4.0),  # capped
    (10_000.0, 1.0),  # a late delta that still merged
])
def test_quick_return_bonus(return_s, bonus):
    assert credit.quick_return_bonus(return_s=return_s, lease_ttl_s=600.0) == pytest.approx(bonus)


def test_bonus_falls_with_return_time_and_scales_with_the_deadline():
    bonuses = [credit.quick_return_bonus(return_s=s, lease_ttl_s=600.0) for s in (1, 5, 10, 30, 60, 120, 300)]
    assert bonuses == sorted(bonuses, reverse=True)
    # the same fraction of a longer deadline earns the same bonus
    assert credit.quick_return_bonus(return_s=60, lease_ttl_s=600) == pytest.approx(
        credit.quick_return_bonus(return_s=600, lease_ttl_s=6000))


def test_delta_credit_is_tokens_times_bonus():
    assert credit.delta_credit(1000, return_s=300, lease_ttl_s=600) == 1000.0
    assert credit.delta_credit(1000, return_s=15, lease_ttl_s=600) == pytest.approx(1000 * math.sqrt(10))
    assert credit.delta_credit(0, return_s=1, lease_ttl_s=600) == 0.0
    with pytest.raises(ValueError):
        credit.delta_credit(-1, return_s=1, lease_ttl_s=600)
    with pytest.raises(ValueError):
        credit.quick_return_bonus(return_s=1, lease_ttl_s=0)
    assert "merged" in credit.FORMULA and str(credit.K) in credit.FORMULA


def _backdate(api, lease_id: int, seconds: float) -> None:
    """Make a lease look granted `seconds` before its delta arrived."""
    with api.db() as s:
        received = s.scalar(select(DeltaRecord.received_at).where(DeltaRecord.lease_id == lease_id))
        s.execute(update(Lease).where(Lease.id == lease_id).values(created_at=received - timedelta(seconds=seconds)))
        s.commit()


def test_only_merged_deltas_earn_credit_once(api, run, make_delta, encode_unchecked):
    tokens = run.inner.steps * run.inner.batch_size * run.model.context
    fast, slow, bad = api.register(name="fast", team="blue"), api.register(name="slow", team="blue"), api.register()
    leases = {who: api.lease(h) for who, h in (("fast", fast), ("slow", slow), ("bad", bad))}
    api.accept(leases["fast"].lease_id, make_delta(leases["fast"], seed=1), fast)
    api.accept(leases["slow"].lease_id, make_delta(leases["slow"], seed=2), slow)
    # a finite delta whose norm is far beyond what a round of AdamW steps can move: rejected at merge
    huge = encode_unchecked(leases["bad"].base_version,
                            [(n, [1e3] * math.prod(shape)) for n, shape in schema_of(leases["bad"]).items()])
    api.accept(leases["bad"].lease_id, huge, bad)
    _backdate(api, leases["fast"].lease_id, 15.0)  # lease_ttl_s is 600: bonus sqrt(10)
    _backdate(api, leases["slow"].lease_id, 400.0)  # past a quarter of the deadline: bonus 1
    assert api.drain() == 3
    with api.db() as s:
        earned = {w.name: w.credit for w in s.scalars(select(Worker))}
        outcomes = dict(s.execute(select(DeltaRecord.lease_id, DeltaRecord.outcome)).all())
    assert outcomes[leases["bad"].lease_id] == "rejected"
    assert earned == {"fast": pytest.approx(tokens * math.sqrt(10)), "slow": pytest.approx(tokens), None: 0.0}
    assert api.drain() == 0  # nothing is awarded twice
    # the operator's list shows it too
    listed = {w["name"]: w["credit"] for w in api.operator("get", f"{API}/runs/t/workers").json()}
    assert listed["fast"] == pytest.approx(tokens * math.sqrt(10)) and listed[None] == 0.0


def test_credit_survives_a_restart_without_being_awarded_again(open_api, run_config, make_delta, settings):
    with open_api(settings) as api:
        api.create_run(run_config())
        w = api.register(name="alice")
        lease = api.lease(w)
        api.accept(lease.lease_id, make_delta(lease), w)
        api.drain()
        with api.db() as s:
            before = s.scalar(select(Worker.credit))
    assert before > 0
    with open_api(settings) as api:  # the restart replays the merged delta into the weights, not the ledger
        with api.db() as s:
            assert s.scalar(select(Worker.credit)) == before


def test_a_sparta_round_counts_the_share_of_exchanges_it_made():
    """Issue 18: an empty sparta delta is evidence of nothing; its exchanges are the work."""
    assert credit.sparta_tokens(1024, exchanges_made=0, exchanges_expected=4) == 0
    assert credit.sparta_tokens(1024, exchanges_made=1, exchanges_expected=4) == 256
    assert credit.sparta_tokens(1024, exchanges_made=4, exchanges_expected=4) == 1024
    assert credit.sparta_tokens(1024, exchanges_made=9, exchanges_expected=4) == 1024  # never more than a round
    assert credit.sparta_tokens(1024, exchanges_made=0, exchanges_expected=0) == 0  # a round with no exchange step
