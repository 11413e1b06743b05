"""`python -m idletrain coordinator serve|migrate` on a machine without the PostgreSQL driver: one line
saying `pip install 'idletrain[postgres]'`, a non-zero exit, no traceback, nothing started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Imported first by every Python process that has the folder on PYTHONPATH: psycopg looks uninstalled.
HIDE_PSYCOPG = "import sys\nsys.modules['psycopg'] = None\n"


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["coordinator", "serve", "--port", "0"],
    ["coordinator", "serve", "--port", "0", "--processes", "2"],
    ["coordinator", "migrate"],
], ids=["serve", "serve --processes 2", "migrate"])
def test_a_missing_driver_is_one_line_and_a_non_zero_exit(tmp_path, argv):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HIDE_PSYCOPG)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(REPO)])}
    env.pop("IDLETRAIN_DATABASE_URL", None)
    probe = subprocess.run([sys.executable, "-c", "import psycopg"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr  # the shim works
    done = subprocess.run([sys.executable, "-m", "idletrain", *argv, "--data-dir", str(tmp_path / "d"),
                           "--database-url", "postgresql+psycopg://idletrain:pw@127.0.0.1:1/idletrain"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == ["idletrain: --database-url postgresql+psycopg://idletrain:***@127.0.0.1:1/idletrain needs the "
                     "Python module 'psycopg', which is not installed: pip install 'idletrain[postgres]'"]
