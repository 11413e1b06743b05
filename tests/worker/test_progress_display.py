"""worker.progress: the live numbers (fake clock), plain log lines off a terminal, the rich panel
on one."""

from __future__ import annotations

import io
import logging

import pytest

from shared import protocol
from worker.control import WorkerStatus
from worker.progress import PlainDisplay, Progress, RichDisplay, describe, make_display


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def lease(algorithm: str = "diloco", steps: int = 100) -> protocol.Lease:
    return protocol.Lease.model_validate({
        "lease_id": 7, "run": "t", "shard_id": 2, "shard_sha256": "ab" * 32, "base_version": 3, "seed": 1,
        "lr": 1e-3, "inner": {"steps": steps, "batch_size": 4}, "compression": {}, "model": {},
        "deadline": "2030-01-01T00:00:00Z", "algorithm": algorithm, "sparta": {"every": 10}})


def test_tokens_per_second_and_next_sync():
    clock = Clock()
    p = Progress(clock=clock)
    p.start_round(lease(), context=32)
    assert p.steps_per_s() is None and p.next_sync() == (100, None)
    for step in range(1, 11):
        clock.t += 0.5
        p.on_step(step, 3.0 - step / 10)
    assert p.steps_per_s() == pytest.approx(2.0)
    assert p.tokens_per_s() == pytest.approx(2.0 * 4 * 32)
    assert p.next_sync() == (100, pytest.approx(45.0))  # 90 steps to the upload at 2 steps/s
    assert p.loss == pytest.approx(2.0)
    # a pause is not training time
    clock.t += 600
    p.restart_clock()
    clock.t += 1.0
    p.on_step(11, 1.9)
    assert p.steps_per_s() == pytest.approx(1.0)


def test_sparta_syncs_at_the_next_exchange():
    clock = Clock()
    p = Progress(clock=clock)
    p.start_round(lease("sparta", steps=100), context=32, step=40)
    clock.t += 1
    p.on_step(41, 2.0)
    assert p.next_sync() == (50, pytest.approx(9.0))
    p.end_round()
    assert p.next_sync() is None


def status(**over) -> WorkerStatus:
    base = dict(pid=1, coordinator="http://c", run="t", state="training", device="cpu", lease=7, step=40, steps=100,
                loss=2.3141, tokens_per_s=1234.4, next_sync_in_s=150, rounds=2, bytes_sent=1_200_000,
                bytes_received=33_000_000, transfer_today_bytes=34_200_000, transfer_cap_bytes=100_000_000)
    base.update(over)
    return WorkerStatus(**base)


def test_describe_is_one_line_with_the_numbers():
    line = describe(status())
    assert line == ("training | lease 7 step 40/100 | local loss 2.314 | 1,234 tok/s | sent 1.2 MB, received 33.0 MB | "
                    "today 34.2 MB of 100.0 MB | next sync in ~2.5 min")
    paused = describe(status(state="paused", reason="on battery power", tokens_per_s=None, next_sync_in_s=None,
                             transfer_cap_bytes=None))
    assert paused == "paused: on battery power | lease 7 step 40/100 | local loss 2.314 | sent 1.2 MB, received 33.0 MB"


def test_plain_lines_at_changes_and_every_so_often(caplog):
    clock = Clock()
    current = [status()]
    display = PlainDisplay(every_s=30, clock=clock)
    display.start(lambda: current[0])
    with caplog.at_level(logging.INFO, logger="worker.progress"):
        display.tick()  # the first state: a line
        clock.t += 10
        current[0] = status(step=50)
        display.tick()  # nothing new, too soon
        clock.t += 25
        display.tick()  # 35 s since the last line
        current[0] = status(state="paused", reason="the machine is in use (last input 3 s ago)",
                            pause_kind="active")
        display.tick()  # paused: at once
        current[0] = status(state="paused", reason="the machine is in use (last input 5 s ago)",
                            pause_kind="active")
        clock.t += 100
        display.tick()  # still paused for the same reason: no line, however long
        current[0] = status(step=51)
        display.tick()  # going on: at once
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4
    assert lines[0].startswith("training | lease 7 step 40/100") and "step 50/100" in lines[1]
    assert lines[2].startswith("paused: the machine is in use") and "step 51/100" in lines[3]


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_make_display_picks_by_terminal():
    assert isinstance(make_display(io.StringIO()), PlainDisplay)
    assert isinstance(make_display(Tty()), RichDisplay)


def test_the_rich_panel_shows_the_round_and_the_pause():
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, width=140, color_system=None)
    console.print(RichDisplay.render(status()))
    console.print(RichDisplay.render(status(state="paused", reason="on battery power")))
    text = out.getvalue()
    for word in ("run t", "lease 7", "step 40/100", "local loss 2.314", "1,234 tok/s", "next sync in ~2.5 min",
                 "sent 1.2 MB", "today 34.2 MB of 100.0 MB", "paused", "on battery power"):
        assert word in text


def test_the_rich_panel_starts_and_stops_cleanly():
    stream = Tty()
    display = RichDisplay(stream, refresh_per_second=20)
    handler = logging.StreamHandler(stream)
    display.start(lambda: status())
    display.tick()
    display.stop()
    assert "step 40/100" in stream.getvalue()
    assert handler.stream is stream
