"""LeaseKeeper: renews a lease at two thirds of its time while the round moves; lets it run out
when the round is stuck or paused; stops on a refusal; retries network errors."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import httpx

from worker.client import CoordinatorError
from worker.lease_keeper import LeaseKeeper

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def make(renew, *, step=lambda: 0):
    clock = Clock()
    keeper = LeaseKeeper(7, T0 + timedelta(seconds=90), renew=renew, progress=step, clock=clock)
    return keeper, clock


def test_renews_at_two_thirds_only_while_the_round_moves():
    calls, steps = [], [0]

    def renew(lease_id, step):
        calls.append((lease_id, step, clock.now))
        return clock.now + timedelta(seconds=90)

    keeper, clock = make(renew, step=lambda: steps[0])
    assert keeper.ttl_s == 90 and keeper.next_wait_s() == 60
    clock.now = T0 + timedelta(seconds=59)
    steps[0] = 5
    assert keeper.tick() and calls == []  # not due yet
    clock.now = T0 + timedelta(seconds=61)
    assert keeper.tick() and calls == [(7, 5, clock.now)]  # it tells the coordinator the step it reached
    assert keeper.deadline == T0 + timedelta(seconds=151) and keeper.renewals == 1
    clock.now = T0 + timedelta(seconds=125)  # due again, but the round has not moved: let it run out
    assert not keeper.tick() and keeper.stopped_because == "no progress since the last renewal"
    assert len(calls) == 1


def test_a_refusal_ends_it_and_network_errors_are_retried():
    attempts = []

    def flaky(lease_id, step):
        attempts.append(lease_id)
        if len(attempts) == 1:
            raise httpx.ConnectError("down")
        raise CoordinatorError(410, "lease 7 is expired; it can no longer be renewed")

    steps = iter(range(1, 100))
    keeper, clock = make(flaky, step=lambda: next(steps))
    clock.now = T0 + timedelta(seconds=80)
    assert keeper.tick()  # the network: try again at the next tick
    assert not keeper.tick() and keeper.stopped_because == "refused (410)"
    assert attempts == [7, 7]


def test_the_thread_renews_in_real_time():
    renewed = []
    step = [0]

    def renew(lease_id, step):
        renewed.append(lease_id)
        return datetime.now(timezone.utc) + timedelta(seconds=1.5)

    keeper = LeaseKeeper(3, datetime.now(timezone.utc) + timedelta(seconds=1.5), renew=renew,
                         progress=lambda: step[0], min_wait_s=0.05)
    with keeper:
        for i in range(30):  # 1.5 s of "training"
            step[0] = i + 1
            time.sleep(0.05)
    assert renewed and set(renewed) == {3}


def test_a_lifetime_or_no_progress_refusal_ends_it():
    """The coordinator answers 409 once the lease lived its lifetime (or saw no progress), 422 to a
    step it cannot take: the keeper stops asking (the round still delivers by the deadline)."""
    for status in (409, 422):
        def refuse(lease_id, step):
            raise CoordinatorError(status, "lease 7 has lived its lifetime and is not renewed again")

        steps = iter(range(1, 100))
        keeper, clock = make(refuse, step=lambda: next(steps))
        clock.now = T0 + timedelta(seconds=80)
        assert not keeper.tick() and keeper.stopped_because == f"refused ({status})"
