"""`--keep-awake`: hold off the machine's sleep while a round runs, and only then.

    KeepAwake(enabled)   a context manager around a round; off (does nothing) by default

How, per platform (the command is built by the pure `inhibit_command`, tested anywhere):

    macOS    `caffeinate -i -w <worker pid>`: no idle sleep until it is stopped or the worker exits
    Linux    `systemd-inhibit --what=sleep --mode=block ... tail --pid=<worker pid> -f /dev/null`: a
             logind sleep lock held while `tail` runs, and `tail` ends with the worker, so a killed
             worker leaves no lock behind (where there is no systemd, nothing to hold it with)
    Windows  SetThreadExecutionState(ES_CONTINUOUS | ES_SYSTEM_REQUIRED) on the training thread,
             ES_CONTINUOUS alone after the round (worker/windows.py makes the call)

The display may still turn off: only the system's sleep is held. A missing tool, a lock logind
refuses (a service outside any session, without the right), or a failing call is one warning, and
training goes on as without the option. The process start and the Windows call are seams (`spawn`,
`set_state`) that tests replace.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)

ES_CONTINUOUS = 0x80000000
ES_SYSTEM_REQUIRED = 0x00000001
WHY = "idletrain is training a round"
# A lock command still running after this long took: one that fails (not allowed, no logind) exits at once.
START_CHECK_S = 0.3


def inhibit_command(platform: str, *, pid: int, which: Callable[[str], str | None] = shutil.which) -> list[str] | None:
    """The command that keeps the machine awake until it is stopped or process `pid` exits; None
    where there is none (Windows uses a call instead; a Linux without systemd-inhibit)."""
    if platform == "darwin":
        tool = which("caffeinate")
        return [tool, "-i", "-w", str(pid)] if tool else None
    if platform.startswith("linux"):
        tool, tail = which("systemd-inhibit"), which("tail")
        if not tool or not tail:
            return None
        return [tool, "--what=sleep", "--who=idletrain", f"--why={WHY}", "--mode=block",
                tail, f"--pid={pid}", "-f", "/dev/null"]
    return None


def _spawn(argv: list[str]) -> subprocess.Popen | None:
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as exc:
        log.debug("cannot start %s: %s", argv[0], exc)
        return None


def _windows_set_state(flags: int) -> int:
    from worker.windows import set_thread_execution_state

    return set_thread_execution_state(flags)


class KeepAwake:
    """Enter before a round, exit after it (on the thread that trains: Windows' state is per thread).
    Reusable, one round at a time."""

    def __init__(self, enabled: bool, *, platform: str | None = None, pid: int | None = None,
                 which: Callable[[str], str | None] = shutil.which,
                 spawn: Callable[[list[str]], subprocess.Popen | None] = _spawn,
                 set_state: Callable[[int], int] = _windows_set_state) -> None:
        self.enabled = enabled
        self.platform = platform or sys.platform
        self.pid = pid if pid is not None else os.getpid()
        self.which, self.spawn, self.set_state = which, spawn, set_state
        self._proc: subprocess.Popen | None = None
        self._held_windows = False
        self._warned = False

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("--keep-awake: %s; training goes on, and the machine may sleep during a round", why)

    def __enter__(self) -> KeepAwake:
        if not self.enabled:
            return self
        if self.platform == "win32":
            self._held_windows = self.set_state(ES_CONTINUOUS | ES_SYSTEM_REQUIRED) != 0
            if not self._held_windows:
                self._warn("SetThreadExecutionState failed")
            return self
        argv = inhibit_command(self.platform, pid=self.pid, which=self.which)
        if argv is None:
            self._warn("no way to hold off sleep here (macOS: caffeinate; Linux: systemd-inhibit)")
            return self
        proc = self.spawn(argv)
        if proc is None:
            self._warn(f"{os.path.basename(argv[0])} did not start")
            return self
        try:
            code = proc.wait(timeout=START_CHECK_S)
        except subprocess.TimeoutExpired:
            self._proc = proc  # running: the lock is held
            return self
        self._warn(f"{os.path.basename(argv[0])} exited at once (code {code}: not allowed to hold the lock?)")
        return self

    def __exit__(self, *exc) -> None:
        if self._held_windows:
            self._held_windows = False
            self.set_state(ES_CONTINUOUS)  # back to the system's own idle timers
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
