"""What the host machine is doing: input idle time, battery, other processes' CPU load.

Parsers are pure functions over the text a probe prints or a file holds (tested against
captured samples); readers (HostReaders) fetch that text, and tests replace them with fakes;
HostMonitor turns readings into worker/policy.py's Conditions, keeping the one piece of history
the CPU-load fallback needs (when other processes were last busy).

Where each reading comes from:

    input idle time  macOS: `ioreg -c IOHIDSystem` (HIDIdleTime, ns). Linux: `xprintidle` under X11
                     (ms); on GNOME Wayland the Mutter idle monitor over `gdbus` (ms); with no
                     graphical session at all (a console or ssh-only box), the newest access time
                     of the terminal devices, as `w` reads it. A desktop session the worker cannot
                     ask (no DISPLAY in a systemd service, a Wayland compositor other than GNOME)
                     gives None, and the policy falls back on CPU load. Windows: GetLastInputInfo
                     against GetTickCount64 (worker/windows.py, ctypes).
    battery          Linux: /sys/class/power_supply/*/{type,online,status,scope}; macOS: `pmset -g batt`;
                     Windows: GetSystemPowerStatus.
    CPU load         Linux: /proc/stat between two samples, less this process's own CPU time
                     (os.times), so the worker's training does not count as the machine being busy.
                     Elsewhere: os.getloadavg()'s 1-minute average per CPU, less this process's share.
                     Windows has neither: no CPU-load fallback there (GetLastInputInfo is read instead).

Every probe is bounded (2 s per command) and any failure reads as "cannot tell" (None).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from worker.policy import Conditions, Rules

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0


# -- parsers (pure) ---------------------------------------------------------------------------------

def parse_ioreg_idle_s(text: str) -> float | None:
    """`ioreg -c IOHIDSystem`: the first `"HIDIdleTime" = <ns>` in seconds."""
    m = re.search(r'"HIDIdleTime"\s*=\s*(\d+)', text)
    return int(m.group(1)) / 1e9 if m else None


def parse_xprintidle_s(text: str) -> float | None:
    """`xprintidle` prints milliseconds since the last input."""
    text = text.strip()
    return int(text) / 1000 if text.isdigit() else None


def parse_mutter_idle_s(text: str) -> float | None:
    """GNOME's org.gnome.Mutter.IdleMonitor.GetIdletime over gdbus: `(uint64 12345,)`, milliseconds."""
    m = re.search(r"\(\s*(?:uint64\s+)?(\d+)\s*,?\s*\)", text)
    return int(m.group(1)) / 1000 if m else None


def tty_idle_s(atimes: Iterable[float], now: float) -> float | None:
    """Seconds since the newest access of any terminal device (typing updates it): what `w` shows."""
    newest = max(atimes, default=None)
    return None if newest is None else max(0.0, now - newest)


def parse_pmset_on_battery(text: str) -> bool | None:
    """`pmset -g batt`: "Now drawing from 'Battery Power'" or "'AC Power'" (a Mac Mini says AC)."""
    m = re.search(r"drawing from '([^']+)'", text)
    if not m:
        return None
    return m.group(1).strip().lower().startswith("battery")


_MAINS_TYPES = {"mains", "usb", "usb_c", "usb_pd", "usb_pd_drp", "usb_aca", "usb_cdp", "usb_dcp", "wireless"}


def sysfs_on_battery(supplies: Mapping[str, Mapping[str, str]]) -> bool | None:
    """/sys/class/power_supply as {supply: {file: content}}: on battery when a system battery is
    present and no mains/USB supply is online (or, with no such supply listed, the battery says
    Discharging). A desktop without a battery is never on battery. Peripherals' batteries (a
    mouse's: scope=Device) do not count."""
    batteries, mains = [], []
    for files in supplies.values():
        kind = files.get("type", "").strip().lower()
        if kind == "battery" and files.get("scope", "").strip().lower() != "device":
            batteries.append(files)
        elif kind in _MAINS_TYPES and "online" in files:
            mains.append(files)
    if any(f.get("online", "").strip() == "1" for f in mains):
        return False
    if not batteries:
        return False if mains else None
    if mains:
        return True
    return any(f.get("status", "").strip().lower() == "discharging" for f in batteries)


def parse_proc_stat(text: str) -> tuple[int, int] | None:
    """The aggregate `cpu` line of /proc/stat as (busy ticks, total ticks), all CPUs together.
    Busy: user nice system irq softirq steal (guest time is inside user already); idle and iowait
    are not."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            try:
                v = [int(x) for x in line.split()[1:]]
            except ValueError:
                return None
            if len(v) < 4:
                return None
            v += [0] * (8 - len(v))
            user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
            busy = user + nice + system + irq + softirq + steal
            return busy, busy + idle + iowait
    return None


@dataclasses.dataclass(frozen=True)
class CpuSample:
    busy_ticks: int
    total_ticks: int
    own_cpu_s: float  # this process's user + system CPU seconds, all its threads


def others_cpu_share(prev: CpuSample, cur: CpuSample, *, ticks_per_s: float) -> float | None:
    """The share of all CPUs other processes used between two samples, 0..1 (this process's own
    CPU time taken out)."""
    total = cur.total_ticks - prev.total_ticks
    if total <= 0:
        return None
    busy = cur.busy_ticks - prev.busy_ticks
    own = (cur.own_cpu_s - prev.own_cpu_s) * ticks_per_s
    return min(1.0, max(0.0, (busy - own) / total))


def others_share_from_loadavg(load1: float, n_cpus: int, own_share: float) -> float:
    """Where there is no /proc/stat: the 1-minute load average per CPU, less this process's share
    of the CPUs (a rough figure: the load average lags a minute and counts waiting threads)."""
    return min(1.0, max(0.0, load1 / max(1, n_cpus) - own_share))


# -- readers (I/O) ----------------------------------------------------------------------------------

def run_probe(argv: list[str], *, env: Mapping[str, str] | None = None) -> str | None:
    """A probe command's stdout, or None (missing, failed, or slower than PROBE_TIMEOUT_S)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              env=dict(env) if env is not None else None)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def read_power_supplies(root: str = "/sys/class/power_supply") -> dict[str, dict[str, str]]:
    supplies: dict[str, dict[str, str]] = {}
    for folder in sorted(glob.glob(os.path.join(root, "*"))):
        files = {}
        for name in ("type", "online", "status", "scope"):
            text = _read_text(os.path.join(folder, name))
            if text is not None:
                files[name] = text.strip()
        supplies[os.path.basename(folder)] = files
    return supplies


def _graphical_session() -> bool:
    """An X server or a Wayland compositor runs on this machine (for anyone)."""
    return bool(glob.glob("/tmp/.X11-unix/X*") or glob.glob("/run/user/*/wayland-*"))


def _tty_atimes() -> list[float]:
    times = []
    for path in glob.glob("/dev/pts/[0-9]*") + glob.glob("/dev/tty[0-9]*"):
        try:
            times.append(os.stat(path).st_atime)
        except OSError:
            pass
    return times


@dataclasses.dataclass
class HostReaders:
    """Where HostMonitor gets its raw readings. Each returns None when it cannot tell."""

    user_idle_s: Callable[[], float | None] = lambda: None
    on_battery: Callable[[], bool | None] = lambda: None
    proc_stat: Callable[[], str | None] = lambda: None  # the text of /proc/stat
    loadavg: Callable[[], float | None] = lambda: None  # 1-minute load average, where there is no /proc/stat
    own_cpu_s: Callable[[], float] = _own_cpu_s
    n_cpus: int = 1
    ticks_per_s: float = 100.0

    @property
    def has_load(self) -> bool:
        return self.proc_stat() is not None or self.loadavg() is not None


def linux_user_idle(environ: Mapping[str, str]) -> Callable[[], float | None]:
    def read() -> float | None:
        if environ.get("DISPLAY") and shutil.which("xprintidle"):
            text = run_probe(["xprintidle"], env=environ)
            if text is not None and (v := parse_xprintidle_s(text)) is not None:
                return v
        if environ.get("WAYLAND_DISPLAY") and shutil.which("gdbus"):
            text = run_probe(["gdbus", "call", "--session", "--dest", "org.gnome.Mutter.IdleMonitor",
                              "--object-path", "/org/gnome/Mutter/IdleMonitor/Core",
                              "--method", "org.gnome.Mutter.IdleMonitor.GetIdletime"], env=environ)
            if text is not None and (v := parse_mutter_idle_s(text)) is not None:
                return v
        if _graphical_session():
            return None  # someone may be at a desktop the worker cannot ask: the terminals say nothing of it
        return tty_idle_s(_tty_atimes(), time.time())

    return read


def system_readers(*, platform: str | None = None, environ: Mapping[str, str] | None = None) -> HostReaders:
    """Readers for the machine this process runs on."""
    platform = platform or sys.platform
    environ = os.environ if environ is None else environ
    readers = HostReaders(n_cpus=os.cpu_count() or 1)
    if hasattr(os, "getloadavg"):
        readers.loadavg = lambda: os.getloadavg()[0]
    if platform.startswith("linux"):
        readers.user_idle_s = linux_user_idle(environ)
        readers.on_battery = lambda: sysfs_on_battery(read_power_supplies())
        readers.proc_stat = lambda: _read_text("/proc/stat")
        try:
            readers.ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
        except (ValueError, OSError, AttributeError):
            pass
    elif platform == "darwin":
        def idle() -> float | None:
            text = run_probe(["ioreg", "-c", "IOHIDSystem"])
            return parse_ioreg_idle_s(text) if text is not None else None

        def battery() -> bool | None:
            text = run_probe(["pmset", "-g", "batt"])
            return parse_pmset_on_battery(text) if text is not None else None

        readers.user_idle_s, readers.on_battery = idle, battery
    elif platform == "win32":
        from worker import windows

        readers.user_idle_s, readers.on_battery = windows.user_idle_reader(), windows.battery_reader()
    return readers


# -- the monitor ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HostReading:
    user_idle_s: float | None = None
    other_load: float | None = None
    load_quiet_s: float | None = None
    on_battery: bool | None = None

    def conditions(self, **more) -> Conditions:
        return Conditions(user_idle_s=self.user_idle_s, other_load=self.other_load, load_quiet_s=self.load_quiet_s,
                          on_battery=self.on_battery, **more)


class HostMonitor:
    """Reads the host for the rules in force: nothing at all with --when always and --on-battery
    run. Not thread-safe: one thread samples (the governor's)."""

    def __init__(self, rules: Rules, readers: HostReaders, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rules = rules
        self.readers = readers
        self.clock = clock
        self.need_idle = rules.when == "idle"
        self.need_battery = rules.on_battery == "pause"
        self._has_load = self.need_idle and readers.has_load
        # Load history starts now: a machine is taken as busy until it has been quiet for idle_s.
        self._last_busy = clock()
        self._prev_cpu: CpuSample | None = None
        self._prev_own: tuple[float, float] | None = None  # (monotonic time, own CPU s) for the loadavg path

    @property
    def needed(self) -> bool:
        return self.need_idle or self.need_battery

    def _other_load(self, now: float) -> float | None:
        r = self.readers
        own = r.own_cpu_s()
        text = r.proc_stat()
        parsed = parse_proc_stat(text) if text else None
        if parsed is not None:
            cur = CpuSample(parsed[0], parsed[1], own)
            prev, self._prev_cpu = self._prev_cpu, cur
            return None if prev is None else others_cpu_share(prev, cur, ticks_per_s=r.ticks_per_s)
        load1 = r.loadavg()
        prev_own, self._prev_own = self._prev_own, (now, own)
        if load1 is None or prev_own is None or now <= prev_own[0]:
            return None
        own_share = (own - prev_own[1]) / ((now - prev_own[0]) * max(1, r.n_cpus))
        return others_share_from_loadavg(load1, r.n_cpus, own_share)

    def read(self) -> HostReading:
        now = self.clock()
        idle = load = quiet = None
        if self.need_idle:
            idle = self.readers.user_idle_s()
            if self._has_load:  # sampled every time, so the fallback has its history when it is needed
                load = self._other_load(now)
                if load is not None and load > self.rules.max_other_load:
                    self._last_busy = now
                quiet = now - self._last_busy
        battery = self.readers.on_battery() if self.need_battery else None
        return HostReading(user_idle_s=idle, other_load=load, load_quiet_s=None if idle is not None else quiet,
                           on_battery=battery)
