"""The Windows probes through their pure parts (worker/windows.py): idle time from the tick counts,
with the 32-bit wrap, and the battery from SYSTEM_POWER_STATUS with its 255 "unknown"s; the
ctypes calls are replaced at their seams, so this runs on any OS."""

from __future__ import annotations

import pytest

from worker import windows
from worker.host import system_readers
from worker.windows import PowerReading, battery_reader, idle_seconds, power_reading, user_idle_reader


def test_idle_time_is_the_tick_difference_in_seconds():
    assert idle_seconds(tick_ms=90_000, last_input_ms=30_000) == 60.0
    assert idle_seconds(tick_ms=5_000, last_input_ms=5_000) == 0.0


def test_idle_time_survives_the_32_bit_wrap_of_the_last_input_tick():
    # 60 days of uptime: GetTickCount64 is past 2^32 ms, dwTime holds only its low 32 bits
    tick = 60 * 86_400_000
    last_input = (tick - 12_345) % (1 << 32)
    assert last_input < tick and idle_seconds(tick, last_input) == 12.345
    # the input came just before the 32-bit counter wrapped, the reading just after it
    assert idle_seconds(tick_ms=(1 << 32) + 1_000, last_input_ms=(1 << 32) - 2_000) == 3.0


@pytest.mark.parametrize("ac, flag, percent, expected", [
    (0, 2, 40, PowerReading(True, 40)),  # unplugged laptop, low
    (1, 8, 80, PowerReading(False, 80)),  # plugged in, charging
    (1, 128, 255, PowerReading(False, None)),  # a desktop: no system battery
    (0, 128, 255, PowerReading(False, None)),  # no battery can never be "on battery"
    (255, 255, 255, PowerReading(None, None)),  # Windows knows nothing
    (255, 1, 90, PowerReading(None, 90)),  # line status unknown
    (0, 255, 255, PowerReading(True, None)),  # offline line, battery state unknown
    (7, 0, 50, PowerReading(None, 50)),  # an undocumented line status: cannot tell
])
def test_power_status_fields_read_as_on_battery_and_percent(ac, flag, percent, expected):
    assert power_reading(ac, flag, percent) == expected


def test_readers_turn_the_seams_raw_values_into_readings():
    assert user_idle_reader(lambda: (100_000, 40_000))() == 60.0
    assert user_idle_reader(lambda: None)() is None  # the call failed: cannot tell
    assert battery_reader(lambda: (0, 0, 55))() is True
    assert battery_reader(lambda: (1, 0, 55))() is False
    assert battery_reader(lambda: None)() is None


def test_system_readers_use_the_windows_probes_on_windows(monkeypatch):
    monkeypatch.setattr(windows, "read_last_input", lambda: (10_000, 4_000))
    monkeypatch.setattr(windows, "read_power_status", lambda: (0, 1, 70))
    readers = system_readers(platform="win32", environ={})
    assert readers.user_idle_s() == 6.0 and readers.on_battery() is True


def test_the_real_calls_fail_softly_off_windows():
    # no ctypes.windll here: every call reads as "cannot tell", never an exception
    if hasattr(__import__("ctypes"), "windll"):
        pytest.skip("on Windows the calls are real")
    assert windows.read_last_input() is None
    assert windows.read_power_status() is None
    assert windows.set_thread_execution_state(0x80000000) == 0  # ES_CONTINUOUS
