"""The engine, and Database: how the coordinator reaches it (Core statements of coordinator/queries/
on a Connection). Nothing is built at import time: the Coordinator builds them."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager

from sqlalchemy import Connection, Engine, create_engine, event, exc
from sqlalchemy.engine import make_url

from shared.extras import MissingExtra, available, install_hint

# A pooled PostgreSQL connection that sat unused this long is pinged before use (a server restart or
# an idle timeout may have closed it); busy connections are not: a ping is a round trip per checkout.
PING_IDLE_S = 10.0


def driver_url(url: str) -> str:
    """`url` with its database driver checked before anything connects: MissingExtra (one line, the
    pip command to run) when the driver is not installed, ValueError for a URL SQLAlchemy cannot use.

    A bare postgresql:// means the driver the `postgres` extra installs, psycopg (3), where it is
    installed (SQLAlchemy's own default is psycopg2, which that extra does not install); with only
    psycopg2 installed it stays psycopg2."""
    try:
        parsed = make_url(url)
    except exc.ArgumentError as err:
        raise ValueError(f"--database-url {url!r} is not a database URL ({err}); e.g. "
                         "postgresql+psycopg://USER@HOST/DB or sqlite:///PATH") from None
    if parsed.drivername in ("postgresql", "postgres"):
        if available("psycopg") or not available("psycopg2"):
            parsed = parsed.set(drivername="postgresql+psycopg")
        url = parsed.render_as_string(hide_password=False)
    shown = parsed.render_as_string(hide_password=True)
    try:
        dialect = parsed.get_dialect()
    except exc.NoSuchModuleError:
        raise ValueError(f"--database-url {shown}: SQLAlchemy knows no database {parsed.drivername!r}; use "
                         "postgresql+psycopg://USER@HOST/DB or sqlite:///PATH") from None
    try:
        dialect.import_dbapi()
    except ImportError as err:
        module = getattr(err, "name", None) or parsed.get_driver_name()
        if parsed.get_backend_name() == "postgresql" and module.partition(".")[0] == "psycopg":
            raise MissingExtra(module, "postgres", purpose=f"--database-url {shown}") from None
        install = f"pip install {module.partition('.')[0]}"
        if parsed.get_backend_name() == "postgresql":
            install += f" (or use postgresql+psycopg:// and {install_hint('postgres')})"
        raise MissingExtra(module, parsed.get_backend_name(), purpose=f"--database-url {shown}",
                           install=install) from None
    return url


def make_engine(url: str, *, ping_idle_s: float = PING_IDLE_S) -> Engine:
    """The engine for `url` (driver_url's checks first: a missing driver is MissingExtra)."""
    url = driver_url(url)
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


def init_db(engine: Engine) -> None:
    """Bring the schema to the newest migration (coordinator/migrations); an empty database gets
    every table, an older one the changes since its revision."""
    from coordinator import migrate

    migrate.upgrade(engine)


class Database:
    """The engine (schema brought to the newest migration) and the three ways to a Connection."""

    def __init__(self, url: str) -> None:
        self.engine: Engine = make_engine(url)
        init_db(self.engine)
        # single statements, each its own transaction: no BEGIN or ROLLBACK round trip around a read
        self._reads = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        self.skip_locked = self.engine.dialect.name == "postgresql"  # concurrent claims skip each other's rows

    def begin(self) -> AbstractContextManager[Connection]:
        """One transaction, committed when the block ends (rolled back on an error)."""
        return self.engine.begin()

    def connect(self) -> AbstractContextManager[Connection]:
        """A connection whose caller commits or rolls back part way; rolled back when the block ends."""
        return self.engine.connect()

    def read(self) -> AbstractContextManager[Connection]:
        """A connection in autocommit: each statement its own transaction (reads, and single writes)."""
        return self._reads.connect()

    def dispose(self) -> None:
        self.engine.dispose()
