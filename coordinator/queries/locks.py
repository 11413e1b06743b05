"""PostgreSQL advisory locks, keyed by a class and the database/schema: the merger lock (held for a
session: coordinator/leader.py) and the migration lock (held for a transaction: coordinator/migrate.py)."""

from __future__ import annotations

from sqlalchemy import Connection, text

_TRY_SESSION_LOCK = text("SELECT pg_try_advisory_lock(:cls, hashtext(current_database() || '/' || current_schema()))")
_XACT_LOCK = text("SELECT pg_advisory_xact_lock(:cls, hashtext('migrate/' || current_database() "
                  "|| '/' || current_schema()))")
_PING = text("SELECT 1")


def try_session_lock(c: Connection, cls: int) -> bool:
    """Take the lock for as long as `c`'s session lives, if it is free; whether it was."""
    return bool(c.execute(_TRY_SESSION_LOCK, {"cls": cls}).scalar())


def wait_migration_lock(c: Connection, cls: int) -> None:
    """Wait for the lock and hold it until `c`'s transaction ends."""
    c.execute(_XACT_LOCK, {"cls": cls})


def ping(c: Connection) -> None:
    """A round trip: raises when the connection (and with it a session lock) is gone."""
    c.execute(_PING)
