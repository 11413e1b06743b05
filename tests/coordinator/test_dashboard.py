"""The public dashboard: the page (GET /) and the JSON behind it (GET /api/v1/runs/{run}/dashboard).
The page's rendering in a real browser is tests/test_dashboard_browser.py."""

from __future__ import annotations

import base64
import hashlib
import re
from datetime import timedelta

import pytest
from sqlalchemy import event, insert, select, update

from coordinator.models import DeltaRecord, EvalResult, Lease, Run, Shard, Worker, utcnow
from shared import protocol
from tests.conftest import API


def dashboard(api, run: str = "t") -> dict:
    resp = api.client.get(f"{API}/runs/{run}/dashboard")
    assert resp.status_code == 200, resp.text
    protocol.Dashboard.model_validate(resp.json())
    return resp.json()


def test_page_is_self_contained_and_locked_to_its_own_script(api):
    resp = api.client.get("/")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    html = resp.text
    assert len(html) < 40_000  # small: inline CSS and JS, no framework
    # nothing fetched from elsewhere: no src attributes at all, no absolute URLs but the SVG namespace
    assert " src=" not in html and "@import" not in html
    assert set(re.findall(r"https?://[^\s\"'`]+", html)) == {"http://www.w3.org/2000/svg"}
    csp = resp.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    (script,) = re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp
    assert "innerHTML" not in script  # names and teams are anyone's text: textContent only


def test_dashboard_numbers(api, run, make_delta):
    tokens = run.inner.steps * run.inner.batch_size * run.model.context
    alice, bob = api.register(name="alice", team="blue", device="cuda"), api.register(name="bob", team="blue")
    carol = api.register(name="carol", team="red", device="mps")
    api.register()  # registered, never delivered: live, not on the leaderboard
    leases = {who: api.lease(h) for who, h in (("alice", alice), ("bob", bob), ("carol", carol))}
    api.snapshot()
    for i, (who, h) in enumerate((("alice", alice), ("bob", bob), ("carol", carol))):
        api.accept(leases[who].lease_id, make_delta(leases[who], seed=i), h)
    with api.db() as s:  # alice came back in 10 s (bonus sqrt(15)), the others in 300 s (1)
        for who, seconds in (("alice", 10.0), ("bob", 300.0), ("carol", 300.0)):
            received = s.scalar(select(DeltaRecord.received_at).where(DeltaRecord.lease_id == leases[who].lease_id))
            s.execute(update(Lease).where(Lease.id == leases[who].lease_id)
                      .values(created_at=received - timedelta(seconds=seconds)))
        s.commit()
    assert api.drain() == 3
    api.operator("post", f"{API}/runs/t/evaluate")
    bob_lease = api.lease(bob)  # bob trains again: live by his lease
    assert bob_lease.lease_id

    d = dashboard(api)
    status = api.status()
    assert (d["name"], d["state"], d["algorithm"], d["version"]) == ("t", "active", "diloco", 3)
    assert d["tokens_trained"] == status["tokens_trained"] == 3 * tokens
    assert (d["merged_deltas"], d["rejected_deltas"]) == (3, 0)
    assert [e["version"] for e in d["evals"]] == [0, 3]
    assert d["eval_loss"] == status["eval_loss"]
    assert d["bytes_moved"] == status["bytes_up"] + status["bytes_down"]
    assert d["dense_equivalent_bytes"] == status["dense_equivalent_bytes"]
    assert d["bytes_saved"] == d["dense_equivalent_bytes"] - d["bytes_moved"]
    assert d["traffic_ratio_vs_dense"] == status["traffic_ratio_vs_dense"]
    assert (d["workers_total"], d["workers_live"]) == (4, 4)

    board = d["leaderboard"]
    assert [(e["rank"], e["name"], e["team"]) for e in board] == [
        (1, "alice", "blue"), (2, "bob", "blue"), (3, "carol", "red")]  # idle has no delta: not listed
    assert board[0]["credit"] == pytest.approx(tokens * 15 ** 0.5)  # sqrt(0.25 * 600 / 10)
    assert board[1]["credit"] == board[2]["credit"] == tokens
    assert all(e["tokens_trained"] == tokens and e["deltas_accepted"] == 1 and e["standing"] == "ok" for e in board)
    assert d["credit_total"] == pytest.approx(sum(e["credit"] for e in board))
    assert "merged" in d["credit_formula"]
    teams = {t["team"]: t for t in d["teams"]}
    assert [t["team"] for t in d["teams"]] == ["blue", "red"]
    assert teams["blue"]["workers"] == 2 and teams["blue"]["tokens_trained"] == 2 * tokens
    assert teams["blue"]["credit"] == pytest.approx(board[0]["credit"] + board[1]["credit"])

    live = {w["name"]: w for w in d["live_workers"]}
    assert live["alice"]["tokens_per_s"] == pytest.approx(tokens / 10) and live["alice"]["device"] == "cuda"
    assert live["bob"]["tokens_per_s"] == pytest.approx(tokens / 300) and live["bob"]["leasing"] is True
    assert live["alice"]["leasing"] is False and live[None]["tokens_per_s"] is None
    assert [w["name"] for w in d["live_workers"]][:3] == ["alice", "bob", "carol"]  # fastest first


def test_dashboard_shows_badges_not_reasons_or_secrets(api, run_config, make_delta):
    api.create_run(run_config(join_key="club-secret-123"))
    tokens = {}
    for name in ("mallory", "trent"):
        resp = api.client.post(f"{API}/runs/t/workers", json={"name": name, "join_key": "club-secret-123"})
        tokens[name] = resp.json()["token"]
    for name, token in tokens.items():
        h = {"Authorization": f"Bearer {token}"}
        lease = api.lease(h)
        api.accept(lease.lease_id, make_delta(lease), h)
    api.drain()
    with api.db() as s:
        s.execute(update(Worker).where(Worker.name == "mallory")
                  .values(standing="banned", standing_reason="secret-ish operator note"))
        s.execute(update(Worker).where(Worker.name == "trent").values(revoked=True))
        s.commit()
    resp = api.client.get(f"{API}/runs/t/dashboard")
    d = resp.json()
    assert {e["name"]: e["standing"] for e in d["leaderboard"]} == {"mallory": "banned", "trent": "revoked"}
    assert [w["name"] for w in d["live_workers"]] == ["mallory"]  # a revoked token works no more
    for secret in (*tokens.values(), "club-secret-123", "operator note"):
        assert secret not in resp.text


def test_dashboard_of_a_fresh_run_and_of_none(api, run):
    d = dashboard(api)
    assert d["version"] == 0 and len(d["evals"]) == 1 and d["eval_loss"] == d["evals"][0]["loss"]
    assert d["leaderboard"] == d["teams"] == d["live_workers"] == []
    assert d["traffic_ratio_vs_dense"] is None and d["credit_total"] == 0
    assert api.client.get(f"{API}/runs/nope/dashboard").status_code == 404


def test_dashboard_stays_small_and_fast_with_hundreds_of_workers(api, run):
    """600 workers, 6000 recent deltas, 1200 evaluations: capped lists, a bounded number of queries."""
    n_workers, per_worker, n_evals = 600, 10, 1200
    now = utcnow()
    with api.db() as s:
        run_id = s.scalar(select(Shard.run_id))
        shard_id = s.scalar(select(Shard.id))
        s.execute(insert(Worker), [
            {"run_id": run_id, "token_hash": f"{i:064x}", "name": f"w{i}", "team": f"team{i % 70}",
             "device": "cpu", "last_seen": now, "tokens_trained": 384 * per_worker,
             "deltas_accepted": per_worker, "credit": float(i)} for i in range(n_workers)])
        ids = s.scalars(select(Worker.id).order_by(Worker.id)).all()
        s.execute(insert(Lease), [
            {"run_id": run_id, "worker_id": wid, "shard_id": shard_id, "base_version": 0, "seed": 0, "lr": 1e-3,
             "state": "delivered", "created_at": now - timedelta(seconds=30 + j), "deadline": now}
            for wid in ids for j in range(per_worker)])
        lease_ids = s.scalars(select(Lease.id).order_by(Lease.id)).all()
        s.execute(insert(DeltaRecord), [
            {"run_id": run_id, "lease_id": lid, "worker_id": ids[k // per_worker], "seq": k + 1, "base_version": 0,
             "size_bytes": 100, "sha256": "0" * 64, "tokens": 384, "steps": 3, "received_at": now,
             "outcome": "merged"} for k, lid in enumerate(lease_ids)])
        s.execute(insert(EvalResult), [
            {"run_id": run_id, "version": v, "loss": 5.0 - v / 1000, "tokens_trained": v, "at": now}
            for v in range(1, n_evals)])
        s.execute(update(Run).where(Run.id == run_id).values(next_seq=len(lease_ids) + 1))
        s.commit()
    dashboard(api)  # warm
    statements = []
    engine = api.coordinator.db.engine
    listener = lambda *args: statements.append(args[2])  # noqa: E731 (conn, cursor, statement, ...)
    event.listen(engine, "before_cursor_execute", listener)
    try:
        d = dashboard(api)
    finally:
        event.remove(engine, "before_cursor_execute", listener)
    assert len(d["leaderboard"]) == 100 and d["leaderboard"][0]["name"] == f"w{n_workers - 1}"
    assert len(d["teams"]) == 50 and len(d["live_workers"]) == 200 and d["workers_live"] == n_workers
    assert all(w["tokens_per_s"] is not None for w in d["live_workers"])
    assert len(d["evals"]) == 500
    assert (d["evals"][0]["version"], d["evals"][-1]["version"]) == (0, n_evals - 1)
    # quick because its queries do not grow with the workers, leases or deltas (no query per row); its
    # time is a benchmark's matter, not a unit test's
    print(f"{len(statements)} statements")
    assert len(statements) <= 40, statements


def test_status_dashboard_metrics_and_the_cli_count_deltas_alike(api, run_config, encode_unchecked):
    """One delta refused at upload (its bytes are not a delta), one rejected at merge (it moves nothing):
    status, the dashboard, /metrics and `idletrain status` all say 1 and 1 (they once said 0, 2 and 0)."""
    import math

    import numpy as np

    from idletrain.cli.operator import format_status
    from shared.model import build_model, param_schema

    api.create_run(run_config(robust={"enabled": False}))
    h = api.register(name="w")
    first = api.lease(h)
    assert api.upload(first.lease_id, b"not a delta", h).status_code in (400, 422)
    second = api.lease(h)
    zeros = [(n, np.zeros(math.prod(s), dtype=np.float32))
             for n, s in param_schema(build_model(second.model)).items()]
    assert api.upload(second.lease_id, encode_unchecked(second.base_version, zeros), h).status_code == 202
    assert api.drain() == 1
    st, d = api.status(), dashboard(api)
    assert (st["merged_deltas"], st["rejected_deltas"], st["refused_at_upload"]) == (0, 1, 1)
    assert (d["merged_deltas"], d["rejected_deltas"], d["refused_at_upload"]) == (0, 1, 1)
    metrics = api.client.get("/metrics").text
    assert 'idletrain_deltas_rejected_total{run="t",stage="merge"} 1.0' in metrics, metrics
    assert 'idletrain_deltas_rejected_total{run="t",stage="upload"} 1.0' in metrics
    (worker,) = api.operator("get", f"{API}/runs/t/workers").json()
    assert worker["deltas_rejected"] == st["rejected_deltas"] + st["refused_at_upload"]
    assert "1 rejected at merge, 1 refused at upload" in format_status(st)
    every = api.runtime().config.eval_every
    assert st["next_eval_version"] == every and f"(next at v{every})" in format_status(st)
