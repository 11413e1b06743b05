"""`bench regime`: the run lengths at which the short-run defaults and the long-run configuration are
measured side by side, and how their captured gains are summarised against the rule."""

from __future__ import annotations

import json

import pytest

from bench import regime
from shared.config import LONG_RUN_STEPS


def test_the_default_profile_brackets_the_rule_with_two_seeds_where_the_rows_cross():
    p = regime.PROFILES["default"]
    assert min(p.lengths) < LONG_RUN_STEPS <= max(p.lengths) and LONG_RUN_STEPS in p.lengths
    assert all(len(p.seeds.get(n, (0,))) >= 2 for n in p.lengths if n <= LONG_RUN_STEPS)
    long = regime.method(regime.Task("long", 600, 0, "long"))
    assert (long.H, long.compression.values, long.second_moment_workers) == (19, "int1", regime.WORKERS)


def test_summarise_averages_each_rows_gain_over_seeds_and_names_the_winner():
    rows = [{"steps_per_worker": n, "seed": s, "row": row, "eval_loss": loss}
            for n, s, row, loss in [(400, 0, "ddp", 2.0), (400, 0, "alone", 3.0), (400, 0, "short", 2.5),
                                    (400, 0, "long", 2.8), (400, 1, "ddp", 2.0), (400, 1, "alone", 2.5),
                                    (400, 1, "short", 2.4), (400, 1, "long", 2.3),
                                    (800, 0, "ddp", 1.0), (800, 0, "alone", 2.0), (800, 0, "short", 1.9),
                                    (800, 0, "long", 1.3), (900, 0, "ddp", 1.0)]]  # 900: no pair, no line
    (a, b) = regime.summarise(rows)
    assert a["short_gain"] == [0.5, 0.2] and a["long_gain"] == [0.2, 0.4]
    assert (a["short_mean"], a["long_mean"], a["wins"], a["rule"]) == (0.35, 0.3, "short", "short")
    assert (b["steps_per_worker"], b["wins"], b["rule"]) == (800, "long", "long")


@pytest.mark.slow
def test_the_tiny_profile_writes_its_outputs_and_resumes(tmp_path, one_torch_thread):
    summary = regime.run(profile="tiny", out=tmp_path, jobs=1)
    assert [s["steps_per_worker"] for s in summary] == [12]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["rows"]) == 4 and saved["summary"] == summary
    assert "| 12 | 0 |" in (tmp_path / "results.md").read_text() and (tmp_path / "gain.png").stat().st_size > 0
    again = regime.run(profile="tiny", out=tmp_path, jobs=1, keep=True)  # every row kept: nothing trains
    assert again == summary
