"""coordinator.db.driver_url: the database driver is checked before anything connects, and a missing
one is one line that says what to install (shared/extras.py), in every process that would need it."""

from __future__ import annotations

import sys

import pytest

from coordinator import app as app_mod
from coordinator.db import driver_url, make_engine
from shared.extras import MissingExtra


def test_a_bare_postgresql_url_means_the_driver_the_postgres_extra_installs():
    assert driver_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert driver_url("postgresql+psycopg://u:p%40ss@h:5433/db?sslmode=require") == (
        "postgresql+psycopg://u:p%40ss@h:5433/db?sslmode=require")  # an explicit driver: the URL as given
    assert driver_url("sqlite:////tmp/x.sqlite3") == "sqlite:////tmp/x.sqlite3"


def test_a_bare_postgresql_url_keeps_psycopg2_where_only_it_is_installed(monkeypatch):
    from coordinator import db

    monkeypatch.setattr(db, "available", lambda module: module == "psycopg2")
    monkeypatch.setitem(sys.modules, "psycopg2", sys.modules["sqlite3"])  # any module will do for the import
    assert driver_url("postgresql://u@h/db") == "postgresql://u@h/db"


@pytest.mark.parametrize("url", ["postgresql+psycopg://u:hunter2@h/db", "postgresql://u:hunter2@h/db"])
def test_a_missing_psycopg_is_one_line_with_the_extra(monkeypatch, url):
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(MissingExtra) as info:
        driver_url(url)
    msg = str(info.value)
    assert msg == ("--database-url postgresql+psycopg://u:***@h/db needs the Python module 'psycopg', which is not "
                   "installed: pip install 'idletrain[postgres]'")
    with pytest.raises(MissingExtra):
        make_engine(url)  # the engine, whoever builds it, says the same


def test_other_drivers_name_their_own_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg2", None)
    with pytest.raises(MissingExtra, match=r"'psycopg2', which is not installed: pip install psycopg2 \(or use "
                                           r"postgresql\+psycopg:// and pip install 'idletrain\[postgres\]'\)"):
        driver_url("postgresql+psycopg2://u@h/db")
    with pytest.raises(ValueError, match="knows no database 'nosuchdb'"):
        driver_url("nosuchdb://u@h/db")
    with pytest.raises(ValueError, match="is not a database URL"):
        driver_url("no url at all")


def test_each_process_of_serve_processes_n_exits_with_the_line(monkeypatch, tmp_path, capsys):
    """app_from_environment (uvicorn's factory in every process of `serve --processes N`)."""
    monkeypatch.setitem(sys.modules, "psycopg", None)
    monkeypatch.setenv("IDLETRAIN_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("IDLETRAIN_DATABASE_URL", "postgresql+psycopg://u@127.0.0.1:1/db")
    with pytest.raises(SystemExit) as info:
        app_mod.app_from_environment()
    assert info.value.code == ("idletrain: --database-url postgresql+psycopg://u@127.0.0.1:1/db needs the Python "
                               "module 'psycopg', which is not installed: pip install 'idletrain[postgres]'")
