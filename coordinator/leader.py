"""Which coordinator process merges: the one holding the merger lock.

Several coordinator processes may serve one database and one data directory (`idletrain
coordinator serve --processes N`, or separately started ones). All of them answer workers; exactly
one of them, the leader, holds each run's live model: it runs the merger, answers sparse exchanges
and evaluates. On PostgreSQL the leader is the holder of a session-level advisory lock, keyed by
the database and schema, held on a connection of its own: when the process dies, its connection
closes and PostgreSQL releases the lock, and another process takes it within `poll_s`. SQLite
allows one coordinator process, which always leads.

The leader publishes where it listens for relayed requests (`leader.json` in the data directory):
the other processes forward the requests that need the live model (exchanges, evaluations) there.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from sqlalchemy import Connection, Engine

from coordinator.queries import locks
from shared.files import atomic_write

log = logging.getLogger(__name__)

LOCK_CLASS = 0x1D1E  # the advisory lock's first key: idletrain's; the second is hashtext(database/schema)
LEADER_FILE = "leader.json"


class Leadership:
    """try_take() / still_held() / release() of the merger lock; `held` says whether this process leads."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.shared = engine.dialect.name == "postgresql"  # SQLite: one process, always the leader
        self._conn: Connection | None = None
        self._lock = threading.Lock()  # the connection serves one thread at a time (election, merger, exchanges)
        self.held = False

    def try_take(self) -> bool:
        with self._lock:
            return self._try_take()

    def _try_take(self) -> bool:
        if self.held:
            return True
        if not self.shared:
            self.held = True
            return True
        try:
            if self._conn is None:
                self._conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            self.held = locks.try_session_lock(self._conn, LOCK_CLASS)
        except Exception as exc:  # the database is away: not the leader, ask again later
            log.warning("cannot ask for the merger lock: %s", exc)
            self._drop()
        return self.held

    def still_held(self) -> bool:
        """Whether the lock's connection is alive (a session lock lasts as long as its session)."""
        if not self.held or not self.shared:
            return self.held
        with self._lock:
            try:
                locks.ping(self._conn)
            except Exception as exc:
                log.error("the merger lock's connection is gone (%s): this process no longer leads", exc)
                self._drop()
            return self.held

    def release(self) -> None:
        with self._lock:
            if self.shared:
                self._drop()
            self.held = False

    def _drop(self) -> None:
        """Close the lock's connection for good (never back into the pool, where it would keep the lock)."""
        self.held = False
        if self._conn is not None:
            try:
                self._conn.invalidate()
                self._conn.close()
            except Exception:
                pass
            self._conn = None


def publish(data_dir: Path, url: str) -> None:
    """Say where the leader takes relayed requests."""
    atomic_write(data_dir / LEADER_FILE, json.dumps({"url": url, "pid": os.getpid()}).encode())


def unpublish(data_dir: Path) -> None:
    """Take this process's address down (only if it is still this process's)."""
    found = read(data_dir)
    if found is not None and found.get("pid") == os.getpid():
        (data_dir / LEADER_FILE).unlink(missing_ok=True)


def read(data_dir: Path) -> dict | None:
    try:
        return json.loads((data_dir / LEADER_FILE).read_bytes())
    except (OSError, ValueError):
        return None
