"""`python -m bench utilisation` at a tiny size: a real coordinator subprocess (and the patched one
that keeps a lease still uploading), a real worker per mode, the outputs written and sane."""

from __future__ import annotations

import json

import pytest

from bench import utilisation
from bench.utilisation import run
from shared.model import ModelConfig


@pytest.mark.slow
@pytest.mark.parametrize("keeps", [True, False], ids=["coordinator-keeps", "patched-coordinator"])
def test_the_utilisation_bench_runs_every_mode_and_writes_its_outputs(tmp_path, corpus_dir, monkeypatch, keeps):
    if not keeps:  # a coordinator that gives the uploading lease up: mode ahead gets its own, patched one
        monkeypatch.setattr(utilisation.Coordinator, "keeps_delivering_lease", lambda self: False)
    out = tmp_path / "out"
    res = run(out=out, rounds=2, repeats=1, steps=3, batch=2, shard_tokens=4096, corpus=str(corpus_dir),
              model=ModelConfig(n_layer=1, d_model=32, n_head=2, context=32),
              coordinator_env={"IDLETRAIN_LEASE_RATE": "0", "IDLETRAIN_UPLOAD_RATE": "0"}, command="test")
    assert {p.name for p in out.iterdir()} == {"results.json", "results.md", "utilisation.png"}
    assert (res["values"], res["update_values"]) == ("int4", "int4")  # a run's defaults
    assert json.loads((out / "results.json").read_text())["modes"].keys() == {"off", "on", "ahead"}
    for name, mode in res["modes"].items():
        (sample,) = mode["samples"]
        assert sample["rounds"] == 2, name
        assert 0 < sample["compute_s"] <= sample["wall_s"], name
        assert 0 < sample["utilisation"] <= 1 and sample["bytes_sent"] > 0, name
        assert mode["summary"]["goal_met"] == (mode["summary"]["utilisation_median"] >= 0.97)
        # after joining, rounds download incremental updates, not snapshots: about what they upload
        assert sample["join_snapshot_bytes"] == 0 < sample["bytes_received"], name  # version 0 from the seed
        assert 0 < mode["summary"]["down_over_up_after_join"] <= 2.0, (name, mode["summary"])
    # every worker run trained a run of its own, and every delta it delivered was accepted
    patched = res["modes"]["ahead"]["patched_coordinator"]
    assert patched or keeps
    assert set(res["run_status"]) == {"util-off-0", "util-on-0", "util-ahead-0"}
    assert all(st["rejected_deltas"] == 0 and st["merged_deltas"] <= 2 for st in res["run_status"].values())
    md = (out / "results.md").read_text()
    assert "| off: overlap off" in md and "| ahead:" in md and "not computing" in md and "down / up" in md
    assert ("patched by the benchmark" in md) == patched and ("unpatched coordinator" in md) != patched


def test_runs_are_compressed_as_a_run_by_default_or_as_asked():
    from shared.config import RunConfig

    model = ModelConfig(n_layer=1, d_model=32, n_head=2, context=32)
    plain = RunConfig(**utilisation.run_config(name="a", steps=3, batch=2, model=model, shard_tokens=4096))
    defaults = RunConfig(name="defaults")
    assert plain.compression == defaults.compression and plain.update_values == defaults.update_values
    asked = RunConfig(**utilisation.run_config(name="b", steps=3, batch=2, model=model, shard_tokens=4096,
                                               values="int8", update_values="int8"))
    assert (asked.compression.values, asked.compression.index, asked.update_values) == ("int8", "dense", "int8")
