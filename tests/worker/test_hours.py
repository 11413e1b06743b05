"""--hours: the pure parser and "is now allowed" (worker/hours.py), the policy's verdict, and the
governor pausing a round in progress when the hours end."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest

from tests.worker.test_governor import governor, lease_due_in
from worker.hours import Window, allowed, next_start, parse_hours
from worker.policy import Conditions, Rules, decide
from worker.settings import WorkerSettings, describe_errors

# 2026-03-02 is a Monday
MON, FRI, SAT, SUN = 2, 6, 7, 8


def at(day: int, hh: int, mm: int = 0) -> datetime:
    return datetime(2026, 3, day, hh, mm)


def test_a_night_window_runs_past_midnight():
    night = parse_hours("22:00-07:00")
    assert night.windows == (Window(frozenset(range(7)), 22 * 60, 7 * 60),)
    assert allowed(night, at(MON, 23, 30)) and allowed(night, at(MON, 0, 0)) and allowed(night, at(MON, 6, 59))
    assert not allowed(night, at(MON, 7, 0)) and not allowed(night, at(MON, 12)) and not allowed(night, at(MON, 21, 59))
    assert allowed(night, at(MON, 22, 0))


def test_weekday_windows_belong_to_the_day_they_start_on():
    hours = parse_hours("mon-fri 19:00-08:00, sat-sun 00:00-24:00")
    assert allowed(hours, at(FRI, 23)) and allowed(hours, at(SAT, 7, 59))  # Friday night runs into Saturday
    assert allowed(hours, at(SAT, 12)) and allowed(hours, at(SUN, 23, 59))  # whole weekend days
    # Sunday's whole day ends at 24:00, and no weekday window started on Sunday evening
    assert not allowed(hours, at(MON, 0, 30))
    assert not allowed(hours, at(MON, 9)) and not allowed(hours, at(FRI, 18, 59))
    assert allowed(hours, at(MON + 1, 3))  # Monday's window, into Tuesday


def test_day_ranges_may_wrap_the_week():
    hours = parse_hours("fri-mon 10:00-12:00")
    assert hours.windows[0].days == frozenset({4, 5, 6, 0})
    assert allowed(hours, at(SUN, 11)) and allowed(hours, at(MON, 11)) and not allowed(hours, at(MON + 1, 11))


def test_next_start_is_the_earliest_window_start_ahead():
    hours = parse_hours("mon-fri 19:00-08:00, sat-sun 00:00-24:00")
    assert next_start(hours, at(MON, 9)) == at(MON, 19)
    assert next_start(hours, at(FRI, 23)) == at(FRI, 23)  # inside: now
    assert next_start(parse_hours("sat 10:00-11:00"), at(SUN, 12)) == at(SAT + 7, 10)


@pytest.mark.parametrize("text, names", [
    ("25:00-07:00", "'25:00'"),
    ("22:00-7", "'7'"),
    ("22:00", "'22:00'"),
    ("mon-fry 19:00-08:00", "'mon-fry'"),
    ("mon 19:00-08:00,, sun 01:00-02:00", "empty window"),
    ("08:00-08:00", "same time"),
    ("24:00-03:00", "'24:00'"),
    ("22:60-23:00", "'22:60'"),
    ("mon tue 19:00-20:00", "'mon tue 19:00-20:00'"),
])
def test_bad_text_names_the_bad_part(text, names):
    with pytest.raises(ValueError) as info:
        parse_hours(text)
    assert names in str(info.value)


def test_the_setting_checks_its_text_and_the_rules_carry_it():
    s = WorkerSettings(coordinator="http://127.0.0.1:1", run="r", hours="22:00-07:00")
    assert s.rules().hours == parse_hours("22:00-07:00")
    assert WorkerSettings(coordinator="http://127.0.0.1:1", run="r").rules().hours is None
    with pytest.raises(ValueError) as info:
        WorkerSettings(coordinator="http://127.0.0.1:1", run="r", hours="nightly")
    assert "hours:" in describe_errors(info.value) and "'nightly'" in describe_errors(info.value)


def test_the_policy_says_when_training_goes_on():
    rules = Rules(hours=parse_hours("mon-fri 19:00-08:00"))
    v = decide(rules, Conditions(local_time=at(MON, 9)))
    assert (v.train, v.kind) == (False, "hours")
    assert "outside the training hours (mon-fri 19:00-08:00); going on at 19:00" == v.reason
    v = decide(rules, Conditions(local_time=at(SAT, 9)))
    assert v.reason.endswith("going on at Mon 19:00")
    assert decide(rules, Conditions(local_time=at(MON, 20))).train
    assert decide(rules, Conditions(local_time=None)).train  # no clock reading: never a pause
    # a user pause still comes first
    assert decide(rules, Conditions(paused_by_user=True, local_time=at(MON, 9))).kind == "user"


def test_a_round_in_progress_pauses_when_the_hours_end_and_goes_on_when_they_start(tmp_path):
    now = datetime.now().astimezone()
    start = (now + timedelta(seconds=0.3 + (60 - now.second))).replace(second=0, microsecond=0)
    # a window that opens at the next whole minute: outside it now, inside it once the fake clock moves
    text = f"{start:%H:%M}-{(start + timedelta(hours=1)):%H:%M}"
    g = governor(tmp_path, Rules(hours=parse_hours(text)))
    clock = {"now": now}
    g.wall = lambda: clock["now"].astimezone(UTC)
    saves = []
    threading.Timer(0.2, lambda: clock.update(now=start + timedelta(seconds=1))).start()
    assert g.hold(lease_due_in(600), 3, lambda: saves.append(1), threading.Event())
    assert saves == [1]  # saved at the pause, then went on in place when the window opened
    assert g.paused is None
