"""Schema migrations, programmatically: upgrade a database to the newest schema, or write the
next revision after models.py changed (`python -m coordinator.migrate revision "message"`)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine

from coordinator.queries import locks

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
MIGRATE_LOCK_CLASS = 0x1D1F  # the advisory lock that serialises migrations (the merger's is 0x1D1E)


def alembic_config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> str | None:
    """Bring the database to `revision` (default: the newest); returns the revision it is at."""
    cfg = alembic_config()
    with engine.begin() as conn, _foreign_keys_deferred(conn):
        if engine.dialect.name == "postgresql":
            # Coordinator processes starting together migrate one at a time (the lock ends with the
            # transaction); the others then find the schema at head and do nothing.
            locks.wait_migration_lock(conn, MIGRATE_LOCK_CLASS)
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    return current(engine)


def downgrade(engine: Engine, revision: str) -> str | None:
    cfg = alembic_config()
    with engine.begin() as conn, _foreign_keys_deferred(conn):
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
    return current(engine)


@contextlib.contextmanager
def _foreign_keys_deferred(conn: Connection) -> Iterator[None]:
    """On SQLite, foreign keys off while migrations run, checked once after: a batch migration
    rebuilds a table (copy, drop, rename), and dropping one that other rows reference fails with
    them on, deferred or not. The pragma is a no-op inside a transaction, so it comes first."""
    if conn.dialect.name != "sqlite":
        yield
        return
    conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
    try:
        yield
        broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
        if broken:
            raise RuntimeError(f"the migration left rows whose foreign keys point nowhere: {broken[:5]}")
    finally:
        conn.exec_driver_sql("PRAGMA foreign_keys=ON")


def _revision(message: str) -> None:
    """Autogenerate the next revision against a scratch SQLite database at the current head."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/scratch.sqlite3"
        upgrade(create_engine(url))
        latest = head()
        rev_id = f"{int(latest) + 1:04d}" if latest and latest.isdigit() else None  # 0001, 0002, ...
        command.revision(alembic_config(url), message=message, autogenerate=True, rev_id=rev_id)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "revision":
        sys.exit('usage: python -m coordinator.migrate revision "what changed"')
    _revision(sys.argv[2])
