"""Corpora only from allowed folders (coordinator/corpora.py, shared/data.py): a run's corpus is
served to every worker, so a path elsewhere would publish any file the coordinator can read."""

from __future__ import annotations

import os
import shutil

import pytest

from coordinator import corpora
from coordinator.errors import Unprocessable
from coordinator.settings import CoordinatorSettings
from shared.data import BUILTIN, load_corpus
from tests.conftest import API


@pytest.fixture
def secret(tmp_path):
    """A private file outside every allowed folder, big enough to be a corpus."""
    path = tmp_path / "private" / "secret.txt"
    path.parent.mkdir()
    path.write_text("SECRET-KEY-MATERIAL " * 2000)
    return path


def _refused(api, run_config, corpus: str) -> None:
    resp = api.client.post(f"{API}/runs", json=run_config(corpus=corpus), headers=api.admin)
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert "outside the folders" in detail and "IDLETRAIN_CORPUS_DIRS" in detail
    assert api.client.get(f"{API}/runs").json() == []  # no run, not even a half-made one


def test_a_corpus_outside_the_allowed_folders_is_refused(api, run_config, secret):
    _refused(api, run_config, str(secret))
    _refused(api, run_config, str(secret.parent))
    _refused(api, run_config, "/etc/passwd")


def test_dotdot_and_symlink_escapes_are_refused(api, run_config, corpus_dir, secret):
    escape = f"{corpus_dir}/{os.path.relpath(secret, corpus_dir)}"  # starts inside, `..` leads out
    assert escape.startswith(f"{corpus_dir}/..") and os.path.exists(escape)
    _refused(api, run_config, escape)
    corpora_dir = api.coordinator.settings.data_dir / "corpora"
    corpora_dir.mkdir(parents=True)
    (corpora_dir / "innocent.txt").symlink_to(secret)
    (corpora_dir / "folder").symlink_to(secret.parent)
    _refused(api, run_config, str(corpora_dir / "innocent.txt"))
    _refused(api, run_config, str(corpora_dir / "folder"))


def test_the_data_dirs_corpora_folder_and_the_builtin_are_allowed(api, run_config, corpus_dir):
    corpora_dir = api.coordinator.settings.data_dir / "corpora"
    shutil.copytree(corpus_dir, corpora_dir / "mine")
    assert api.create_run(run_config(corpus=str(corpora_dir / "mine")))["n_shards"] == 4
    assert corpora.confine(BUILTIN, []) == BUILTIN


def test_a_symlink_inside_an_allowed_folder_does_not_lead_out(tmp_path, corpus_dir, secret):
    folder = tmp_path / "allowed"
    shutil.copytree(corpus_dir, folder)
    os.symlink(secret, folder / "zz-leak.txt")
    loaded = load_corpus(str(folder), max_bytes=1 << 20)
    assert b"SECRET" not in loaded.train.tobytes() + loaded.eval.tobytes()
    assert loaded.n_files == len(list(corpus_dir.iterdir()))


def test_confine_resolves_before_checking(tmp_path):
    allowed = [tmp_path.resolve() / "ok"]
    assert corpora.confine(str(tmp_path / "ok" / "a" / ".." / "b.txt"), allowed) == str(allowed[0] / "b.txt")
    with pytest.raises(Unprocessable, match="outside"):
        corpora.confine(str(tmp_path / "ok" / ".." / "b.txt"), allowed)
    with pytest.raises(Unprocessable, match="outside"):
        corpora.confine(str(tmp_path / "okay-not"), allowed)  # a prefix is not a parent


def test_settings_read_corpus_dirs_comma_separated(tmp_path, monkeypatch):
    monkeypatch.setenv("IDLETRAIN_CORPUS_DIRS", f"{tmp_path / 'a'},{tmp_path / 'b'}")
    settings = CoordinatorSettings(data_dir=tmp_path / "d")
    assert settings.allowed_corpus_dirs == [(tmp_path / "d" / "corpora").resolve(), (tmp_path / "a").resolve(),
                                            (tmp_path / "b").resolve()]
