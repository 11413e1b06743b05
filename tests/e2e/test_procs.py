"""The suite's own process handling (tests/procs.py): a process a test stops leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests import procs

# a parent that starts a child (sleeping) and prints the child's pid, then sleeps itself
_PARENT = ("import subprocess, sys, time; "
           "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
           "print(c.pid, flush=True); time.sleep(600)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _wait_gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _spawn_parent() -> tuple[subprocess.Popen, int]:
    proc = procs.popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert _alive(child)
    return proc, child


def test_stop_kills_the_children_of_a_process_killed_hard():
    proc, child = _spawn_parent()
    procs.stop(proc, signal.SIGKILL)  # the parent dies at once; its child would be orphaned, not killed
    assert _wait_gone(child), f"child {child} outlived its stopped parent"


def test_leftovers_are_killed_with_their_children_at_the_end():
    proc, child = _spawn_parent()
    assert procs.kill_leftovers() >= 1
    assert proc.poll() is not None
    assert _wait_gone(child), f"child {child} outlived the end of the session"
