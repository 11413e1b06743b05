"""Registered teams (coordinator/services/teams.py): the operator creates one with a key, a worker
that registers with it is a verified member, the name is then taken only with the key, and the
members' live leases count against the team's cap per address, not max_leases_per_address."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from coordinator.models import Worker
from tests.conftest import API, write_corpus


def create_team(api, name: str, **body):
    return api.client.post(f"{API}/teams", json={"name": name, **body}, headers=api.admin)


def register(api, **body):
    return api.client.post(f"{API}/runs/t/workers", json=body)


@pytest.fixture
def api(open_api, settings):
    """The app, taking more registrations from one address at once than the default burst of 8."""
    with open_api(settings.model_copy(update={"register_burst": 100.0})) as a:
        yield a


@pytest.fixture
def lab(api, run) -> str:
    """The team "MIT Lab", registered; its key."""
    resp = create_team(api, "MIT Lab")
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body["name"] == "MIT Lab" and body["members"] == 0 and len(body["key"]) >= 24
    return body["key"]


def test_a_lab_behind_one_address_holds_its_leases(open_api, settings, run_config, tmp_path):
    """Issue 34, item 10: 40 members of a team with a key all hold a live lease from one address,
    while 40 workers of no registered team from that address are capped at max_leases_per_address
    (32, the default): 429, with what to do."""
    corpus = write_corpus(tmp_path / "big", n_files=100, file_bytes=1000)  # ~95 shards of 1024 tokens
    settings = settings.model_copy(update={"corpus_dirs": [corpus], "register_burst": 100.0})
    assert settings.max_leases_per_address == 32
    with open_api(settings) as api:
        api.create_run(run_config(corpus=str(corpus), shard_tokens=1024))
        key = create_team(api, "lab", max_leases_per_address=64).json()["key"]
        members = [api.register(name=f"desk{i}", team="lab", team_key=key) for i in range(40)]
        crowd = [api.register(name=f"other{i}") for i in range(40)]  # all from one address ("testclient")
        assert all(api.lease(m).lease_id for m in members)
        codes = [api.client.post(f"{API}/runs/t/leases", headers=w) for w in crowd]
        assert [r.status_code for r in codes] == [200] * 32 + [429] * 8
        assert "--team-key" in codes[-1].json()["detail"] and "max_leases_per_address" in codes[-1].json()["detail"]
        listed = api.client.get(f"{API}/teams", headers=api.admin).json()
        assert [(t["name"], t["members"], t["max_leases_per_address"]) for t in listed] == [("lab", 40, 64)]


def test_a_teams_own_cap_holds_its_members(open_api, settings, run_config):
    with open_api(settings) as api:
        api.create_run(run_config(shard_tokens=2048))  # 18 shards
        key = create_team(api, "lab", max_leases_per_address=2).json()["key"]
        members = [api.register(team="lab", team_key=key) for _ in range(3)]
        assert [api.client.post(f"{API}/runs/t/leases", headers=m).status_code for m in members] == [200, 200, 429]
        assert api.lease(api.register()).lease_id  # the others of the address count apart


def test_a_registered_team_is_taken_only_with_its_key(api, lab):
    from coordinator.models import Team

    for label in ("MIT Lab", "mit lab", "MIT  Lab", "M\u0406T Lab"):  # as registered, case, space, Cyrillic I
        resp = register(api, team=label)
        assert resp.status_code == 409, (label, resp.text)
        assert "--team-key" in resp.json()["detail"] and "'MIT Lab'" in resp.json()["detail"]
    wrong = register(api, team="MIT Lab", team_key="not-the-key")
    assert wrong.status_code == 403 and "wrong team key" in wrong.json()["detail"]
    assert register(api, team="mit lab", team_key=lab).status_code == 201  # shown as registered
    assert register(api, team="blue").status_code == 201  # a label no team registered: as before
    stray = register(api, team="blue", team_key=lab)
    assert stray.status_code == 422 and "no team named 'blue'" in stray.json()["detail"]
    alone = register(api, team_key=lab)
    assert alone.status_code == 422 and "--team NAME" in alone.json()["detail"]
    workers = api.client.get(f"{API}/runs/t/workers", headers=api.admin).json()
    assert [(w["team"], w["team_verified"]) for w in workers] == [("MIT Lab", True), ("blue", False)]
    with api.db() as s:
        (team_id,) = s.scalars(select(Team.id)).all()
        assert s.scalars(select(Worker.team_id).order_by(Worker.id)).all() == [team_id, None]
        assert s.scalar(select(Team.key_hash)) != lab  # stored hashed


def test_creating_and_deleting_teams(api, lab):
    for name in ("MIT Lab", "mit lab", "MlT Lab"):  # taken, and a lookalike (small L for capital I)
        resp = create_team(api, name)
        assert resp.status_code == 409 and "'MIT Lab'" in resp.json()["detail"], resp.text
    assert create_team(api, "bad\nname").status_code == 422
    assert create_team(api, "x", max_leases_per_address=0).status_code == 422
    assert api.client.post(f"{API}/teams", json={"name": "nokey"}).status_code == 401
    assert register(api, name="ann", team="MIT Lab", team_key=lab).status_code == 201
    gone = api.client.delete(f"{API}/teams/MIT Lab", headers=api.admin)
    assert gone.status_code == 200 and gone.json()["members"] == 1 and gone.json()["key"] is None
    assert api.client.delete(f"{API}/teams/MIT Lab", headers=api.admin).status_code == 404
    assert register(api, team="MIT Lab").status_code == 201  # a plain label again
    workers = api.client.get(f"{API}/runs/t/workers", headers=api.admin).json()
    assert [(w["team"], w["team_verified"]) for w in workers] == [("MIT Lab", False), ("MIT Lab", False)]


def test_the_worker_joins_its_team_with_the_key(api, lab, tmp_path):
    """worker/connection.py sends --team-key (team_key in worker.toml) with the registration."""
    from shared import protocol
    from worker.caches import TokenStore
    from worker.connection import Connection
    from worker.control import StopFlag
    from worker.settings import WorkerSettings

    class Client:  # the worker's CoordinatorClient, over the in-process app
        token = None

        def register(self, run_name: str, req: protocol.RegisterRequest) -> protocol.RegisterResponse:
            resp = register(api, **req.model_dump(exclude_none=True))
            assert resp.status_code == 201, resp.text
            return protocol.RegisterResponse.model_validate(resp.json())

    settings = WorkerSettings(coordinator="http://127.0.0.1:9", run="t", team="MIT Lab", team_key=lab,
                              state_dir=tmp_path / "desk")
    Connection(Client(), settings, TokenStore(settings.state_dir), StopFlag(), device_type="cpu").ensure_token()
    (worker,) = api.client.get(f"{API}/runs/t/workers", headers=api.admin).json()
    assert worker["team"] == "MIT Lab" and worker["team_verified"]
