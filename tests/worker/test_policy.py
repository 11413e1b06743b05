"""worker.policy: the pure "may I train now, and if not why" table, and the lease-hold rule."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from worker.policy import Conditions, Rules, decide, format_duration, hold_limit_s, next_utc_day, utc_day

IDLE = Rules(when="idle", idle_s=300, on_battery="pause", max_other_load=0.3)
ALWAYS = Rules()  # when=always, on_battery=run, no cap
CAPPED = Rules(daily_transfer_bytes=10_000_000)

# (rules, conditions, train?, kind)
TABLE = [
    (ALWAYS, Conditions(), True, ""),
    (ALWAYS, Conditions(on_battery=True, user_idle_s=0, load_quiet_s=0), True, ""),  # always means always
    (ALWAYS, Conditions(paused_by_user=True), False, "user"),
    (IDLE, Conditions(user_idle_s=301), True, ""),
    (IDLE, Conditions(user_idle_s=299), False, "active"),
    (IDLE, Conditions(user_idle_s=0.5), False, "active"),  # the user came back: pause at once
    (IDLE, Conditions(user_idle_s=3600, on_battery=True), False, "battery"),
    (IDLE, Conditions(user_idle_s=3600, on_battery=False), True, ""),
    (IDLE, Conditions(user_idle_s=3600, on_battery=None), True, ""),  # cannot tell: not a reason to stop
    (Rules(when="idle", idle_s=300, on_battery="run"), Conditions(user_idle_s=3600, on_battery=True), True, ""),
    (Rules(on_battery="pause"), Conditions(on_battery=True), False, "battery"),  # --when always --on-battery pause
    # the CPU-load fallback, only when input idle time is unknown
    (IDLE, Conditions(load_quiet_s=10, other_load=0.9), False, "busy"),
    (IDLE, Conditions(load_quiet_s=400, other_load=0.05), True, ""),
    (IDLE, Conditions(user_idle_s=400, load_quiet_s=0, other_load=0.9), True, ""),  # input idle time wins
    (IDLE, Conditions(), True, ""),  # neither: trains, with a note (below)
    # the daily cap: reached, or the next round would cross it
    (CAPPED, Conditions(transfer_today_bytes=9_000_000), True, ""),
    (CAPPED, Conditions(transfer_today_bytes=10_000_000), False, "cap"),
    (CAPPED, Conditions(transfer_today_bytes=9_000_000, next_round_bytes=2_000_000), False, "cap"),
    (CAPPED, Conditions(transfer_today_bytes=12_000_000, in_round=True), True, ""),  # a round started is finished
    # the order of reasons: user > cap > battery > active > busy
    (Rules(when="idle", idle_s=300, on_battery="pause", daily_transfer_bytes=1),
     Conditions(paused_by_user=True, transfer_today_bytes=5, on_battery=True, user_idle_s=0), False, "user"),
    (Rules(when="idle", idle_s=300, on_battery="pause", daily_transfer_bytes=1),
     Conditions(transfer_today_bytes=5, on_battery=True, user_idle_s=0), False, "cap"),
    (IDLE, Conditions(on_battery=True, user_idle_s=0), False, "battery"),
]


@pytest.mark.parametrize("rules, conditions, train, kind", TABLE)
def test_policy_table(rules, conditions, train, kind):
    verdict = decide(rules, conditions)
    assert (verdict.train, verdict.kind) == (train, kind)
    assert bool(verdict.reason) != train  # a pause always says why, training never does


def test_reasons_say_what_ends_the_pause():
    assert "idletrain worker resume" in decide(ALWAYS, Conditions(paused_by_user=True)).reason
    r = decide(IDLE, Conditions(user_idle_s=42)).reason
    assert "42 s ago" in r and "5 min" in r
    r = decide(IDLE, Conditions(load_quiet_s=10, other_load=0.9)).reason
    assert "90% now" in r and "30%" in r and "5 min" in r
    r = decide(CAPPED, Conditions(transfer_today_bytes=12_000_000, to_next_day_s=5 * 3600)).reason
    assert "12.0 MB of 10.0 MB" in r and "00:00 UTC" in r and "5 h" in r
    r = decide(CAPPED, Conditions(transfer_today_bytes=9_000_000, next_round_bytes=2_000_000)).reason
    assert "next round needs ~2.0 MB" in r
    assert "plugged in" in decide(IDLE, Conditions(on_battery=True)).reason


def test_idle_without_any_probe_trains_and_says_so():
    verdict = decide(IDLE, Conditions())
    assert verdict.train and "--when always" in verdict.note
    assert decide(IDLE, Conditions(user_idle_s=1000)).note == ""


@pytest.mark.parametrize("left_s, limit_s", [(600, 300), (0, 0), (-50, 0), (3600, 1800)])
def test_a_paused_round_holds_its_lease_for_half_the_time_left(left_s, limit_s):
    assert hold_limit_s(left_s) == limit_s


def test_next_utc_day():
    assert next_utc_day(datetime(2025, 3, 1, 23, 59, tzinfo=UTC)) == datetime(2025, 3, 2, tzinfo=UTC)
    assert next_utc_day(datetime(2024, 12, 31, 0, 0, tzinfo=UTC)) == datetime(2025, 1, 1, tzinfo=UTC)
    # a local time east of UTC, already past midnight there but not in UTC
    tokyo = timezone(timedelta(hours=9))
    assert utc_day(datetime(2025, 3, 2, 5, 0, tzinfo=tokyo)) == "2025-03-01"
    assert next_utc_day(datetime(2025, 3, 2, 5, 0, tzinfo=tokyo)) == datetime(2025, 3, 2, tzinfo=UTC)


@pytest.mark.parametrize("seconds, text", [(0, "0 s"), (42.4, "42 s"), (300, "5 min"), (150, "2.5 min"),
                                           (7200, "2 h"), (-3, "0 s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
