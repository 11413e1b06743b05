"""`idletrain run set|finish|archive|delete` and run create's lifecycle flags: what each sends, and
the refusals that need no coordinator (tests/e2e/test_lifecycle.py runs them against a real one)."""

from __future__ import annotations

import argparse

import httpx
import pytest

from idletrain import cli
from idletrain.cli.lifecycle import token_count
from idletrain.cli.operator import build_run_config


@pytest.mark.parametrize(("text", "tokens"), [("2000000000", 2_000_000_000), ("2_000_000_000", 2_000_000_000),
                                               ("2e9", 2_000_000_000), ("500M", 500_000_000), ("1.5G", 1_500_000_000),
                                               ("10k", 10_000), ("3B", 3_000_000_000), ("1T", 10**12)])
def test_token_counts_read_as_operators_write_them(text, tokens):
    assert token_count(text) == tokens


@pytest.mark.parametrize("text", ["", "lots", "-5", "0", "1.5", "2e9x", "5 MB"])
def test_what_is_not_a_token_count_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="token"):
        token_count(text)


def test_run_create_takes_the_lifecycle_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "create", "r", "--token-budget", "lots"])
    assert exc.value.code == 2 and "not a token count" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["run", "create", "r", "--token-budget", "500M", "--epochs", "0",
                                          "--priority", "3"])
    cfg = build_run_config("r", None, {"token_budget": args.token_budget, "epochs": args.epochs,
                                       "priority": args.priority})
    assert (cfg.token_budget, cfg.epochs, cfg.priority, cfg.max_epochs()) == (500_000_000, 0, 3, None)
    assert build_run_config("r", None, {}).max_epochs() == 1  # without a budget: one epoch
    assert build_run_config("r", None, {"token_budget": 10**6}).max_epochs() is None  # the budget ends it


def _sent(monkeypatch) -> list[dict]:
    sent: list[dict] = []

    def request(method, url, **kw):
        sent.append({"method": method, "url": url, **kw})
        return httpx.Response(200, json={"name": "r", "state": "finishing", "tokens_trained": 10, "token_budget": 20,
                                          "epoch": 0, "max_epochs": None, "priority": 2, "rows": {"runs": 1},
                                          "files": 3}, request=httpx.Request(method, url))

    monkeypatch.setattr(httpx, "request", request)
    return sent


def test_each_command_sends_what_it_says(monkeypatch, capsys):
    sent = _sent(monkeypatch)
    base = ["--coordinator", "http://127.0.0.1:9", "--admin-token", "t"]
    assert cli.main(["run", "set", "r", "--priority", "2", "--token-budget", "none", *base]) == 0
    assert cli.main(["run", "finish", "r", "--grace", "60", *base]) == 0
    assert cli.main(["run", "archive", "r", *base]) == 0
    assert cli.main(["run", "delete", "r", "--yes", "--force", *base]) == 0
    assert [(s["method"], s["url"].removeprefix("http://127.0.0.1:9/api/v1")) for s in sent] == [
        ("PATCH", "/runs/r"), ("POST", "/runs/r/finish"), ("POST", "/runs/r/archive"), ("DELETE", "/runs/r")]
    assert sent[0]["json"] == {"priority": 2, "token_budget": None}
    assert sent[1]["params"] == {"grace_s": 60.0} and sent[3]["params"] == {"force": "true"}
    assert all(s["headers"] == {"Authorization": "Bearer t"} for s in sent)
    out = capsys.readouterr().out
    assert "run r is finishing: 10 of 20 tokens, epochs repeat, priority 2" in out and "run r deleted: 1 rows" in out


def test_refusals_before_any_request(monkeypatch, capsys):
    sent = _sent(monkeypatch)
    base = ["--coordinator", "http://127.0.0.1:9", "--admin-token", "t"]
    assert cli.main(["run", "delete", "r", *base]) == 2
    assert "pass --yes" in capsys.readouterr().err
    assert cli.main(["run", "set", "r", *base]) == 2
    assert "--priority, --token-budget or --epochs" in capsys.readouterr().err
    assert cli.main(["run", "finish", "r", "--grace", "-1", *base]) == 2
    assert sent == []


def test_the_coordinators_refusal_is_said_with_exit_2(monkeypatch, capsys):
    def request(method, url, **kw):
        return httpx.Response(409, json={"detail": "run 'r' is active: only a finished or paused run is archived"},
                              request=httpx.Request(method, url))

    monkeypatch.setattr(httpx, "request", request)
    assert cli.main(["run", "archive", "r", "--coordinator", "http://127.0.0.1:9", "--admin-token", "t"]) == 2
    assert "409: run 'r' is active: only a finished or paused run is archived" in capsys.readouterr().err


def test_the_run_toml_holds_the_lifecycle(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('token_budget = 2000000000\nepochs = 3\npriority = -2\n[inner]\nsteps = 10\n')
    cfg = build_run_config("r", str(toml), {"priority": 4})  # a flag wins over the file
    assert (cfg.token_budget, cfg.max_epochs(), cfg.priority, cfg.inner.steps) == (2_000_000_000, 3, 4, 10)
