"""worker.host: each probe's parser against captured outputs, and HostMonitor over fake readers
(no real hardware: this sandbox has no macOS, no X server and no battery)."""

from __future__ import annotations

import pytest

from worker import host as host_mod
from worker.host import (
    CpuSample,
    HostMonitor,
    HostReaders,
    linux_user_idle,
    others_cpu_share,
    others_share_from_loadavg,
    parse_ioreg_idle_s,
    parse_mutter_idle_s,
    parse_pmset_on_battery,
    parse_proc_stat,
    parse_xprintidle_s,
    read_power_supplies,
    sysfs_on_battery,
    system_readers,
    tty_idle_s,
)
from worker.policy import Rules, decide

IOREG = """\
+-o Root  <class IORegistryEntry, id 0x100000100, retain 20>
  +-o Mac14,3  <class IOPlatformExpertDevice, id 0x100000210, registered, matched, active, busy 0 (97 ms), retain 39>
    +-o IOResources  <class IOResources, id 0x100000109, registered, matched, active, busy 0 (0 ms), retain 77>
      +-o IOHIDSystem  <class IOHIDSystem, id 0x1000004a1, registered, matched, active, busy 0 (0 ms), retain 23>
        | {
        |   "IOClass" = "IOHIDSystem"
        |   "CFBundleIdentifier" = "com.apple.iokit.IOHIDFamily"
        |   "HIDParameters" = {"HIDClickTime"=500000000,"HIDClickSpace"={5,3},"HIDKeyRepeat"=83333333}
        |   "IOProviderClass" = "IOResources"
        |   "HIDIdleTime" = 4256842135
        |   "IOMatchCategory" = "IOHID"
        | }
        |
"""

PMSET_BATTERY = """\
Now drawing from 'Battery Power'
 -InternalBattery-0 (id=4653155)\t87%; discharging; 5:12 remaining present: true
"""
PMSET_CHARGING = """\
Now drawing from 'AC Power'
 -InternalBattery-0 (id=4653155)\t64%; charging; 1:05 remaining present: true
"""
PMSET_MAC_MINI = "Now drawing from 'AC Power'\n"

PROC_STAT = """\
cpu  10132153 290696 3084719 46828483 16683 0 25195 0 175628 0
cpu0 1393280 32966 572056 13343292 6130 0 17875 0 23933 0
cpu1 1335998 30134 433926 13400510 2355 0 3009 0 19815 0
intr 1462898 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
ctxt 1099813584
btime 1700000000
processes 1001263
procs_running 2
procs_blocked 0
"""


def test_ioreg_hid_idle_time_is_nanoseconds():
    assert parse_ioreg_idle_s(IOREG) == pytest.approx(4.256842135)
    assert parse_ioreg_idle_s("+-o Root <class IORegistryEntry>\n") is None


@pytest.mark.parametrize("text, idle", [("12345\n", 12.345), ("0", 0.0), ("", None),
                                        ("couldn't open display\n", None)])
def test_xprintidle_is_milliseconds(text, idle):
    assert parse_xprintidle_s(text) == idle


@pytest.mark.parametrize("text, idle", [("(uint64 73422,)\n", 73.422), ("(73422,)", 73.422), ("()", None),
                                        ("Error: GDBus.Error:org.freedesktop.DBus.Error.ServiceUnknown", None)])
def test_mutter_idle_monitor(text, idle):
    assert parse_mutter_idle_s(text) == idle


def test_tty_idle_is_the_newest_access():
    assert tty_idle_s([100.0, 950.0, 400.0], now=1000.0) == 50.0
    assert tty_idle_s([], now=1000.0) is None
    assert tty_idle_s([1010.0], now=1000.0) == 0.0  # a clock step backwards is not negative idle time


@pytest.mark.parametrize("text, on_battery", [(PMSET_BATTERY, True), (PMSET_CHARGING, False),
                                              (PMSET_MAC_MINI, False), ("", None)])
def test_pmset(text, on_battery):
    assert parse_pmset_on_battery(text) is on_battery


LAPTOP_UNPLUGGED = {"AC": {"type": "Mains", "online": "0"},
                    "BAT0": {"type": "Battery", "status": "Discharging", "scope": ""}}
LAPTOP_PLUGGED = {"ADP1": {"type": "Mains", "online": "1"},
                  "BAT0": {"type": "Battery", "status": "Charging"}}
USB_C_PLUGGED = {"ucsi-source-psy-USBC000:001": {"type": "USB", "online": "1"},
                 "BAT1": {"type": "Battery", "status": "Not charging"}}


@pytest.mark.parametrize("supplies, on_battery", [
    (LAPTOP_UNPLUGGED, True),
    (LAPTOP_PLUGGED, False),
    (USB_C_PLUGGED, False),
    ({"BAT0": {"type": "Battery", "status": "Discharging"}}, True),  # no mains listed: the battery tells
    ({"BAT0": {"type": "Battery", "status": "Full"}}, False),
    ({"hidpp_battery_0": {"type": "Battery", "status": "Discharging", "scope": "Device"}}, None),  # a mouse
    ({"AC": {"type": "Mains", "online": "1"}}, False),  # a desktop that lists its supply
    ({}, None),  # a desktop: nothing to go by
])
def test_sysfs_power_supplies(supplies, on_battery):
    assert sysfs_on_battery(supplies) is on_battery


def test_power_supplies_are_read_from_sysfs_files(tmp_path):
    for name, files in LAPTOP_UNPLUGGED.items():
        (tmp_path / name).mkdir()
        for key, value in files.items():
            (tmp_path / name / key).write_text(value + "\n")
    supplies = read_power_supplies(str(tmp_path))
    assert supplies["AC"] == {"type": "Mains", "online": "0"}
    assert sysfs_on_battery(supplies) is True
    assert read_power_supplies(str(tmp_path / "absent")) == {}


def test_proc_stat_busy_and_total():
    busy, total = parse_proc_stat(PROC_STAT)
    assert busy == 10132153 + 290696 + 3084719 + 0 + 25195 + 0
    assert total == busy + 46828483 + 16683
    assert parse_proc_stat("intr 1 2 3\n") is None
    assert parse_proc_stat("cpu  x y z\n") is None


def test_others_cpu_share_leaves_this_process_out():
    prev = CpuSample(busy_ticks=1000, total_ticks=10_000, own_cpu_s=5.0)
    # 200 s of wall time on 2 CPUs at 100 ticks/s: 40,000 ticks, 36,000 busy, 170 s of them ours
    cur = CpuSample(busy_ticks=37_000, total_ticks=50_000, own_cpu_s=175.0)
    assert others_cpu_share(prev, cur, ticks_per_s=100) == pytest.approx((36_000 - 17_000) / 40_000)
    same = CpuSample(busy_ticks=37_000, total_ticks=50_000, own_cpu_s=175.0)
    assert others_cpu_share(cur, same, ticks_per_s=100) is None  # no time passed
    mostly_ours = CpuSample(busy_ticks=37_000, total_ticks=50_000, own_cpu_s=400.0)  # rounding: never below 0
    assert others_cpu_share(prev, mostly_ours, ticks_per_s=100) == 0.0


def test_others_share_from_loadavg():
    assert others_share_from_loadavg(1.5, 2, own_share=0.5) == pytest.approx(0.25)
    assert others_share_from_loadavg(0.2, 4, own_share=0.9) == 0.0
    assert others_share_from_loadavg(16.0, 4, own_share=0.0) == 1.0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def proc_stat(busy: int, total: int) -> str:
    return f"cpu  {busy} 0 0 {total - busy} 0 0 0 0 0 0\n"


def test_load_fallback_needs_idle_minutes_of_quiet():
    """No input idle time to go by: busy until other processes have kept below max_other_load for
    idle_s, counting from the worker's start; the worker's own CPU time does not count."""
    rules = Rules(when="idle", idle_s=300, max_other_load=0.3)
    clock = Clock()
    # the first sample is the constructor's look for a load source
    samples = iter([proc_stat(0, 0), proc_stat(0, 0), proc_stat(9_000, 12_000), proc_stat(9_600, 24_000),
                    proc_stat(30_000, 60_000)])
    own = iter([0.0, 0.0, 0.0, 180.0])
    readers = HostReaders(user_idle_s=lambda: None, proc_stat=lambda: next(samples), own_cpu_s=lambda: next(own),
                          n_cpus=2, ticks_per_s=100)
    monitor = HostMonitor(rules, readers, clock=clock)
    r = monitor.read()  # t=0: the first sample has nothing to compare with
    assert r.user_idle_s is None and r.other_load is None and r.load_quiet_s == 0
    assert decide(rules, r.conditions()).kind == "busy"
    clock.t = 60.0
    r = monitor.read()  # 75% of the CPUs busy, none of it ours: busy now
    assert r.other_load == pytest.approx(0.75) and r.load_quiet_s == 0
    clock.t = 120.0
    r = monitor.read()  # 5%: quiet for 60 s so far
    assert r.other_load == pytest.approx(0.05) and r.load_quiet_s == 60
    assert decide(rules, r.conditions()).kind == "busy"
    clock.t = 420.0
    r = monitor.read()  # 20,400 of 36,000 ticks busy, 18,000 of them this process's: others 6.7%
    assert r.other_load == pytest.approx(2_400 / 36_000) and r.load_quiet_s == 360
    assert decide(rules, r.conditions()).train


def test_input_idle_time_when_there_is_one():
    rules = Rules(when="idle", idle_s=300, on_battery="pause")
    readers = HostReaders(user_idle_s=lambda: 12.0, on_battery=lambda: False, proc_stat=lambda: proc_stat(1, 2))
    r = HostMonitor(rules, readers).read()
    assert (r.user_idle_s, r.load_quiet_s, r.on_battery) == (12.0, None, False)
    assert decide(rules, r.conditions()).kind == "active"


def test_loadavg_fallback_takes_this_process_share_out():
    rules = Rules(when="idle", idle_s=60, max_other_load=0.3)
    clock = Clock()
    own = iter([0.0, 60.0])
    readers = HostReaders(loadavg=lambda: 1.5, own_cpu_s=lambda: next(own), n_cpus=2)
    monitor = HostMonitor(rules, readers, clock=clock)
    assert monitor.read().other_load is None
    clock.t = 60.0  # 60 CPU-seconds of ours in 60 s on 2 CPUs: half the machine; load 1.5/2 - 0.5 = 0.25
    assert monitor.read().other_load == pytest.approx(0.25)


def test_nothing_is_probed_with_when_always_and_battery_run():
    def boom():
        raise AssertionError("probed")

    readers = HostReaders(user_idle_s=boom, on_battery=boom, proc_stat=boom, loadavg=boom)
    monitor = HostMonitor(Rules(when="always", on_battery="run"), readers)
    assert not monitor.needed
    assert monitor.read().conditions().user_idle_s is None


def test_linux_user_idle_sources_in_order(monkeypatch):
    calls = []

    def probe(argv, env=None):
        calls.append(argv[0])
        return {"xprintidle": "bad\n", "gdbus": "(uint64 5000,)\n"}[argv[0]]

    monkeypatch.setattr(host_mod, "run_probe", probe)
    monkeypatch.setattr(host_mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(host_mod, "_graphical_session", lambda: True)
    monkeypatch.setattr(host_mod, "_tty_atimes", lambda: [0.0])
    # X11 unparseable -> the Wayland idle monitor answers
    assert linux_user_idle({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"})() == 5.0
    assert calls == ["xprintidle", "gdbus"]
    # a desktop session the worker cannot ask: unknown (the load fallback decides), not the terminals' idea
    assert linux_user_idle({})() is None
    # no graphical session at all: the terminals' last access
    monkeypatch.setattr(host_mod, "_graphical_session", lambda: False)
    monkeypatch.setattr(host_mod.time, "time", lambda: 100.0)
    monkeypatch.setattr(host_mod, "_tty_atimes", lambda: [40.0, 70.0])
    assert linux_user_idle({})() == 30.0


def test_macos_readers_run_ioreg_and_pmset(monkeypatch):
    outputs = {"ioreg": IOREG, "pmset": PMSET_BATTERY}
    monkeypatch.setattr(host_mod, "run_probe", lambda argv, env=None: outputs[argv[0]])
    readers = system_readers(platform="darwin", environ={})
    assert readers.user_idle_s() == pytest.approx(4.256842135)
    assert readers.on_battery() is True
    outputs["ioreg"] = None  # the command failed
    assert readers.user_idle_s() is None


def test_run_probe_failures_read_as_unknown():
    assert host_mod.run_probe(["/nonexistent/idletrain-probe"]) is None
    assert host_mod.run_probe(["false"]) is None
    assert host_mod.run_probe(["echo", "12"]) == "12\n"
