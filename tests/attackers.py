"""Sockets that an attacker holds open against a server, for the tests of what connections may hold
(tests/e2e/test_connection_flood.py). Each Attacker runs in a process of its own (started with
`spawn`, importing nothing heavy), so its thousands of sockets take none of the GIL the test's honest
clients time their requests with.

    Attacker      `slots` sockets from one source address, each opened with its bytes (a request
                  head, or nothing) and fed some bytes a second; what the server did to each is noted
                  as (the first bytes of its answer or b"", seconds from connect to close), and the
                  slot is dialed again `redial_s` later
    Flood         an Attacker in a child process: start() returns once every slot was dialed once,
                  finish() stops it and returns its outcomes
"""

from __future__ import annotations

import contextlib
import multiprocessing
import selectors
import socket
import threading
import time
from collections import deque


class Attacker(threading.Thread):
    def __init__(self, port: int, *, source: str, openings: list[bytes], feed: bytes, redial_s: float) -> None:
        super().__init__(daemon=True)
        self.port, self.source, self.openings, self.feed, self.redial_s = port, source, openings, feed, redial_s
        self.outcomes: list[tuple[bytes, float]] = []
        self.stop = threading.Event()
        self.dialed_once = threading.Event()

    def _dial(self, sel: selectors.BaseSelector, slot: int) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((self.source, 0))
            s.settimeout(10)
            s.connect(("127.0.0.1", self.port))
            s.sendall(self.openings[slot])
            s.setblocking(False)
        except OSError:
            s.close()
            raise
        sel.register(s, selectors.EVENT_READ, data=[slot, time.monotonic(), b""])

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        due = deque((0.0, slot) for slot in range(len(self.openings)))
        next_feed = time.monotonic() + 1
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                while due and due[0][0] <= now:
                    slot = due.popleft()[1]
                    try:
                        self._dial(sel, slot)
                    except OSError as exc:  # refused or reset before it was accepted: noted, dialed again
                        self.outcomes.append((f"dial: {exc}".encode(), 0.0))
                        due.append((time.monotonic() + self.redial_s, slot))
                self.dialed_once.set()
                if self.feed and now >= next_feed:
                    next_feed = now + 1
                    for key in list(sel.get_map().values()):
                        with contextlib.suppress(OSError):
                            key.fileobj.send(self.feed)
                for key, _ in sel.select(timeout=0.05):
                    self._readable(sel, key, due)
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()
            sel.close()

    def _readable(self, sel: selectors.BaseSelector, key: selectors.SelectorKey, due: deque) -> None:
        slot, opened, got = key.data
        try:
            chunk = key.fileobj.recv(4096)
        except OSError:
            chunk = b""
        if chunk:  # an answer: read on until the server closes
            key.data[2] = got + chunk
            return
        self.outcomes.append((got[:400], time.monotonic() - opened))
        sel.unregister(key.fileobj)
        key.fileobj.close()
        due.append((time.monotonic() + self.redial_s, slot))


def _child(conn, port: int, kwargs: dict) -> None:
    attacker = Attacker(port, **kwargs)
    attacker.start()
    attacker.dialed_once.wait(120)
    conn.send("dialed")
    conn.recv()  # "stop"
    attacker.stop.set()
    attacker.join(60)
    conn.send(attacker.outcomes)


class Flood:
    """An Attacker (its keyword arguments) in a child process of its own."""

    def __init__(self, port: int, **kwargs) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, port, kwargs), daemon=True)

    def start(self, timeout_s: float = 120) -> None:
        self._proc.start()
        if not self._conn.poll(timeout_s):
            raise AssertionError(f"the attacker did not dial its sockets within {timeout_s} s")
        assert self._conn.recv() == "dialed"

    def finish(self, timeout_s: float = 120) -> list[tuple[bytes, float]]:
        self._conn.send("stop")
        if not self._conn.poll(timeout_s):
            self._proc.kill()
            raise AssertionError("the attacker did not stop")
        outcomes = self._conn.recv()
        self._proc.join(30)
        return outcomes

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
