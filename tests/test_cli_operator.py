"""The operator's commands (`idletrain run list|show|pause|resume`, `idletrain worker
list|revoke|readmit`) against the in-process coordinator, and their error messages."""

from __future__ import annotations

import shutil

import httpx
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

        def request(method, url, *, timeout, headers, **body):
            assert url.startswith(URL)
            return api.client.request(method, url[len(URL):], headers=headers, **body)

        monkeypatch.setattr(httpx, "request", request)
        monkeypatch.delenv("IDLETRAIN_ADMIN_TOKEN", raising=False)
        monkeypatch.delenv("IDLETRAIN_DATA_DIR", raising=False)
        monkeypatch.chdir(tmp_path)  # no ./idletrain-data/admin_token but the test's own
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
    with api.db() as s:
        s.execute(update(Worker).where(Worker.name == "mallory").values(
            standing="banned", standing_reason="4 of its last 5 deltas rejected; last: norm 9.1 is 40.0x the median"))
        s.commit()
    assert run("worker", "list", "--run", "t", "--admin-token", TOKEN) == 0
    out = capsys.readouterr().out
    assert "alice" in out and "blue" in out and "banned" in out and "why: 4 of its last 5 deltas rejected" in out
    assert run("status", "--run", "t") == 0  # the public status counts flagged workers, never says why
    out = capsys.readouterr().out
    assert "0 worker(s) throttled, 1 banned" in out and "mallory" not in out and "deltas rejected" not in out
    assert run("status", "--run", "t", "--admin-token", TOKEN) == 0  # the operator sees who and why
    assert "worker 2 (mallory) is banned: 4 of its last 5" in capsys.readouterr().out
    assert run("worker", "readmit", "2", "--run", "t", "--admin-token", TOKEN) == 0
    assert "standing ok" in capsys.readouterr().out
    assert run("worker", "revoke", "1", "--run", "t", "--admin-token", TOKEN) == 0
    assert "revoked" in capsys.readouterr().out
    assert run("worker", "revoke", "99", "--run", "t", "--admin-token", TOKEN) == 2
    err = capsys.readouterr().err
    assert "404" in err and "no worker 99" in err


def test_team_create_list_delete_and_the_worker_list(api, capsys):
    assert run("team", "create", "MIT Lab", "--max-leases-per-address", "64", "--admin-token", TOKEN) == 0
    out = capsys.readouterr().out
    key = out.split("team key (shown once; the coordinator keeps only its hash): ")[1].split()[0]
    assert "live leases per address: 64" in out and '--team "MIT Lab" --team-key KEY' in out
    api.register(name="ann", team="mit lab", team_key=key)
    api.register(name="bob", team="blue")
    assert run("worker", "list", "--run", "t", "--admin-token", TOKEN) == 0
    out = capsys.readouterr().out
    assert "MIT Lab*" in out and "blue " in out and "team*: a verified member" in out
    assert run("team", "list", "--admin-token", TOKEN) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("MIT Lab")]
    assert line.split()[2:4] == ["1", "64"]
    assert run("team", "create", "mit lab", "--admin-token", TOKEN) == 2
    assert "409" in capsys.readouterr().err
    assert run("team", "delete", "MIT Lab", "--admin-token", TOKEN) == 0
    assert "1 member(s) keep working" in capsys.readouterr().out
    assert run("team", "delete", "MIT Lab", "--admin-token", TOKEN) == 2
    assert "404" in capsys.readouterr().err and run("team", "list") == 2  # without the admin token


@pytest.fixture
def generated(tmp_path, open_api, run_config, monkeypatch):
    """A coordinator with no token given: it generated one in its data dir (tmp_path/data)."""
    data_dir = tmp_path / "data"
    with open_api(CoordinatorSettings(data_dir=data_dir)) as api:
        api.create_run(run_config())

        def request(method, url, *, timeout, headers):
            return api.client.request(method, url[len(URL):], headers=headers)

        monkeypatch.setattr(httpx, "request", request)
        monkeypatch.delenv("IDLETRAIN_ADMIN_TOKEN", raising=False)
        monkeypatch.delenv("IDLETRAIN_DATA_DIR", raising=False)
        monkeypatch.chdir(tmp_path)
        yield api, data_dir


def test_operator_commands_find_the_token_in_the_data_dir(generated, capsys, monkeypatch, tmp_path):
    api, data_dir = generated
    assert run("run", "pause", "t", "--data-dir", str(data_dir)) == 0
    assert capsys.readouterr().out.strip() == "run t is paused"
    monkeypatch.setenv("IDLETRAIN_DATA_DIR", str(data_dir))  # as the coordinator's own environment says
    assert run("run", "resume", "t") == 0
    monkeypatch.delenv("IDLETRAIN_DATA_DIR")
    default = tmp_path / "idletrain-data"  # the default: `serve` ran in this directory
    default.mkdir()
    shutil.copy2(data_dir / "admin_token", default / "admin_token")
    assert run("worker", "list", "--run", "t") == 0
    assert api.status()["state"] == "active"


def test_operator_commands_without_a_token_say_where_to_find_one(generated, capsys, tmp_path):
    api, data_dir = generated
    assert run("run", "pause", "t", "--data-dir", str(tmp_path / "elsewhere")) == 2
    err = capsys.readouterr().err
    assert "401" in err and "--admin-token" in err and "IDLETRAIN_ADMIN_TOKEN" in err and "--data-dir" in err
    assert "Traceback" not in err
    assert api.status()["state"] == "active"
    (data_dir / "admin_token").chmod(0o644)  # readable by anyone: refused, not used
    assert run("run", "pause", "t", "--data-dir", str(data_dir)) == 2
    err = capsys.readouterr().err
    assert "chmod 600" in err and "Traceback" not in err
    assert api.status()["state"] == "active"


def test_run_create_without_a_token_says_where_to_find_one(generated, capsys, monkeypatch, run_config):
    api, data_dir = generated
    sent = {}

    def post(url, *, json, headers, timeout):
        sent.update(headers=headers)
        return api.client.post(url[len(URL):], json=json, headers=headers)

    monkeypatch.setattr(httpx, "post", post)
    assert cli.main(["run", "create", "u", "--coordinator", URL, "--corpus", run_config()["corpus"],
                     "--data-dir", str(data_dir.parent / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "401" in err and "--data-dir" in err and "Traceback" not in err
    assert [r["name"] for r in api.client.get("/api/v1/runs").json()] == ["t"]
    assert cli.main(["run", "create", "u", "--coordinator", URL, "--corpus", run_config()["corpus"],
                     "--data-dir", str(data_dir), "--corpus-max-bytes", str(1 << 18), "--shard-tokens", "8192",
                     "--eval-tokens", "4096", "--n-layer", "1", "--d-model", "32", "--n-head", "2",
                     "--context", "32"]) == 0
    assert sent["headers"]["Authorization"] == f"Bearer {(data_dir / 'admin_token').read_text().strip()}"
    assert [r["name"] for r in api.client.get("/api/v1/runs").json()] == ["t", "u"]


# -- the model: presets and what a worker needs ----------------------------------------------------

def test_model_presets_from_toml_and_flags(tmp_path):
    from idletrain.cli import operator
    from shared.model import PRESETS, ModelConfig

    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "small"\ncontext = 256\nrope_theta = 500000\n')
    cfg = operator.build_run_config("p", str(path), {"model.n_layer": 4})
    assert cfg.model == ModelConfig(**{**PRESETS["small"], "context": 256, "rope_theta": 500000.0, "n_layer": 4})
    cfg = operator.build_run_config("p", None, {"model.preset": "gpt2-124m", "model.context": 128})
    assert (cfg.model.arch, cfg.model.vocab_size, cfg.model.d_model, cfg.model.context) == ("gpt", 50257, 768, 128)
    with pytest.raises(ValueError, match="unknown model preset 'medium'"):
        operator.build_run_config("p", None, {"model.preset": "medium"})


def test_run_create_with_a_preset_says_what_a_worker_needs(api, capsys, run_config, monkeypatch):
    from worker import memory

    monkeypatch.setattr(httpx, "post", lambda url, *, json, headers, timeout: api.client.post(
        url[len(URL):], json=json, headers=headers))
    corpus = run_config()["corpus"]
    assert run("run", "create", "llama", "--model-preset", "llama-tiny", "--corpus", corpus, "--corpus-max-bytes",
               str(1 << 18), "--shard-tokens", "8192", "--eval-tokens", "4096", "--admin-token", TOKEN) == 0
    got = capsys.readouterr()
    assert '"name": "llama"' in got.out
    cfg = api.client.get("/api/v1/runs/llama/config").json()["model"]
    assert cfg["arch"] == "llama" and cfg["n_layer"] == 3 and cfg["d_model"] == 128
    from shared.model import ModelConfig

    need = memory.min_max_params(ModelConfig.from_dict(cfg), batch_size=16)
    assert "model: llama, 672,640 parameters" in got.err and f"{need:,} for whole batches of 16" in got.err
    # the free memory each needs is said once when the two round alike (no "0.1 GB and 0.1 GB")
    assert "needs under 0.1 GB free for either" in got.err or "free for the first" in got.err, got.err


def test_run_create_sets_the_outer_warmup_and_says_which_workers_an_int2_run_needs(api, capsys, run_config,
                                                                                    monkeypatch):
    monkeypatch.setattr(httpx, "post", lambda url, *, json, headers, timeout: api.client.post(
        url[len(URL):], json=json, headers=headers))
    corpus = run_config()["corpus"]
    common = ["--corpus", corpus, "--corpus-max-bytes", str(1 << 18), "--shard-tokens", "8192", "--eval-tokens", "4096",
              "--admin-token", TOKEN]
    assert run("run", "create", "warm", "--outer-warmup", "4", *common) == 0
    assert api.client.get("/api/v1/runs/warm/config").json()["outer"]["warmup"] == 4
    assert "API v" not in capsys.readouterr().err  # a version-2 worker takes its leases
    assert run("run", "create", "sparse", "--compression", "topk", "--fraction", "0.02", "--values", "int2",
               "--feedback-decay", "0.95", "--outer-momentum", "0", *common) == 0
    assert ("Its leases need workers of API v3 or later (compression values 'int2', feedback_decay 0.95): older "
            "ones are told to upgrade.") in capsys.readouterr().err
