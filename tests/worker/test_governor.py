"""worker.governor on its own: the step gate's hold limit from the lease's real deadline, and the
wait between rounds (no coordinator, no trainer)."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from worker.control import ControlFile
from worker.governor import Governor
from worker.host import HostMonitor, HostReaders
from worker.policy import Rules
from worker.throttle import DailyTransfer
from tests.worker.test_state import make_lease


def governor(tmp_path, rules: Rules = Rules(), readers: HostReaders | None = None) -> Governor:
    monitor = HostMonitor(rules, readers) if readers is not None else None
    return Governor(rules, control=ControlFile(tmp_path), transfer=DailyTransfer(tmp_path / "transfer.json"),
                    monitor=monitor, check_every_s=0.02)


def lease_due_in(seconds: float, *, naive: bool = False):
    deadline = datetime.now(UTC) + timedelta(seconds=seconds)
    return make_lease().model_copy(update={"deadline": deadline.replace(tzinfo=None) if naive else deadline})


def test_the_gate_goes_on_at_once_when_nothing_holds_it(tmp_path):
    saves = []
    assert governor(tmp_path).hold(lease_due_in(600), 3, lambda: saves.append(1), threading.Event())
    assert saves == []  # nothing saved when there is no pause


@pytest.mark.parametrize("naive", [False, True])
def test_a_paused_round_lets_its_lease_go_after_half_the_time_left(tmp_path, naive):
    g = governor(tmp_path)
    ControlFile(tmp_path).request(paused=True)
    saves = []
    t0 = time.monotonic()
    assert not g.hold(lease_due_in(0.6, naive=naive), 3, lambda: saves.append(1), threading.Event())
    waited = time.monotonic() - t0
    assert saves == [1]  # saved before waiting
    assert 0.25 <= waited < 3.0  # about half of the 0.6 s the lease had left
    assert g.paused is not None and g.paused.kind == "user"  # still paused: now between rounds


def test_a_resume_within_the_limit_goes_on_in_place(tmp_path):
    g = governor(tmp_path)
    control = ControlFile(tmp_path)
    control.request(paused=True)
    threading.Timer(0.2, lambda: control.request(paused=False)).start()
    resumed = []
    g.on_resume = lambda: resumed.append(1)
    assert g.hold(lease_due_in(600), 3, lambda: None, threading.Event())
    assert g.paused is None and resumed == [1]


def test_stop_while_paused_lets_the_round_go(tmp_path):
    g = governor(tmp_path)
    ControlFile(tmp_path).request(paused=True)
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    assert not g.hold(lease_due_in(600), 3, lambda: None, stop)
    assert not g.wait_between_rounds(stop)


def test_between_rounds_the_host_sample_decides(tmp_path):
    host = {"battery": True}
    g = governor(tmp_path, Rules(on_battery="pause"), HostReaders(on_battery=lambda: host["battery"]))
    g.start()
    try:
        threading.Timer(0.2, lambda: host.update(battery=False)).start()
        assert g.wait_between_rounds(threading.Event())
        assert g.paused is None
    finally:
        g.stop()
