"""worker.settings: flags > IDLETRAIN_WORKER_* > worker.toml > defaults; the CLI's worker flags;
the device auto-pick (CUDA, then MPS, then CPU)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from idletrain import cli
from worker.settings import (
    WorkerSettings,
    default_config_file,
    describe_errors,
    load_settings,
    resolve_state_dir,
)
from worker.trainer import pick_device


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No IDLETRAIN_WORKER_* from the machine, and a config home of our own."""
    import os

    for key in list(os.environ):
        if key.startswith("IDLETRAIN_WORKER_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


FILE = '''
coordinator = "http://from-file:8000/"
run = "file-run"
when = "idle"
idle_minutes = 7
max_upload_kbps = 800
daily_transfer_mb = 50
'''


def test_precedence_flags_over_env_over_file_over_defaults(monkeypatch, tmp_path):
    path = write(tmp_path / "w.toml", FILE)
    s = load_settings({}, config=path)
    assert (s.coordinator, s.run, s.when, s.idle_minutes) == ("http://from-file:8000", "file-run", "idle", 7)
    assert s.max_upload_kbps == 800 and s.max_download_kbps is None  # unset: the default
    assert s.checkpoint_every_steps == 25
    monkeypatch.setenv("IDLETRAIN_WORKER_IDLE_MINUTES", "9")
    monkeypatch.setenv("IDLETRAIN_WORKER_RUN", "env-run")
    s = load_settings({"run": None, "idle_minutes": None}, config=path)  # None: flag not given
    assert (s.run, s.idle_minutes, s.when) == ("env-run", 9, "idle")
    s = load_settings({"idle_minutes": 2, "when": "always"}, config=path)
    assert (s.run, s.idle_minutes, s.when) == ("env-run", 2, "always")


def test_the_default_config_file_is_read_when_present(tmp_path):
    with pytest.raises(ValidationError):
        load_settings({})  # no file yet: coordinator and run are missing
    write(default_config_file(), FILE)
    assert default_config_file() == tmp_path / "xdg" / "idletrain" / "worker.toml"
    assert load_settings({}).run == "file-run"


def test_the_config_path_may_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("IDLETRAIN_WORKER_CONFIG", str(write(tmp_path / "elsewhere.toml", FILE)))
    assert load_settings({}).daily_transfer_mb == 50


def test_worker_settings_alone_read_no_file(tmp_path):
    write(default_config_file(), FILE)
    s = WorkerSettings(coordinator="http://c", run="r")
    assert s.when == "always" and s.max_upload_kbps is None


@pytest.mark.parametrize("text, words", [
    ('coordinator = "http://c"\nrun = "r"\nwhen = "sometimes"\n', ["when"]),
    ('coordinator = "http://c"\nrun = "r"\nidle_minuts = 3\n', ["idle_minuts", "not a worker setting"]),
    ('coordinator = "http://c"\nrun = "r"\nmax_upload_kbps = -1\n', ["max_upload_kbps"]),
    # below 64 kbit/s a coordinator's body rate floor (2 KB/s by default) would cut every delta off
    ('coordinator = "http://c"\nrun = "r"\nmax_upload_kbps = 10\n', ["max_upload_kbps", "64"]),
])
def test_bad_values_in_the_file_are_named(tmp_path, text, words):
    with pytest.raises(ValidationError) as info:
        load_settings({}, config=write(tmp_path / "w.toml", text))
    message = describe_errors(info.value)
    for word in words:
        assert word in message


def test_a_missing_value_says_where_it_can_come_from():
    with pytest.raises(ValidationError) as info:
        load_settings({"run": "r"})
    message = describe_errors(info.value)
    assert "--coordinator" in message and "IDLETRAIN_WORKER_COORDINATOR" in message and "worker.toml" in message


def test_broken_or_absent_config_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_settings({}, config=tmp_path / "absent.toml")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_settings({}, config=write(tmp_path / "w.toml", "when = [idle\n"))


def test_battery_default_follows_when():
    base = {"coordinator": "http://c", "run": "r"}
    assert WorkerSettings(**base).rules().on_battery == "run"
    assert WorkerSettings(**base, when="idle").rules().on_battery == "pause"
    assert WorkerSettings(**base, when="idle", on_battery="run").rules().on_battery == "run"
    rules = WorkerSettings(**base, when="idle", idle_minutes=2, daily_transfer_mb=1.5).rules()
    assert rules.idle_s == 120 and rules.daily_transfer_bytes == 1_500_000


def test_state_dir_for_the_local_commands(monkeypatch, tmp_path):
    assert resolve_state_dir(None) == tmp_path / "xdg" / "idletrain"
    path = write(tmp_path / "w.toml", 'state_dir = "/srv/idletrain"\n')
    assert str(resolve_state_dir(None, config=path)) == "/srv/idletrain"
    monkeypatch.setenv("IDLETRAIN_WORKER_STATE_DIR", str(tmp_path / "env"))
    assert resolve_state_dir(None, config=path) == tmp_path / "env"
    assert resolve_state_dir(tmp_path / "flag", config=path) == tmp_path / "flag"


# -- the command line -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["worker", "pause"], ["worker", "resume"], ["worker", "status"]])
def test_local_worker_commands_have_help(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--help"])
    assert info.value.code == 0
    assert "--state-dir" in capsys.readouterr().out


def test_worker_run_lists_the_manners_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["worker", "run", "--help"])
    out = capsys.readouterr().out
    for flag in ("--config", "--when", "--idle-minutes", "--on-battery", "--max-upload-kbps", "--max-download-kbps",
                 "--daily-transfer-mb", "--threads"):
        assert flag in out


def test_worker_run_flags_reach_the_settings(monkeypatch, tmp_path):
    seen = {}

    def fake_run_worker(settings):
        seen["settings"] = settings
        return 0

    import worker.loop

    monkeypatch.setattr(worker.loop, "run_worker", fake_run_worker)
    path = write(tmp_path / "w.toml", FILE)
    code = cli.main(["worker", "run", "--config", str(path), "--when", "always", "--on-battery", "pause",
                     "--max-download-kbps", "2000", "--daily-transfer-mb", "5", "--state-dir", str(tmp_path / "s")])
    assert code == 0
    s = seen["settings"]
    assert (s.coordinator, s.run) == ("http://from-file:8000", "file-run")  # from the file
    assert (s.when, s.on_battery, s.max_download_kbps, s.daily_transfer_mb) == ("always", "pause", 2000, 5)
    assert s.max_upload_kbps == 800 and s.idle_minutes == 7


def test_worker_run_without_a_coordinator_says_where_to_give_one(capsys, tmp_path):
    assert cli.main(["worker", "run", "--run", "t", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "coordinator: missing" in err and "--coordinator" in err


def test_worker_run_with_a_broken_config_file(capsys, tmp_path):
    assert cli.main(["worker", "run", "--config", str(write(tmp_path / "w.toml", "x = [\n"))]) == 2
    assert "not valid TOML" in capsys.readouterr().err


# -- the device auto-pick -------------------------------------------------------------------------------

@pytest.fixture
def accelerators(monkeypatch):
    """set(cuda=..., mps=...) fakes what torch reports."""
    if getattr(torch.backends, "mps", None) is None:
        pytest.skip("this torch has no MPS backend module")

    def set_(*, cuda: bool, mps: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)

    return set_


@pytest.mark.parametrize("cuda, mps, picked", [(True, True, "cuda"), (True, False, "cuda"), (False, True, "mps"),
                                               (False, False, "cpu")])
def test_auto_picks_cuda_then_mps_then_cpu(accelerators, cuda, mps, picked):
    accelerators(cuda=cuda, mps=mps)
    assert pick_device("auto").type == picked


def test_an_explicit_mps_request_is_honoured_when_available(accelerators):
    accelerators(cuda=True, mps=True)
    assert pick_device("mps").type == "mps" and pick_device("cpu").type == "cpu"
