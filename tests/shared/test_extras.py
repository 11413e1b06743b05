"""shared.extras: an optional module that is missing is one line saying what to install."""

from __future__ import annotations

import sys

import pytest

from shared.extras import MissingExtra, available, require


def test_require_names_the_extra_or_the_install_command(monkeypatch):
    assert require("json", "nothing").dumps([1]) == "[1]"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra, match=r"^plotting needs the Python module 'matplotlib', which is not installed: "
                                           r"pip install -e '.\[bench\]'$"):
        require("matplotlib", "bench", purpose="plotting", install="pip install -e '.[bench]'")
    with pytest.raises(ImportError, match=r"pip install 'idletrain\[data\]'"):  # still an ImportError
        require("no_such_module_here", "data")


def test_require_tells_a_broken_install_from_a_missing_one(monkeypatch, tmp_path):
    (tmp_path / "halfinstalled.py").write_text("raise ImportError('no pq wrapper available')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingExtra, match=r"'halfinstalled', which does not load \(no pq wrapper available\): "
                                           r"pip install 'idletrain\[postgres\]'"):
        require("halfinstalled", "postgres")


def test_available(monkeypatch):
    assert available("json")
    monkeypatch.setitem(sys.modules, "psycopg", None)
    assert not available("psycopg") and not available("no_such_module_here")
