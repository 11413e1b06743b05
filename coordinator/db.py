"""Engine and session factory. Nothing is built at import time: create_app builds them."""

from __future__ import annotations

import time

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.orm import Session, sessionmaker

# A pooled PostgreSQL connection that sat unused this long is pinged before use (a server restart or
# an idle timeout may have closed it); busy connections are not: a ping is a round trip per checkout.
PING_IDLE_S = 10.0


def make_engine(url: str, *, ping_idle_s: float = PING_IDLE_S) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")  # readers never block the merger's writes
            cur.execute("PRAGMA synchronous=FULL")  # an acknowledged delta survives power loss
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    # 20 kept open, so a process under load rarely opens and closes overflow connections (a fork of
    # a PostgreSQL backend each); at most 30 per process, as before
    engine = create_engine(url, pool_size=20, max_overflow=10)
    _ping_when_idle(engine, ping_idle_s)
    return engine


def _ping_when_idle(engine: Engine, idle_s: float) -> None:
    """Pessimistic disconnect handling, only for connections idle `idle_s` or longer (SQLAlchemy's
    pool_pre_ping pings on every checkout). A dead one is replaced before the caller sees it."""

    @event.listens_for(engine, "checkin")
    def _idle_since(_dbapi_conn, record) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping(dbapi_conn, record, _proxy) -> None:
        since = record.info.get("idle_since")
        if since is None or time.monotonic() - since < idle_s:
            return  # new, or back in the pool moments ago
        try:
            engine.dialect.do_ping(dbapi_conn)
        except engine.dialect.loaded_dbapi.Error as err:
            if engine.dialect.is_disconnect(err, dbapi_conn, None):
                raise exc.DisconnectionError(f"pooled connection is dead: {err}") from err
            raise


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def init_db(engine: Engine) -> None:
    """Bring the schema to the newest migration (coordinator/migrations); an empty database gets
    every table, an older one the changes since its revision."""
    from coordinator import migrate

    migrate.upgrade(engine)
