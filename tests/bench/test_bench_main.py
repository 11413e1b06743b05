"""`python -m bench`: the benchmarks' own command line, and bench/ outside the installed package."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import setuptools

from bench.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ["convergence", "averaging", "merge", "load", "utilisation", "models", "spotcheck", "spotcheck-sparta",
              "field"]


def test_python_m_bench_lists_every_benchmark():
    done = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m bench")
    assert all(name in done.stdout for name in BENCHMARKS)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_each_benchmark_has_help(name, capsys):
    with pytest.raises(SystemExit) as info:
        main([name, "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m bench {name}")


def test_the_wheel_leaves_bench_out():
    """Volunteers install coordinator, worker, shared and idletrain; the benchmarks stay in the repository."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = setuptools.find_packages(where=str(ROOT), include=include)
    assert "idletrain.cli" in packages and "shared" in packages
    assert not [p for p in packages if p == "bench" or p.startswith("bench.")]
