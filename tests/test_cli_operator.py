"""The operator's commands (`idletrain run list|show|pause|resume`, `idletrain worker
list|revoke|readmit`) against the in-process coordinator, and their error messages."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from coordinator.models import Worker
from coordinator.settings import CoordinatorSettings
from idletrain import cli

TOKEN = "operator-secret-0123456789"
URL = "http://coordinator.test"


@pytest.fixture
def api(tmp_path, open_api, run_config, monkeypatch):
    with open_api(CoordinatorSettings(data_dir=tmp_path / "coord", admin_token=TOKEN)) as api:
        api.create_run(run_config(), headers={"Authorization": f"Bearer {TOKEN}"})

        def request(method, url, *, timeout, headers):
            assert url.startswith(URL)
            return api.client.request(method, url[len(URL):], headers=headers)

        monkeypatch.setattr(cli.httpx, "request", request)
        monkeypatch.delenv("IDLETRAIN_ADMIN_TOKEN", raising=False)
        yield api


def run(*argv) -> int:
    return cli.main([*argv, "--coordinator", URL])


def test_run_list_show_pause_resume(api, capsys):
    assert run("run", "list") == 0
    assert capsys.readouterr().out.startswith("t ")
    assert run("run", "pause", "t", "--admin-token", TOKEN) == 0
    assert capsys.readouterr().out.strip() == "run t is paused"
    assert run("run", "show", "t") == 0
    out = capsys.readouterr().out
    assert "run t [paused] version 0" in out and "algorithm diloco" in out and "shards 0/4 done" in out
    assert run("run", "resume", "t", "--admin-token", TOKEN) == 0
    assert "active" in capsys.readouterr().out


def test_operator_commands_need_the_admin_token(api, capsys, monkeypatch):
    assert run("run", "pause", "t") == 2
    assert "401" in (err := capsys.readouterr().err) and "IDLETRAIN_ADMIN_TOKEN" in err
    assert run("worker", "list", "--run", "t", "--admin-token", "wrong-token-0123456789") == 2
    assert "403" in capsys.readouterr().err
    monkeypatch.setenv("IDLETRAIN_ADMIN_TOKEN", TOKEN)  # the environment works too
    assert run("run", "pause", "t") == 0


def test_worker_list_revoke_readmit(api, capsys):
    api.register(name="alice", team="blue")
    api.register(name="mallory")
    with api.coordinator.sessions() as s:
        s.execute(update(Worker).where(Worker.name == "mallory").values(
            standing="banned", standing_reason="4 of its last 5 deltas rejected; last: norm 9.1 is 40.0x the median"))
        s.commit()
    assert run("worker", "list", "--run", "t", "--admin-token", TOKEN) == 0
    out = capsys.readouterr().out
    assert "alice" in out and "blue" in out and "banned" in out and "why: 4 of its last 5 deltas rejected" in out
    assert run("status", "--run", "t") == 0
    assert "worker 2 (mallory) is banned: 4 of its last 5" in capsys.readouterr().out
    assert run("worker", "readmit", "2", "--run", "t", "--admin-token", TOKEN) == 0
    assert "standing ok" in capsys.readouterr().out
    assert run("worker", "revoke", "1", "--run", "t", "--admin-token", TOKEN) == 0
    assert "revoked" in capsys.readouterr().out
    assert run("worker", "revoke", "99", "--run", "t", "--admin-token", TOKEN) == 2
    err = capsys.readouterr().err
    assert "404" in err and "no worker 99" in err
