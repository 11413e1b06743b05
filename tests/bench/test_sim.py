"""The convergence simulator: every method runs, on the same tokens, with honest byte counts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench.convergence import PROFILES, methods_for, plot, result_row, write_markdown
from bench.sim import Method, Setup, ddp_bytes_per_worker, run_method, speeds_for
from shared.config import CompressionConfig, OuterConfig
from shared.model import build_model, count_params
from tests.bench.conftest import TINY, tiny_setup


@pytest.fixture(scope="module")
def setup() -> Setup:
    return tiny_setup(8)


def test_ddp_counts_dense_gradients_both_ways(setup):
    r = run_method(setup, Method("ddp", "ddp"))
    dense = 4 * count_params(build_model(TINY)) * setup.steps_per_worker
    assert r.bytes_up_per_worker == dense and r.bytes_down_per_worker == dense
    assert ddp_bytes_per_worker(setup) == 2 * dense
    assert r.curve[0][0] == 0 and r.curve[-1][0] == setup.total_steps * setup.tokens_per_step
    assert r.eval_loss < r.curve[0][1]


def test_diloco_merges_every_round_and_counts_encoded_bytes(setup):
    comp = CompressionConfig(index="topk", fraction=0.1, values="int8")
    r = run_method(setup, Method("d", "diloco", H=4, compression=comp, outer=OuterConfig(group=3)))
    assert r.merges == setup.total_steps // 4
    assert r.curve[-1][0] == setup.total_steps * setup.tokens_per_step  # same tokens as ddp
    assert 0 < r.bytes_up_per_worker < ddp_bytes_per_worker(setup) / 2
    assert r.mean_staleness <= 2  # equal speeds: a group of 3 merges from the same base


def test_unequal_speeds_make_merges_stale(setup):
    even = run_method(setup, Method("d", "diloco", H=2, outer=OuterConfig(group=3)))
    skew = run_method(setup, Method("d", "diloco", H=2, outer=OuterConfig(group=3), speed_spread=4.0))
    assert even.max_staleness <= 2  # equal speeds: each delta lags at most its own group
    assert skew.max_staleness > even.max_staleness
    assert skew.curve[-1][0] == even.curve[-1][0]


@pytest.mark.parametrize("kind", ["sparta", "sparta+diloco"])
def test_sparta_moves_a_fraction_of_the_bytes(setup, kind):
    r = run_method(setup, Method("s", kind, H=4, sparta_p=0.05))
    assert 0 < r.bytes_up_per_worker < ddp_bytes_per_worker(setup) / 2
    assert np.isfinite(r.eval_loss)


def test_speeds_spread_geometrically():
    assert speeds_for(3, 4.0) == (1.0, 2.0, 4.0)
    assert speeds_for(1, 4.0) == (1.0,)


def test_outputs_are_written(tmp_path, setup):
    ddp = run_method(setup, Method("ddp", "ddp"))
    other = run_method(setup, Method("sparta", "sparta", sparta_p=0.1))
    rows = [result_row(r, ddp=ddp, dense_bytes=ddp_bytes_per_worker(setup) / 2) for r in (ddp, other)]
    assert rows[0]["loss_ratio_vs_ddp"] == 1.0 and rows[0]["traffic_reduction_vs_ddp"] == 1.0
    assert rows[1]["traffic_reduction_vs_ddp"] > 1
    keys = {"method", "eval_loss", "loss_ratio_vs_ddp", "bytes_up_per_worker", "bytes_down_per_worker",
            "traffic_reduction_vs_ddp", "wall_s"}
    assert keys <= set(rows[0])
    json.dumps(rows)
    write_markdown(rows, tmp_path / "results.md", header="# t")
    assert "| sparta |" in (tmp_path / "results.md").read_text()
    plot(rows, tmp_path / "loss.png", title="t")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_hetero_adds_side_by_side_copies():
    names = [m.name for m in methods_for(PROFILES["quick"], workers=8, hetero=4)]
    assert any(n.endswith("speeds 1-4x") for n in names)
    assert names[0] == "ddp"


def test_a_lone_worker_sends_nothing_and_trains_its_share(setup, tmp_path):
    r = run_method(setup, Method("alone", "alone"))
    assert r.bytes_up_per_worker == r.bytes_down_per_worker == 0
    row = result_row(r, ddp=r, dense_bytes=ddp_bytes_per_worker(setup) / 2)
    assert row["traffic_reduction_vs_ddp"] is None
    write_markdown([row], tmp_path / "r.md", header="# t")
    assert "nothing sent" in (tmp_path / "r.md").read_text()
    assert r.curve[-1][0] == setup.steps_per_worker * setup.tokens_per_step
    assert r.eval_loss < r.curve[0][1]


def test_workers_fetch_bases_as_the_real_worker_does(setup):
    """Version 0 from the seed (nothing downloaded), then int8 updates: a fraction of full snapshots."""
    from shared.model import get_params
    from shared.snapshot import encode_snapshot

    upd = run_method(setup, Method("d", "diloco", H=2, outer=OuterConfig(group=3)))
    snap = run_method(setup, Method("d", "diloco", H=2, outer=OuterConfig(group=3), down="snapshot"))
    rounds = setup.steps_per_worker // 2
    full = len(encode_snapshot(get_params(build_model(TINY, seed=setup.seed))))
    assert snap.bytes_down_per_worker == pytest.approx((rounds - 1) * full, rel=0.1)  # join from the seed
    assert 0 < upd.bytes_down_per_worker < snap.bytes_down_per_worker / 2
    joined = run_method(setup, Method("d", "diloco", H=2, outer=OuterConfig(group=3), down="snapshot",
                                      join="snapshot"))
    assert joined.bytes_down_per_worker == pytest.approx(snap.bytes_down_per_worker + full, rel=0.05)
    # the int8 updates are lossy, so the runs differ, but not by much
    assert upd.eval_loss != snap.eval_loss and abs(upd.eval_loss - snap.eval_loss) < 0.05 * snap.eval_loss


def test_lookahead_changes_what_workers_start_from(setup):
    on = run_method(setup, Method("d", "diloco", H=2, outer=OuterConfig(group=3)))
    off = run_method(setup, Method("d", "diloco", H=2, outer=OuterConfig(group=3, lookahead=False)))
    assert on.eval_loss != off.eval_loss and on.bytes_up_per_worker > 0


def test_the_default_row_is_run_creates_default():
    from shared.config import RunConfig

    d = RunConfig(name="x")
    rows = [m for m in methods_for(PROFILES["full"], workers=8) if m.name.endswith("(default)")]
    assert len(rows) == 1 and rows[0].kind == d.algorithm
    assert rows[0].compression == d.compression
    assert rows[0].outer == d.outer.model_copy(update={"group": 8})
    assert rows[0].update_values == d.update_values and rows[0].H == PROFILES["full"].H


def test_the_barrier_makes_every_round_start_from_one_version(setup):
    """Synchronous DiLoCo: each round's deltas all start from the version after the last round."""
    seen = []
    import bench.sim as sim

    r = sim.run_diloco(setup, Method("d", "diloco", H=2, outer=OuterConfig(group=3), barrier=True),
                       on_merge=seen.append)
    assert r.max_staleness == 2 and r.merges == setup.total_steps // 2  # 0, 1, 2 in every group of 3
    assert seen == list(range(1, r.merges + 1))
    assert r.curve[-1][0] == setup.total_steps * setup.tokens_per_step


def test_a_round_takes_the_lr_the_coordinator_would_lease(setup, monkeypatch):
    """The coordinator leases a round at the schedule's position of the tokens delivered so far
    (coordinator/services/leases.py), not counting those other workers are still training: at equal speeds
    the first round of every worker starts at the top of the schedule, later ones one delivery apart."""
    import bench.sim as sim

    positions = []
    real_lr = sim._lr
    monkeypatch.setattr(sim, "_lr", lambda s, tokens: positions.append(tokens) or real_lr(s, tokens))
    sim.run_diloco(setup, Method("d", "diloco", H=2, outer=OuterConfig(group=3)))
    rounds = setup.total_steps // 2  # 12: 3 workers x 4 rounds of 2 steps
    delivered = [0] * setup.workers + list(range(1, rounds - setup.workers + 1))
    assert positions == [k * 2 * setup.tokens_per_step for k in delivered]


def test_second_moment_workers_gives_each_replica_the_group_normalised_adamw(setup, monkeypatch):
    from bench import sim
    from shared.algorithms.group_adamw import GroupAdamW

    made = []
    real = sim.make_optimizer

    def spy(model, cfg):
        opt = real(model, cfg)
        made.append(opt)
        return opt

    monkeypatch.setattr(sim, "make_optimizer", spy)
    group = run_method(setup, Method("d", "diloco", H=2, outer=OuterConfig(group=8), second_moment_workers=8))
    assert len(made) == setup.workers and all(isinstance(o, GroupAdamW) for o in made)
    assert all(o.param_groups[0]["workers"] == 8 for o in made)
    made.clear()
    plain = run_method(setup, Method("d", "diloco", H=2, outer=OuterConfig(group=8)))
    assert all(type(o).__name__ == "AdamW" for o in made) and plain.eval_loss != group.eval_loss


def test_feedback_downloads_keep_the_copy_within_one_updates_rounding(setup):
    """down="feedback": each update is the change from the worker's own copy, so int1's large rounding
    (0.6 of a change) is carried into the next update instead of adding up; "update" (the change between
    published versions) lets it add up until the next full snapshot, and takes snapshots to stop it."""
    from bench.sim import _Replica
    from shared.algorithms import sync
    from shared.model import get_params

    init = get_params(build_model(TINY, seed=setup.seed))
    gen = np.random.default_rng(0)
    served = {0: init}
    for v in range(1, 41):  # a model that drifts by a random step every version
        served[v] = {n: t + 0.01 * torch.from_numpy(gen.standard_normal(t.shape).astype(np.float32))
                     for n, t in served[v - 1].items()}
    step = 0.01 * sum(t.numel() for t in init.values()) ** 0.5
    errors = {}
    for down in ("feedback", "update"):
        method = Method("d", "diloco", down=down, update_values="int1")
        r = _Replica(setup, 0, init)
        r.fetch(0, served, method)
        errors[down] = []
        for v in range(1, 41):
            held = r.fetch(v, served, method)
            # the copy's distance from the model, in steps of the model's drift (0.01 a value)
            errors[down].append(sum(float((held[n] - served[v][n]).square().sum()) for n in held) ** 0.5 / step)
        if down == "feedback":
            assert r.hops == 40  # never a snapshot
            feedback_bytes = r.bytes_down
    assert max(errors["feedback"]) < 1.0  # measured 0.60-0.77: one step's rounding, hop after hop
    assert errors["update"][sync.MAX_HOPS - 1] > 3 * max(errors["feedback"])  # measured 3.3: added up
    assert feedback_bytes < r.bytes_down  # "update" paid a snapshot at hop MAX_HOPS + 1
