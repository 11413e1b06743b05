"""bench spotcheck: one tiny trial writes its rows, table, summary and plot, and its verdicts are the
check's: the honest delta passes on first and later leases, every false one fails a later lease."""

from __future__ import annotations

import json

import pytest

from bench import spotcheck

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_one_trial_writes_its_outputs_and_tells_honest_from_false(tmp_path):
    result = spotcheck.run(trials=1, rounds=3, precisions=["fp32"], out=tmp_path)
    assert (tmp_path / "pass.png").stat().st_size > 0 and "| fp32 | honest |" in (tmp_path / "results.md").read_text()
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["summary"] == result["summary"] and saved["goals"] == {"honest_pass_rate_min": 0.995,
                                                                       "false_fail_rate_min": 0.95}
    by = {(r["kind"], r["lease"]): r for r in saved["table"]}
    assert by[("honest", "first")]["pass_rate"] == 1.0 and by[("honest", "later")]["pass_rate"] == 1.0
    for kind in ("replayed", "borrowed", "stale", "crafted"):
        assert by[(kind, "later")]["passed"] == 0, by[(kind, "later")]
    assert by[("borrowed", "later")]["pass_rate_before"] == 1.0  # what the check let through without a commitment
