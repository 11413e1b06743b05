"""A run's lifecycle: the token budget and the epochs end it (410 to lease requests, the leases out
still deliver), the merger finishes it (final evaluation, checkpoint, Hugging Face export), `run
finish` by hand (with a grace time), options changed later, archive and delete with their refusals."""

from __future__ import annotations

import json

from coordinator.models import EvalResult, Run, Shard, Worker
from shared import protocol

API = protocol.API_PREFIX
ROUND_TOKENS = 3 * 4 * 32  # the tiny run's round: steps x batch x context


def _lease_answer(api, headers, run: str = "t"):
    return api.client.post(f"{API}/runs/{run}/leases", headers=headers)


def _settle(api, run: str = "t") -> bool:
    rt = api.runtime(run)
    api.drain()
    return api.coordinator.lifecycle.settle(rt)


def _export_dir(api, run_id: int):
    return api.coordinator.storage.blobs.root / f"runs/{run_id}/exports/final"


def test_the_budget_stops_leases_and_the_run_finishes(api, run_config, make_delta):
    api.create_run(run_config(token_budget=2 * ROUND_TOKENS))
    a, b, c = api.register(), api.register(), api.register()
    la, lb = api.lease(a), api.lease(b)
    # two rounds out promise the whole budget: no third lease, but no finish either (they may expire)
    resp = _lease_answer(api, c)
    assert resp.status_code == 204
    assert api.status()["state"] == "active"
    api.accept(la.lease_id, make_delta(la), a)
    api.accept(lb.lease_id, make_delta(lb, seed=1), b)
    resp = _lease_answer(api, c)
    assert resp.status_code == 410
    assert "finished" in resp.json()["detail"] and "token budget" in resp.json()["detail"]
    st = api.status()
    assert st["state"] == "finishing" and st["tokens_trained"] == st["token_budget"] == 2 * ROUND_TOKENS
    assert _settle(api)
    st = api.status()
    assert st["state"] == "finished" and st["finished_at"] is not None and st["version"] == 2
    assert st["eval_history"][-1]["version"] == 2  # the final evaluation
    with api.db() as s:
        run_id = s.query(Run).one().id
    folder = _export_dir(api, run_id)
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert not api.coordinator.live.runtime_list()  # its live model is let go
    assert _lease_answer(api, a).status_code == 410
    resume = api.operator("post", f"{API}/runs/t/resume")
    assert resume.status_code == 409 and "finished" in resume.json()["detail"]


def test_one_epoch_by_default_without_a_budget(api, run_config, make_delta):
    api.create_run(run_config(epochs=None))
    headers = api.register()
    for i in range(4):  # the run's 4 shards, once
        lease = api.lease(headers)
        api.accept(lease.lease_id, make_delta(lease, seed=i), headers)
    resp = _lease_answer(api, headers)
    assert resp.status_code == 410 and "1 epoch(s)" in resp.json()["detail"]
    assert api.status()["epoch"] == 0 and api.status()["max_epochs"] == 1
    assert _settle(api)
    assert api.status()["state"] == "finished"


def test_the_merger_notices_a_run_done_training(api, run_config, make_delta):
    """No worker asks again: the merger's own check starts the finish."""
    api.create_run(run_config(epochs=1))
    headers = api.register()
    for i in range(4):
        lease = api.lease(headers)
        api.accept(lease.lease_id, make_delta(lease, seed=i), headers)
    assert not _settle(api)  # active -> finishing on this pass
    assert api.status()["state"] == "finishing"
    assert _settle(api)
    assert api.status()["state"] == "finished"


def test_finish_by_hand_waits_for_the_leases_out(api, run, make_delta):
    headers = api.register()
    lease = api.lease(headers)
    resp = api.operator("post", f"{API}/runs/t/finish")
    assert resp.status_code == 200 and resp.json()["state"] == "finishing"
    assert _lease_answer(api, api.register()).status_code == 410
    assert not _settle(api)  # a lease is out
    api.accept(lease.lease_id, make_delta(lease), headers)  # acknowledged: it counts
    assert _settle(api)
    st = api.status()
    assert st["state"] == "finished" and st["version"] == 1 and st["merged_deltas"] == 1


def test_finish_with_a_grace_time_gives_up_the_leases_out(api, run, make_delta):
    headers = api.register()
    lease = api.lease(headers)
    assert api.operator("post", f"{API}/runs/t/finish", params={"grace_s": 0}).status_code == 200
    assert _settle(api)
    assert api.status()["state"] == "finished"
    late = api.upload(lease.lease_id, make_delta(lease), headers)
    assert late.status_code == 410  # its lease was given up: refused, nothing acknowledged
    again = api.operator("post", f"{API}/runs/t/finish")
    assert again.status_code == 409 and "finished already" in again.json()["detail"]


def test_options_change_later_and_order_the_active_runs(api, run_config):
    api.create_run(run_config("low", priority=1))
    api.create_run(run_config("high", priority=5, join_key="k" * 12))
    api.create_run(run_config("off"))
    assert api.operator("post", f"{API}/runs/off/pause").status_code == 200
    active = api.client.get(f"{API}/runs", params={"state": "active"}).json()
    assert [(r["name"], r["priority"], r["join_key_required"]) for r in active] == [
        ("high", 5, True), ("low", 1, False)]
    resp = api.operator("patch", f"{API}/runs/low", json={"priority": 9, "token_budget": 10_000, "epochs": 3})
    assert resp.status_code == 200, resp.text
    assert (resp.json()["priority"], resp.json()["token_budget"], resp.json()["max_epochs"]) == (9, 10_000, 3)
    assert api.client.get(f"{API}/runs/low/config").json()["token_budget"] == 10_000
    assert [r["name"] for r in api.client.get(f"{API}/runs", params={"state": "active"}).json()] == ["low", "high"]
    resp = api.operator("patch", f"{API}/runs/low", json={"token_budget": None, "epochs": 0})
    assert (resp.json()["token_budget"], resp.json()["max_epochs"]) == (None, None)  # asked to repeat
    api.create_run(run_config("budgeted", token_budget=10_000, epochs=None))
    assert api.status("budgeted")["max_epochs"] is None  # the budget ends it
    resp = api.operator("patch", f"{API}/runs/budgeted", json={"token_budget": None})
    assert (resp.json()["token_budget"], resp.json()["max_epochs"]) == (None, 1)  # no budget: one epoch again
    bad = api.operator("patch", f"{API}/runs/low", json={"priority": "high"})
    assert bad.status_code == 422
    assert api.client.patch(f"{API}/runs/low", json={"priority": 1}).status_code == 401  # the operator's only
    assert api.client.get(f"{API}/runs", params={"state": "gone"}).status_code == 422


def test_archive_and_delete_refuse_with_a_reason(api, run):
    resp = api.operator("post", f"{API}/runs/t/archive")
    assert resp.status_code == 409 and "only a finished or paused run" in resp.json()["detail"]
    resp = api.operator("delete", f"{API}/runs/t")
    assert resp.status_code == 409 and "force" in resp.json()["detail"]
    assert api.client.delete(f"{API}/runs/t").status_code == 401
    assert api.operator("delete", f"{API}/runs/nope").status_code == 404
    assert api.status()["state"] == "active"  # nothing changed


def test_archive_keeps_the_final_model_and_drops_the_rest(api, run, make_delta):
    headers = api.register()
    for i in range(2):
        lease = api.lease(headers)
        api.accept(lease.lease_id, make_delta(lease, seed=i), headers)
    api.drain()
    assert api.operator("post", f"{API}/runs/t/pause").status_code == 200
    resp = api.operator("post", f"{API}/runs/t/archive")  # a paused run: finished first
    assert resp.status_code == 200, resp.text
    assert resp.json()["state"] == "archived" and resp.json()["finished_at"] is not None
    with api.db() as s:
        run_id = s.query(Run).one().id
    root = api.coordinator.storage.blobs.root / f"runs/{run_id}"
    assert not list((root / "shards").iterdir()) and not list((root / "deltas").glob("*.delta"))
    assert [p.name for p in (root / "snapshots").iterdir()] == ["0000000002.safetensors.zst"]
    assert len(list((root / "checkpoints").iterdir())) == 1
    assert (_export_dir(api, run_id) / "model.safetensors").is_file()
    assert api.client.get(f"{API}/runs/t/snapshots/latest").status_code == 200  # the final model stays served
    st = api.status()
    assert st["state"] == "archived" and st["merged_deltas"] == 2 and len(st["eval_history"]) >= 2
    assert api.operator("post", f"{API}/runs/t/archive").status_code == 409


def test_a_thread_still_holding_a_deleted_runs_model_writes_nothing_back(api, run, make_delta):
    """The merger's idle loop lists the live runs, then works on each: a run deleted in between must
    not get its folder back from a snapshot, a checkpoint or a merge step of the object it holds."""
    headers = api.register()
    lease = api.lease(headers)
    api.accept(lease.lease_id, make_delta(lease), headers)
    coord = api.coordinator
    (rt,) = coord.live.runtime_list()  # listed before the delete, as the idle loop would
    rt.version += 1  # a newer version than any snapshot: the catch-up would write one
    resp = api.operator("delete", f"{API}/runs/t", params={"force": "true"})
    assert resp.status_code == 200, resp.text
    assert rt.removed
    assert api.merger.step(rt) == 0
    assert not api.merger.catch_up_checkpoint(rt)
    assert not coord.recovery.snapshot_newest(rt)
    assert not (coord.storage.blobs.root / f"runs/{rt.run_id}").exists()


def test_delete_removes_every_row_and_file(api, run_config, run, make_delta):
    api.create_run(run_config("other"))
    headers = api.register()
    lease = api.lease(headers)
    api.accept(lease.lease_id, make_delta(lease), headers)
    api.drain()
    with api.db() as s:
        run_id = s.query(Run).filter_by(name="t").one().id
    resp = api.operator("delete", f"{API}/runs/t", params={"force": "true"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["rows"]["deltas"] == 1 and resp.json()["files"] > 4
    assert api.client.get(f"{API}/runs/t/status").status_code == 404
    assert not (api.coordinator.storage.blobs.root / f"runs/{run_id}").exists()
    with api.db() as s:
        assert {r.name for r in s.query(Run).all()} == {"other"}
        assert not s.query(Shard).filter_by(run_id=run_id).count()
        assert not s.query(Worker).filter_by(run_id=run_id).count()
        assert not s.query(EvalResult).filter_by(run_id=run_id).count()
    assert api.status("other")["state"] == "active"  # the other run is untouched
