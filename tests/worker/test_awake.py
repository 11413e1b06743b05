"""--keep-awake (worker/awake.py): the platform commands (pure), the context manager with its
process start and Windows call replaced, one warning when nothing can hold the sleep off, and a
real lock process started and stopped around a "round" where the tools exist."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys

import pytest

from worker.awake import ES_CONTINUOUS, ES_SYSTEM_REQUIRED, WHY, KeepAwake, inhibit_command
from worker.control import ControlFile
from worker.governor import Governor
from worker.policy import Rules
from worker.throttle import DailyTransfer


def found(*tools):
    return lambda name: f"/usr/bin/{name}" if name in tools else None


def test_each_platform_has_its_command():
    assert inhibit_command("darwin", pid=42, which=found("caffeinate")) == ["/usr/bin/caffeinate", "-i", "-w", "42"]
    assert inhibit_command("linux", pid=42, which=found("systemd-inhibit", "tail")) == [
        "/usr/bin/systemd-inhibit", "--what=sleep", "--who=idletrain", f"--why={WHY}", "--mode=block",
        "/usr/bin/tail", "--pid=42", "-f", "/dev/null"]
    assert inhibit_command("linux", pid=42, which=found("tail")) is None  # no systemd: nothing to hold it with
    assert inhibit_command("darwin", pid=42, which=found()) is None
    assert inhibit_command("win32", pid=42, which=found("caffeinate")) is None  # a call there, not a command


class FakeProc:
    def __init__(self, *, exits_with: int | None = None):
        self.exits_with, self.terminated = exits_with, False

    def wait(self, timeout=None):
        if self.exits_with is None and not self.terminated:
            raise subprocess.TimeoutExpired("x", timeout)
        return self.exits_with if self.exits_with is not None else -15

    def terminate(self):
        self.terminated = True

    def kill(self):
        self.terminated = True


def test_the_lock_process_runs_only_inside_the_round():
    started, proc = [], FakeProc()
    awake = KeepAwake(True, platform="linux", pid=7, which=found("systemd-inhibit", "tail"),
                      spawn=lambda argv: started.append(argv) or proc)
    with awake:
        assert started and started[0][-3] == "--pid=7" and not proc.terminated
    assert proc.terminated
    with awake:  # the next round starts a new one
        pass
    assert len(started) == 2


def test_off_by_default_does_nothing():
    calls = []
    with KeepAwake(False, platform="linux", which=found("systemd-inhibit", "tail"),
                   spawn=lambda argv: calls.append(argv), set_state=calls.append):
        pass
    assert calls == []


def test_windows_sets_the_thread_state_and_resets_it():
    calls = []
    with KeepAwake(True, platform="win32", set_state=lambda flags: calls.append(flags) or 1):
        assert calls == [ES_CONTINUOUS | ES_SYSTEM_REQUIRED]
    assert calls == [ES_CONTINUOUS | ES_SYSTEM_REQUIRED, ES_CONTINUOUS]


@pytest.mark.parametrize("case", ["no tool", "no start", "refused", "windows call failed"])
def test_a_missing_tool_is_one_warning_and_training_goes_on(case, caplog):
    kwargs = {"no tool": dict(platform="darwin", which=found()),
              "no start": dict(platform="darwin", which=found("caffeinate"), spawn=lambda argv: None),
              "refused": dict(platform="linux", which=found("systemd-inhibit", "tail"),
                              spawn=lambda argv: FakeProc(exits_with=1)),
              "windows call failed": dict(platform="win32", set_state=lambda flags: 0)}[case]
    awake = KeepAwake(True, **kwargs)
    ran = []
    with caplog.at_level(logging.WARNING, logger="worker.awake"):
        for _ in range(3):  # three rounds
            with awake:
                ran.append(1)
    assert ran == [1, 1, 1]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--keep-awake" in warnings[0].getMessage()


def test_the_governor_hands_out_the_rules_keep_awake(tmp_path):
    def governor(rules):
        return Governor(rules, control=ControlFile(tmp_path), transfer=DailyTransfer(tmp_path / "t.json"))

    assert governor(Rules(keep_awake=True)).awake().enabled
    assert not governor(Rules()).awake().enabled


@pytest.mark.skipif(not sys.platform.startswith("linux") or not shutil.which("tail"), reason="needs Linux's tail")
def test_a_real_lock_process_is_started_and_stopped(tmp_path):
    # systemd-inhibit itself may be missing or refused here; `tail --pid` stands in for the whole command
    # so the process handling (start, still running, stop) is the real one
    spawned = []

    def spawn(argv):
        proc = subprocess.Popen(argv[argv.index(shutil.which("tail")):], stdout=subprocess.DEVNULL)
        spawned.append(proc)
        return proc

    with KeepAwake(True, platform="linux", which=lambda n: shutil.which("tail") if n == "tail" else "/x/" + n,
                   spawn=spawn):
        assert spawned[0].poll() is None  # held while the round runs
    assert spawned[0].poll() is not None  # and gone after it
