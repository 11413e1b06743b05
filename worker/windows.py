"""The Windows host probes: input idle time, battery, and the keep-awake call, over ctypes.

Pure functions turn the structures Windows fills into what the worker uses (tested on any OS);
thin ctypes calls fill them, only on Windows, behind seams (`read_last_input`, `read_power_status`)
that tests replace. ctypes.windll is touched only when a call is made, which only Windows does.

    idle_seconds(tick_ms, last_input_ms)      GetTickCount64 and LASTINPUTINFO.dwTime -> seconds
    power_reading(ac_line, flag, percent)     SYSTEM_POWER_STATUS fields -> PowerReading

Untested on real Windows hardware here: the structures and calls follow Microsoft's documentation
(GetLastInputInfo, GetTickCount64, GetSystemPowerStatus, SetThreadExecutionState).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

TICK_WRAP = 1 << 32  # LASTINPUTINFO.dwTime is GetTickCount's 32-bit value: it wraps every 49.7 days
UNKNOWN = 255  # ACLineStatus, BatteryFlag and BatteryLifePercent's "unknown"
AC_OFFLINE, AC_ONLINE = 0, 1
NO_SYSTEM_BATTERY = 128  # a BatteryFlag bit
CHARGING = 8  # a BatteryFlag bit


def idle_seconds(tick_ms: int, last_input_ms: int) -> float:
    """Seconds since the last input: GetTickCount64()'s milliseconds since boot against dwTime, the
    32-bit tick of the last input. Both are compared modulo 2^32, so a dwTime from before the 32-bit
    counter wrapped (every 49.7 days of uptime) still gives the right, short, answer."""
    return ((tick_ms - last_input_ms) % TICK_WRAP) / 1000.0


@dataclasses.dataclass(frozen=True)
class PowerReading:
    on_battery: bool | None  # None: Windows does not know
    percent: int | None  # charge left, 0..100; None: unknown, or no battery


def power_reading(ac_line_status: int, battery_flag: int, battery_life_percent: int) -> PowerReading:
    """SYSTEM_POWER_STATUS as the policy's reading. On battery when the AC line is offline and a
    system battery is present; a desktop (BatteryFlag 128, no system battery) is never on battery;
    255 in any field is "unknown"."""
    percent = battery_life_percent if 0 <= battery_life_percent <= 100 else None
    if battery_flag != UNKNOWN and battery_flag & NO_SYSTEM_BATTERY:
        return PowerReading(on_battery=False, percent=None)
    if ac_line_status == AC_ONLINE:
        return PowerReading(on_battery=False, percent=percent)
    if ac_line_status == AC_OFFLINE:
        return PowerReading(on_battery=True, percent=percent)
    return PowerReading(on_battery=None, percent=percent)  # UNKNOWN, or a value Windows does not document


# -- the calls (Windows only) ----------------------------------------------------------------------

class LASTINPUTINFO(ctypes.Structure):
    _fields_ = [("cbSize", ctypes.c_uint32), ("dwTime", ctypes.c_uint32)]  # UINT, DWORD


class SYSTEM_POWER_STATUS(ctypes.Structure):
    _fields_ = [("ACLineStatus", ctypes.c_ubyte), ("BatteryFlag", ctypes.c_ubyte),
                ("BatteryLifePercent", ctypes.c_ubyte), ("SystemStatusFlag", ctypes.c_ubyte),
                ("BatteryLifeTime", ctypes.c_uint32), ("BatteryFullLifeTime", ctypes.c_uint32)]  # BYTE x4, DWORD x2


def _kernel32():
    return ctypes.windll.kernel32  # type: ignore[attr-defined]  # only on Windows


def read_last_input() -> tuple[int, int] | None:
    """(GetTickCount64(), LASTINPUTINFO.dwTime), or None when the call fails."""
    try:
        info = LASTINPUTINFO(cbSize=ctypes.sizeof(LASTINPUTINFO))
        if not ctypes.windll.user32.GetLastInputInfo(ctypes.byref(info)):  # type: ignore[attr-defined]
            return None
        kernel32 = _kernel32()
        kernel32.GetTickCount64.restype = ctypes.c_ulonglong
        return int(kernel32.GetTickCount64()), int(info.dwTime)
    except (AttributeError, OSError) as exc:
        log.debug("GetLastInputInfo failed: %s", exc)
        return None


def read_power_status() -> tuple[int, int, int] | None:
    """(ACLineStatus, BatteryFlag, BatteryLifePercent), or None when the call fails."""
    try:
        status = SYSTEM_POWER_STATUS()
        if not _kernel32().GetSystemPowerStatus(ctypes.byref(status)):
            return None
        return status.ACLineStatus, status.BatteryFlag, status.BatteryLifePercent
    except (AttributeError, OSError) as exc:
        log.debug("GetSystemPowerStatus failed: %s", exc)
        return None


def set_thread_execution_state(flags: int) -> int:
    """SetThreadExecutionState(flags): the previous state, 0 when it failed (or off Windows)."""
    try:
        kernel32 = _kernel32()
        kernel32.SetThreadExecutionState.restype = ctypes.c_uint
        return int(kernel32.SetThreadExecutionState(ctypes.c_uint(flags)))
    except (AttributeError, OSError) as exc:
        log.debug("SetThreadExecutionState failed: %s", exc)
        return 0


# -- readers for worker/host.py --------------------------------------------------------------------

def user_idle_reader(read: Callable[[], tuple[int, int] | None] | None = None) -> Callable[[], float | None]:
    """Seconds since the last input, from `read` (default: the GetLastInputInfo call)."""
    def reader() -> float | None:
        raw = (read or read_last_input)()
        return idle_seconds(*raw) if raw is not None else None

    return reader


def battery_reader(read: Callable[[], tuple[int, int, int] | None] | None = None) -> Callable[[], bool | None]:
    """On battery or not, from `read` (default: the GetSystemPowerStatus call)."""
    def reader() -> bool | None:
        raw = (read or read_power_status)()
        return power_reading(*raw).on_battery if raw is not None else None

    return reader
