"""Schema migrations: an empty database upgraded to the newest revision has exactly the schema
coordinator/models.py declares, on SQLite and PostgreSQL; downgrading removes it all again."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from coordinator import migrate
from coordinator.db import make_engine
from coordinator.models import Base
from idletrain import cli


def _engine(tmp_path, db_url):
    return make_engine(db_url or f"sqlite:///{tmp_path / 'm.sqlite3'}")


def test_upgrade_gives_the_models_schema_and_downgrade_removes_it(tmp_path, db_url):
    engine = _engine(tmp_path, db_url)
    try:
        assert migrate.current(engine) is None
        assert migrate.upgrade(engine) == migrate.head()
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        assert diff == [], f"models.py and the migrations disagree; write a revision: {diff}"
        assert migrate.upgrade(engine) == migrate.head()  # idempotent
        assert migrate.downgrade(engine, "base") is None
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    finally:
        engine.dispose()


def test_migrate_command(tmp_path, db_url, capsys):
    argv = ["coordinator", "migrate", "--data-dir", str(tmp_path / "d")]
    if db_url:
        argv += ["--database-url", db_url]
    assert cli.main([*argv, "--check"]) == 1
    assert "run `idletrain coordinator migrate`" in capsys.readouterr().out
    assert cli.main(argv) == 0
    assert f"-> {migrate.head()}" in capsys.readouterr().out
    assert cli.main([*argv, "--check"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_migrate_command_says_what_is_wrong(tmp_path, capsys):
    assert cli.main(["coordinator", "migrate", "--database-url", "postgresql+psycopg://nobody@127.0.0.1:1/x"]) == 2
    assert "cannot migrate" in capsys.readouterr().err
