"""`idletrain stats export|daily` against the in-process coordinator: the daily summary file (CSV
and JSON) and its error messages."""

from __future__ import annotations

import csv
import io
import json

import httpx
import pytest

from coordinator import stats
from coordinator.models import utcnow
from coordinator.settings import CoordinatorSettings
from idletrain import cli

URL = "http://coordinator.test"


@pytest.fixture
def api(tmp_path, open_api, run_config, make_delta, monkeypatch):
    with open_api(CoordinatorSettings(data_dir=tmp_path / "coord", admin_token="operator-secret-0123456789")) as api:
        api.create_run(run_config(), headers=api.admin)
        for name, team in (("alice", "blue"), ("bob", None)):
            w = api.register(name=name, team=team)
            lease = api.lease(w)
            api.accept(lease.lease_id, make_delta(lease), w)
        api.drain()

        def request(method, url, *, timeout, headers, **kwargs):
            assert url.startswith(URL)
            return api.client.request(method, url[len(URL):], headers=headers, **kwargs)

        monkeypatch.setattr(httpx, "request", request)
        monkeypatch.chdir(tmp_path)
        yield api


def run(*argv) -> int:
    return cli.main([*argv, "--coordinator", URL])


def test_export_writes_the_daily_summary(api, tmp_path):
    assert run("stats", "export", "--run", "t", "--out", "today.csv") == 0
    lines = list(csv.DictReader(io.StringIO((tmp_path / "today.csv").read_text())))
    assert list(lines[0]) == stats.SUMMARY_COLUMNS
    by_name = {line["name"]: line for line in lines}
    assert set(by_name) == {"alice", "bob"} and by_name["alice"]["team"] == "blue" and by_name["bob"]["team"] == ""
    for line in lines:
        assert line["tokens_day"] == line["tokens_total"] and int(line["tokens_total"]) > 0
        assert line["deltas_day"] == line["deltas_total"] == "1" and float(line["credit_total"]) > 0
    assert run("stats", "export", "--run", "t", "--out", "s.json", "--format", "json",
               "--day", utcnow().date().isoformat()) == 0
    body = json.loads((tmp_path / "s.json").read_text())
    assert body["run"] == "t" and len(body["lines"]) == 2
    assert run("stats", "export", "--run", "t", "--out", "old.csv", "--day", "2020-01-01") == 0
    assert (tmp_path / "old.csv").read_text() == ",".join(stats.SUMMARY_COLUMNS) + "\n"  # nothing before then


def test_daily_rows_by_team(api, tmp_path, capsys):
    assert run("stats", "daily", "--run", "t", "--by", "team", "--out", "-") == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert list(rows[0]) == stats.TEAM_COLUMNS and [(r["team"], r["workers"]) for r in rows] == [("blue", "1")]


def test_errors_say_what_to_do(api, tmp_path, capsys):
    assert run("stats", "export", "--run", "nope", "--out", "x.csv") == 2
    assert "404" in capsys.readouterr().err and not (tmp_path / "x.csv").exists()
    assert run("stats", "export", "--run", "t", "--out", str(tmp_path / "no" / "such" / "x.csv")) == 2
    assert "cannot write" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad_day:
        run("stats", "export", "--run", "t", "--out", "x.csv", "--day", "31/12/2026")
    assert bad_day.value.code == 2 and "YYYY-MM-DD" in capsys.readouterr().err
