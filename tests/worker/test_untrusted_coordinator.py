"""A worker is safe from a malicious coordinator too: no model larger than it agreed to hold,
no model config that does not validate, and no pickle anywhere on what crosses the network."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.worker.test_state import make_lease
from worker.loop import Worker
from worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]


class _NoNetwork:
    def __getattr__(self, name):
        raise AssertionError(f"the worker must refuse before any request ({name})")


def _worker(tmp_path, **kw) -> Worker:
    return Worker(WorkerSettings(coordinator="http://127.0.0.1:9", run="t", state_dir=tmp_path, device="cpu", **kw),
                  client=_NoNetwork())


def test_a_model_above_max_params_is_refused_before_anything_is_downloaded(tmp_path):
    lease = make_lease().model_copy(update={"model": {"n_layer": 48, "n_head": 16, "d_model": 2048,
                                                      "context": 2048, "vocab_size": 256, "dropout": 0.0}})
    with pytest.raises(RuntimeError, match=r"2,4\d\d,\d{3},\d{3} parameters, above this worker's limit"):
        _worker(tmp_path, max_params=1_000_000_000)._round(lease)


@pytest.mark.parametrize("model", [{"n_layer": 10**9}, {"n_layer": 2, "surprise": 1}, {"n_layer": -1}])
def test_an_invalid_model_config_is_refused(tmp_path, model):
    lease = make_lease().model_copy(update={"model": model})
    with pytest.raises(RuntimeError, match="invalid model"):
        _worker(tmp_path)._round(lease)


def test_no_pickle_or_torch_load_in_code_that_reads_network_bytes():
    """safetensors, JSON and the delta codec are the only formats either side parses."""
    unsafe = "pickle|cloudpickle|dill|shelve|joblib"
    pattern = re.compile(rf"\bimport\s+({unsafe})\b|\bfrom\s+({unsafe})\b|\bpickle\.loads?\(|"
                         r"(?<!safetensors\.)\btorch\.load\(|\bmarshal\.loads?\(|\bnp\.load\([^)]*allow_pickle\s*=\s*True")
    offenders = [f"{p.relative_to(ROOT)}:{i}" for folder in ("coordinator", "worker", "shared", "idletrain")
                 for p in sorted((ROOT / folder).rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
