"""The long convergence profile: replica groups, captured gain, resuming (bench/convergence_long.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import bench.convergence_long as long
from bench import wallclock_long, wallclock_reclock
from bench.__main__ import main
from bench.convergence_long import LONG_PROFILES, add_gains, algorithm_methods, default_method, tasks_for
from shared.model import build_model, count_params


def test_the_long_profile_is_the_regime_the_issue_names():
    p = LONG_PROFILES["long"]
    assert p.replicas == (1, 2, 4, 8)
    assert p.worker_steps // max(p.replicas) // p.H >= 100  # rounds per worker at 8 replicas
    tokens = p.worker_steps * p.batch * p.model.context
    assert tokens / count_params(build_model(p.model)) >= 20


def test_rows_per_replica_count_and_algorithms_at_the_largest():
    tasks = tasks_for("long")
    by_m = {m: [t.method.kind for t in tasks if t.replicas == m] for m in (1, 2, 4, 8)}
    # one replica: alone is ddp; each M's default is the long-run regime (the profile's length calls for it), with
    # the short-run defaults beside it
    assert by_m[1] == ["ddp", "diloco", "diloco"]
    assert by_m[2] == by_m[4] == ["ddp", "alone", "diloco", "diloco"]
    p = LONG_PROFILES["long"]
    for m in (1, 2, 4, 8):
        default, short = [t.method for t in tasks if t.replicas == m and t.method.kind == "diloco"][:2]
        assert default.name.endswith("(default)") and short.name.endswith("(short-run defaults)")
        assert (default.H, default.second_moment_workers, default.compression.values) == (19, m, "int1")
        assert (short.H, short.second_moment_workers, short.compression.values) == (p.H, 1, "int4")
    names = [t.method.name for t in tasks if t.replicas == 8]
    assert any("DES-LOC" in n for n in names) and any("dynamic H" in n for n in names)
    assert sum("Nesterov 0.9" in n for n in names) >= 3
    assert all(m.outer.group == 8 for m in algorithm_methods(p, 8))
    grouped = [m for m in algorithm_methods(p, 8) if m.second_moment_workers > 1]
    assert {m.second_moment_workers for m in grouped} == {8}
    assert [(m.H, m.compression.values) for m in grouped] == [(p.H, "int4"), (p.H // 4, "int4"), (p.H // 8, "int4"),
                                                              (p.H // 2, "int2"), (p.H // 4, "int2"),
                                                              (p.H // 3, "int1"), (19, "int1"), (p.H // 4, "int1"),
                                                              (19, "int1")]
    assert all(m.down == ("feedback" if m.compression.values == "int1" else "update") for m in grouped)
    tuned = [m for m in grouped if m.outer.momentum == 0]  # the int1 row at ~520x again, outer lr 1.2
    assert [(m.H, m.outer.lr) for m in tuned] == [(19, 1.2)]
    assert default_method(p, 4).outer.group == 4
    assert all(t.method.H >= 1 for name in LONG_PROFILES for t in tasks_for(name))  # the tiny profile's H is 3


def test_the_default_and_the_best_row_are_repeated_at_other_seeds():
    p = LONG_PROFILES["long"]
    seeded = [t for t in tasks_for("long") if t.seed]
    # default, group-normalised, int1 tuned, ddp, alone at SEEDS; the last three at MORE_SEEDS; and the int1
    # row at the first of the lower inner lrs at every seed
    assert sorted(t.seed for t in seeded) == sorted(long.SEEDS * 6 + long.MORE_SEEDS * 4)
    lower = [t for t in seeded if t.method.inner_lr_factor != 1.0]
    assert {t.method.inner_lr_factor for t in lower} == {long.LOWER_INNER_LRS[0]}
    assert len(lower) == len(long.SEEDS + long.MORE_SEEDS)
    assert all(t.method.name.endswith(f", seed {t.seed}") and t.replicas == 8 for t in seeded)
    assert sorted({t.method.kind for t in seeded}) == ["alone", "ddp", "diloco"]  # each seed with its baselines
    diloco = [t for t in seeded if t.method.kind == "diloco"]
    assert {t.method.second_moment_workers for t in diloco} == {1, 8}
    # the default and the group-normalised row at the profile's H, and the best row at >= 500x: int1 at H = 19
    assert sorted({(t.method.H, t.method.compression.values) for t in diloco}) == [(19, "int1"), (64, "int4")]
    assert {t.method.H for t in diloco if t.seed in long.MORE_SEEDS} == {19}  # with their ddp and alone
    assert long.setup_for(p, 8, seed=2).seed == 2 and long.setup_for(p, 8).seed == 0


def test_a_seed_changes_the_run(one_torch_thread):
    p = LONG_PROFILES["long-tiny"]
    losses = [long.run_task(long.Task("long-tiny", 2, default_method(p, 2), seed=s), threads=None).eval_loss
              for s in (0, 0, 1)]
    assert losses[0] == losses[1] != losses[2]  # the same seed trains the same, another seed otherwise


def test_the_baselines_get_the_lower_inner_lr_too():
    """No baseline tuned down: the rows at a lower inner lr have ddp and the lone worker at it beside them."""
    tasks = [t for t in tasks_for("long") if not t.seed and t.replicas == 8]
    for kind in ("ddp", "alone"):
        assert {t.lr_factor for t in tasks if t.method.kind == kind} >= {1.0, long.LOWER_INNER_LRS[0]}


def test_captured_gain_is_measured_against_the_best_ddp():
    rows = [{"replicas": 8, "method": "ddp", "kind": "ddp", "eval_loss": 2.0},
            {"replicas": 8, "method": "ddp, lr x2", "kind": "ddp", "eval_loss": 1.9},
            {"replicas": 8, "method": "alone", "kind": "alone", "eval_loss": 2.3},
            {"replicas": 8, "method": "d", "kind": "diloco", "eval_loss": 2.06},
            {"replicas": 1, "method": "d", "kind": "diloco", "eval_loss": 2.0}]
    add_gains(rows)
    assert rows[3]["captured_gain"] == pytest.approx(0.6)
    assert rows[3]["loss_ratio_vs_ddp"] == pytest.approx(2.06 / 1.9, abs=1e-4)
    assert rows[0]["captured_gain"] is None and rows[4]["captured_gain"] is None  # no alone at M=1


def test_captured_gain_is_measured_from_the_best_lone_worker():
    rows = [{"replicas": 8, "method": "ddp", "kind": "ddp", "eval_loss": 1.9},
            {"replicas": 8, "method": "alone", "kind": "alone", "eval_loss": 2.3},
            {"replicas": 8, "method": "alone, lr x0.7", "kind": "alone", "eval_loss": 2.25},
            {"replicas": 8, "method": "d", "kind": "diloco", "eval_loss": 2.06}]
    add_gains(rows)
    assert rows[3]["captured_gain"] == pytest.approx((2.25 - 2.06) / (2.25 - 1.9), abs=1e-3)


def test_a_seeds_rows_are_measured_against_that_seeds_baselines_when_it_has_them():
    rows = [{"replicas": 8, "method": "ddp", "kind": "ddp", "eval_loss": 2.0},
            {"replicas": 8, "method": "alone", "kind": "alone", "eval_loss": 2.3},
            {"replicas": 8, "method": "d", "kind": "diloco", "eval_loss": 2.15},
            {"replicas": 8, "method": "ddp, seed 1", "kind": "ddp", "eval_loss": 2.1, "seed": 1},
            {"replicas": 8, "method": "alone, seed 1", "kind": "alone", "eval_loss": 2.5, "seed": 1},
            {"replicas": 8, "method": "d, seed 1", "kind": "diloco", "eval_loss": 2.2, "seed": 1},
            {"replicas": 8, "method": "d, seed 2", "kind": "diloco", "eval_loss": 2.15, "seed": 2}]
    add_gains(rows)
    assert [r["captured_gain"] for r in rows if r["kind"] == "diloco"] == pytest.approx([0.5, 0.75, 0.5])
    assert rows[5]["loss_ratio_vs_ddp"] == pytest.approx(2.2 / 2.1, abs=1e-4)  # seed 2: seed 0's baselines


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory, one_torch_thread):
    out = tmp_path_factory.mktemp("long")
    return out, long.run(profile="long-tiny", out=out, jobs=1, algorithms=False)


def test_a_tiny_run_writes_every_row(tiny_long):
    out, rows = tiny_long
    assert {(r["replicas"], r["kind"]) for r in rows} >= {(1, "ddp"), (2, "alone"), (4, "diloco")}
    total = rows[0]["curve"][-1][0]
    for r in rows:  # every row the same tokens; alone 1/M of them
        assert r["curve"][-1][0] == (total // r["replicas"] if r["kind"] == "alone" else total), r["method"]
    assert all(r["captured_gain"] is not None for r in rows if r["kind"] == "diloco" and r["replicas"] > 1)
    assert (out / "loss.png").stat().st_size > 0 and "captured gain" in (out / "results.md").read_text()


def test_a_kept_row_is_not_trained_again(tiny_long, tmp_path, monkeypatch):
    out, rows = tiny_long
    for name in ("results.json", "meta.json"):
        (tmp_path / name).write_text((out / name).read_text())
    monkeypatch.setattr(long, "run_task", lambda *a, **k: pytest.fail("a kept row was trained again"))
    again = long.run(profile="long-tiny", out=tmp_path, jobs=1, keep=True, algorithms=False)
    assert [r["eval_loss"] for r in again] == [r["eval_loss"] for r in rows]
    assert json.loads((tmp_path / "meta.json").read_text())["rows_trained_now"] == 0


def test_a_resumed_run_keeps_the_listed_order_whichever_rows_it_trains(tiny_long, tmp_path):
    out, rows = tiny_long
    (tmp_path / "results.json").write_text((out / "results.json").read_text())
    again = long.run(profile="long-tiny", out=tmp_path, jobs=1, keep=True, only=["outer lr 0.4"])
    # the one algorithm row, and the baselines that come with the algorithms (ddp and alone at the lower lr)
    assert json.loads((tmp_path / "meta.json").read_text())["rows_trained_now"] == 3
    keys = [long.key(r["replicas"], r["method"]) for r in again]
    listed = [long.key(t.replicas, t.method.name) for t in tasks_for("long-tiny")]
    assert len(keys) == len(rows) + 3 and keys == [k for k in listed if k in keys]  # kept rows not moved last


def test_rows_kept_from_before_rows_carried_a_batch_count_at_the_profiles(tiny_long, tmp_path):
    out, rows = tiny_long
    old = [{k: v for k, v in r.items() if k != "batch"} for r in rows
           if not (r["kind"] == "diloco" and r["replicas"] == 2)]
    (tmp_path / "results.json").write_text(json.dumps(old))
    again = long.run(profile="long-tiny", out=tmp_path, jobs=1, keep=True, algorithms=False)
    assert json.loads((tmp_path / "meta.json").read_text())["rows_trained_now"] == 1  # the one missing row
    assert {r["batch"] for r in again} == {LONG_PROFILES["long-tiny"].batch}
    assert all(r["captured_gain"] is not None for r in again if r["kind"] == "diloco" and r["replicas"] > 1)


def test_the_wallclock_long_profile_clocks_the_curves_without_training(tiny_long, tmp_path, monkeypatch):
    out, rows = tiny_long
    monkeypatch.setattr(long, "run_task", lambda *a, **k: pytest.fail("nothing is trained"))
    results = wallclock_long.run(source=out, out=tmp_path, up_mbps=(10.0,), step_ms=5.0)
    names = [r["row"] for r in results["rows"]]
    assert names[0] == wallclock_long.DDP and len(results["rows"][0]["runs"]) == 2  # ddp's lr x1 and x2
    assert any(n.endswith("(default)") for n in names) and any("alone" in n for n in names)
    home, datacenter = results["panels"]
    ddp_home = next(r for r in home["rows"] if r["row"] == wallclock_long.DDP)
    ddp_dc = next(r for r in datacenter["rows"] if r["row"] == wallclock_long.DDP)
    assert ddp_home["finish_s"] > 10 * ddp_dc["finish_s"]  # fp32 gradients every step over 10 Mbit/s
    assert (tmp_path / "wallclock.png").stat().st_size > 0


def test_reclocking_moves_the_times_and_keeps_the_losses(tiny_long, tmp_path, monkeypatch):
    out, _ = tiny_long
    first = wallclock_long.run(source=out, out=tmp_path / "a", up_mbps=(10.0,), step_ms=5.0)
    again = wallclock_reclock.run(source=tmp_path / "a", out=tmp_path / "b", step_ms=50.0, up_mbps=(10.0,))
    assert [r["final_loss"] for r in again["rows"]] == [r["final_loss"] for r in first["rows"]]
    alone = [next(r for r in res["panels"][0]["rows"] if "alone" in r["row"])["finish_s"] for res in (first, again)]
    assert alone[1] == pytest.approx(10 * alone[0], rel=1e-3)  # compute only: 10x the step, 10x the time
    assert again["meta"]["step_s"] == 0.05 and "re-clocked" in again["meta"]["step_s_from"]
    assert main(["wallclock", "--reclock", str(tmp_path / "a")]) == 2  # no --step-ms: refused


def test_the_wallclock_long_profile_needs_the_convergence_run_first(tmp_path):
    with pytest.raises(FileNotFoundError, match="convergence --profile long"):
        wallclock_long.run(source=tmp_path, out=tmp_path / "out")


def test_unknown_profile_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown profile"):
        long.run(profile="longer", out=tmp_path)


def test_the_probe_compares_each_batch_with_its_own_baselines():
    p = LONG_PROFILES["long-probe"]
    tasks = tasks_for("long-probe")
    assert {t.replicas for t in tasks} == {8} and p.worker_steps // 8 // p.H == 25  # the long profile's first 25 rounds
    for b in p.probe_batches:
        kinds = sorted(t.method.kind for t in tasks if t.batch == b and t.method.kind in ("ddp", "alone"))
        assert kinds == ["alone", "ddp", "ddp"]
        assert any(t.method.barrier for t in tasks if t.batch == b)  # synchronous rounds at every batch
    names = [t.method.name for t in tasks]
    assert len(set(names)) == len(names) and all(n.startswith(f"B={t.batch}: ") for n, t in zip(names, tasks))
    small = [t.method for t in tasks if t.batch == min(p.probe_batches) and t.method.kind == "diloco"]
    assert {m.H for m in small} == {1, p.H, p.H // 2, p.H // 3, round(p.H * 3 / 10), p.H // 4, p.H // 8}
    assert any(m.outer.lr == 1.6 for m in small)
    every = [m for m in small if m.H == 1]  # the ceiling of averaging: fp32, every step, with and without
    assert all(m.barrier and m.compression.values == "fp32" for m in every)  # the group's normalisation
    assert sorted(m.second_moment_workers for m in every) == [1, 8]
    assert any(m.H == p.H and m.second_moment_workers == 8 and not m.barrier for m in small)
    assert {m.update_values for m in small if m.H == p.H // 2} == {"int2", "int4"}  # what int2 downloads cost
    assert all(m.compression.values == "int2" for m in small if m.H == p.H // 2)
    grouped = {(m.H, m.compression.values) for m in small if m.second_moment_workers == 8 and not m.barrier}
    assert grouped == {(p.H, "int4"), (p.H // 4, "int4"), (p.H // 8, "int4"), (p.H // 2, "int2"), (p.H // 4, "int2"),
                       (p.H // 3, "int1"), (round(p.H * 3 / 10), "int1"), (p.H // 4, "int1")}
    int1 = [m for m in small if m.compression.values == "int1"]  # downloads with feedback, and one without
    assert sorted(m.down for m in int1) == ["feedback"] * 4 + ["update"]


def test_a_probe_measures_each_batch_against_its_own_ddp_and_alone():
    rows = [{"replicas": 8, "batch": b, "method": f"B={b}: {name}", "kind": kind, "eval_loss": loss}
            for b, base in ((4, 2.0), (16, 1.0))
            for name, kind, loss in (("ddp", "ddp", base), ("alone", "alone", base + 0.5), ("d", "diloco", base + 0.2))]
    add_gains(rows)
    assert [r["captured_gain"] for r in rows if r["kind"] == "diloco"] == [pytest.approx(0.6), pytest.approx(0.6)]


def test_a_tiny_probe_writes_a_row_per_batch(tmp_path, monkeypatch, one_torch_thread):
    tiny = dataclasses.replace(LONG_PROFILES["long-tiny"], replicas=(2,), H=4, worker_steps=16, probe_batches=(1, 2))
    monkeypatch.setitem(LONG_PROFILES, "probe-tiny", tiny)
    rows = long.run(profile="probe-tiny", out=tmp_path, jobs=1)
    assert {r["batch"] for r in rows} == {1, 2}
    for b in (1, 2):
        group = [r for r in rows if r["batch"] == b]
        ddp = next(r for r in group if r["method"] == f"B={b}: ddp")
        assert ddp["curve"][-1][0] == 16 * b * tiny.model.context  # every row at B: 16 steps of B sequences
        assert all(r["captured_gain"] is not None for r in group if r["kind"] == "diloco")
    assert "A probe" in (tmp_path / "results.md").read_text() and (tmp_path / "loss.png").stat().st_size > 0
