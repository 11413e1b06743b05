"""The engine's pool: a PostgreSQL connection that sat idle is pinged before use and replaced when
its server side is gone; a busy one is not pinged (a round trip per checkout)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, event, exc, text

from coordinator.db import make_engine


def _backend_pid(engine) -> int:
    with engine.connect() as c:
        return c.execute(text("select pg_backend_pid()")).scalar_one()


def _kill(url: str, pid: int) -> None:
    admin = create_engine(url)
    try:
        with admin.connect() as c:
            assert c.execute(text("select pg_terminate_backend(:pid)"), {"pid": pid}).scalar_one()
    finally:
        admin.dispose()


@pytest.fixture
def pg_url(db_url: str | None) -> str:
    if db_url is None:
        pytest.skip("PostgreSQL only: SQLite has no server side to lose")
    return db_url


def test_idle_connection_killed_server_side_is_replaced_before_use(pg_url):
    engine = make_engine(pg_url, ping_idle_s=0.0)  # every connection back in the pool counts as idle
    try:
        pid = _backend_pid(engine)
        _kill(pg_url, pid)
        assert _backend_pid(engine) != pid  # the ping found it dead; the caller got a fresh one, no error
    finally:
        engine.dispose()


def test_busy_connection_is_not_pinged(pg_url):
    engine = make_engine(pg_url)  # the default: only connections idle for seconds are pinged
    sent: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *a: sent.append(a[2]))
    pings: list[int] = []
    original = engine.dialect.do_ping
    engine.dialect.do_ping = lambda conn: pings.append(1) or original(conn)
    try:
        for _ in range(5):
            _backend_pid(engine)
        assert pings == [] and len(sent) == 5
        # and the other side of the bargain: a connection killed moments ago is only found dead on use
        _kill(pg_url, _backend_pid(engine))
        with pytest.raises(exc.OperationalError):
            _backend_pid(engine)
        assert _backend_pid(engine)  # the pool dropped it: the next checkout connects afresh
    finally:
        engine.dispose()
