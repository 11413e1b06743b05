"""bench spotcheck-sparta: one tiny trial writes its rows, table, summary and plot, and its verdicts are
the check's: the honest exchanges pass, every false kind fails."""

from __future__ import annotations

import json

import pytest

from bench import spotcheck_sparta
from shared.config import SpartaConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_one_trial_writes_its_outputs_and_tells_honest_from_false(tmp_path):
    result = spotcheck_sparta.run(trials=1, rounds=3, precisions=["fp32"], configs=[SpartaConfig(p=0.01, every=1)],
                                  out=tmp_path)
    assert (tmp_path / "pass.png").stat().st_size > 0 and "| fp32 | honest |" in (tmp_path / "results.md").read_text()
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["summary"] == result["summary"]
    by = {r["kind"]: r for r in saved["table"]}
    assert by["honest"]["pass_rate"] == 1.0 and by["honest"]["cosine_min"] > 0.999, by["honest"]
    for kind in ("idle", "shifted", "stale", "borrowed"):
        assert by[kind]["passed"] == 0, by[kind]
