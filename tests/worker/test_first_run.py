"""The first `idletrain worker run` on a terminal (worker/firstrun.py, idletrain/cli/volunteer.py):
asked always-or-idle once, idle by default, saved in worker.toml; never asked without a terminal
or when `when` is set anywhere. The terminal is a seam (a fake TTY and fake keyboard)."""

from __future__ import annotations

import os
import tomllib

import pytest

import worker.loop
from idletrain import cli
from idletrain.cli import volunteer
from worker import firstrun
from worker.settings import ENV_PREFIX


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


@pytest.fixture
def started(monkeypatch):
    """run_worker replaced: the settings the worker would have started with."""
    seen = []
    monkeypatch.setattr(worker.loop, "run_worker", lambda settings: seen.append(settings) or 0)
    return seen


def keyboard(monkeypatch, *answers):
    """A person at a terminal typing `answers`; returns the prompts they saw."""
    prompts, typed = [], list(answers)

    def read(prompt):
        prompts.append(prompt)
        if not typed:
            raise EOFError
        return typed.pop(0)

    monkeypatch.setattr(volunteer, "on_terminal", lambda: True)
    monkeypatch.setattr("builtins.input", read)
    return prompts


RUN = ["worker", "run", "--coordinator", "http://127.0.0.1:1", "--run", "r"]


def test_an_empty_answer_saves_idle_in_the_default_config_file(monkeypatch, tmp_path, started, capsys):
    prompts = keyboard(monkeypatch, "")
    assert cli.main(RUN + ["--state-dir", str(tmp_path / "s")]) == 0
    assert prompts == [firstrun.QUESTION] and "[idle/always]" in prompts[0]
    saved = tmp_path / "xdg" / "idletrain" / "worker.toml"
    assert tomllib.loads(saved.read_text()) == {"when": "idle"}
    assert started[0].when == "idle" and started[0].battery_policy() == "pause"
    assert f"in {saved}" in capsys.readouterr().out
    # the next start asks nothing: the file says it
    again = keyboard(monkeypatch, "always")
    assert cli.main(RUN) == 0
    assert again == [] and started[1].when == "idle"


def test_always_is_saved_beside_what_the_file_already_holds(monkeypatch, tmp_path, started):
    path = tmp_path / "w.toml"
    path.write_text('# mine\ncoordinator = "http://127.0.0.1:2"\nrun = "r"\n\n[extra]\nx = 1\n')
    keyboard(monkeypatch, "maybe", "ALWAYS")
    assert cli.main(["worker", "run", "--config", str(path), "--state-dir", str(tmp_path / "s")]) == 2  # [extra]
    assert tomllib.loads(path.read_text()) == {"when": "always", "coordinator": "http://127.0.0.1:2", "run": "r",
                                               "extra": {"x": 1}}  # a top-level key, before the table
    assert path.read_text().startswith('# mine\nwhen = "always"\n')


@pytest.mark.parametrize("how", ["flag", "env", "file", "no terminal"])
def test_nobody_is_asked_when_the_choice_is_made_or_nobody_is_there(monkeypatch, tmp_path, started, how):
    prompts = keyboard(monkeypatch, "idle")
    argv = RUN + ["--state-dir", str(tmp_path / "s")]
    config = tmp_path / "xdg" / "idletrain" / "worker.toml"
    if how == "flag":
        argv += ["--when", "always"]
    elif how == "env":
        monkeypatch.setenv("IDLETRAIN_WORKER_WHEN", "always")
    elif how == "file":
        config.parent.mkdir(parents=True)
        config.write_text('when = "always"\n')
    else:
        monkeypatch.setattr(volunteer, "on_terminal", lambda: False)
    assert cli.main(argv) == 0
    assert prompts == []
    assert started[0].when == "always"  # the default without a terminal: as a service expects
    assert config.is_file() == (how == "file")


def test_answers_are_read_kindly():
    assert [firstrun.parse_answer(t) for t in ("", " i ", "Idle", "a", "always", "sometimes")] == [
        "idle", "idle", "idle", "always", "always", None]
    said = []
    answers = iter(["x", "y", "z"])
    assert firstrun.ask_when(lambda q: next(answers), said.append) == "idle"  # three misses: the default
    assert said == ["Please answer idle or always."] * 3


def test_a_file_that_cannot_be_written_still_uses_the_answer(monkeypatch, tmp_path, started, capsys):
    keyboard(monkeypatch, "always")
    blocker = tmp_path / "xdg"
    blocker.write_text("a file where the config folder should be")
    assert cli.main(RUN + ["--state-dir", str(tmp_path / "s")]) == 0
    assert started[0].when == "always"
    assert "Could not save the answer" in capsys.readouterr().out


def test_the_real_terminal_check_needs_both_ends(monkeypatch):
    class Stream:
        def __init__(self, tty):
            self.tty = tty

        def isatty(self):
            return self.tty

    for stdin, stdout, expected in ((True, True, True), (True, False, False), (False, True, False)):
        monkeypatch.setattr("sys.stdin", Stream(stdin))
        monkeypatch.setattr("sys.stdout", Stream(stdout))
        assert volunteer.on_terminal() is expected
