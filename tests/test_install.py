"""A worker-only install: the package without its `server` extra runs the worker and the
volunteer's commands, and the coordinator's commands say what to install (one line, exit 2).

A fresh Python process is given a world where the server stack is not installed (each module set to
None in sys.modules: `import` raises ModuleNotFoundError and importlib.util.find_spec answers None,
as for a missing package); then it imports every module of worker/ and shared/ and the whole CLI,
and runs `idletrain worker run --help` and the server's commands."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVER_STACK = ["fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "numba", "prometheus_client",
                "httptools", "uvloop", "psycopg"]

SCRIPT = textwrap.dedent("""
    import contextlib, importlib, io, json, pkgutil, sys
    blocked = json.loads(sys.argv[1])
    for name in blocked:
        sys.modules[name] = None  # "not installed"

    from idletrain.cli import main
    import idletrain.cli.volunteer

    result = {"imported": [], "failed": {}}
    for package in ("worker", "shared"):
        pkg = importlib.import_module(package)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=package + "."):
            try:
                importlib.import_module(info.name)
                result["imported"].append(info.name)
            except ImportError as exc:
                result["failed"][info.name] = repr(exc)

    def run(argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code
        return {"code": code, "out": out.getvalue(), "err": err.getvalue()}

    result["worker_help"] = run(["worker", "run", "--help"])
    result["serve"] = run(["coordinator", "serve", "--data-dir", sys.argv[2]])
    result["migrate"] = run(["coordinator", "migrate", "--data-dir", sys.argv[2]])
    result["demo"] = run(["demo", "--minutes", "0.1"])
    from shared import kernels
    result["kernels"] = kernels.ready()
    result["loaded"] = sorted(m.split(".")[0] for m in sys.modules if sys.modules[m] is not None
                              and m.split(".")[0] in blocked)
    print(json.dumps(result))
""")


@pytest.fixture(scope="module")
def worker_only(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("data")
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(SERVER_STACK), str(data_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_worker_and_shared_module_imports_without_the_server_stack(worker_only):
    assert worker_only["failed"] == {}
    assert {"worker.loop", "worker.trainer", "worker.client", "worker.windows", "worker.awake",
            "shared.kernels", "shared.codec.indices"} <= set(worker_only["imported"])
    assert worker_only["loaded"] == []  # nothing of the stack got in some other way


def test_the_volunteer_commands_work(worker_only):
    assert worker_only["worker_help"]["code"] == 0
    assert "--coordinator" in worker_only["worker_help"]["out"]


def test_the_merge_kernels_fall_back_to_numpy_without_numba(worker_only):
    assert worker_only["kernels"] is False


@pytest.mark.parametrize("command", ["serve", "migrate", "demo"])
def test_the_server_commands_name_the_extra_in_one_line(worker_only, command):
    answer = worker_only[command]
    assert answer["code"] == 2
    lines = answer["err"].strip().splitlines()
    assert len(lines) == 1 and "pip install 'idletrain[server]'" in lines[0], answer["err"]
    assert "Traceback" not in answer["err"]
