"""`bench field`: its numbers (pure), its network (namespaces, shaping, counters, cleanup) and its
data-parallel ranks (ring and parameter server train the same model; int8 stays close), and the committed
results agree with their rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.field import report
from bench.field.net import COORD_ADDR, Field, available
from idletrain.harness import free_port
from shared.model import ModelConfig, build_model

ROOT = Path(__file__).resolve().parents[2]


def _curve(points, val=None):
    return [{"t": t, "test": loss, "validation": (val or {}).get(t, loss)} for t, loss in points]


# -- the numbers ---------------------------------------------------------------------------------


def test_a_curve_is_read_at_evaluated_points_never_between():
    curve = _curve([(0, 5.0), (10, 4.0), (20, 3.0)])
    assert report.loss_at(curve, 19.9) == 4.0  # a step function: the last evaluation at or before t
    assert report.loss_at(curve, 20) == 3.0
    assert report.time_to(curve, 3.5) == 20  # not 15, as a line between the points would say
    assert report.time_to(curve, 2.0) is None


def test_the_lr_is_chosen_on_validation_not_test():
    rows = [{"lr": 1e-3, "curve": _curve([(0, 5.0), (10, 2.0)], val={10: 3.0})},
            {"lr": 4e-3, "curve": _curve([(0, 5.0), (10, 2.5)], val={10: 2.9})}]
    assert report.choose_lr(rows) == 4e-3  # better on validation, worse on test


def _row(method, lr, seed, points, up=1e6):
    return {"method": method, "lr": lr, "seed": seed, "curve": _curve(points),
            "bytes": {"up_mean": up, "down_mean": 2 * up, "coordinator_up": 0, "coordinator_down": 0}}


def test_summary_speedup_targets_and_the_free_links_row_kept_apart():
    rows = [_row("alone", 1e-3, 0, [(0, 5.0), (50, 3.5), (100, 3.0)]),
            _row("idletrain", None, 0, [(0, 5.0), (20, 3.2), (25, 2.9), (100, 2.5)]),
            _row("ring fp32", 1e-3, 0, [(0, 5.0), (100, 4.0)]),
            _row("ring fp32 free links", 1e-3, 0, [(0, 5.0), (10, 2.0)])]
    out = report.summarise(rows, {"duration_s": 100})
    s = out["summary"]
    assert s["speedup_vs_alone"] == 4.0  # alone reached 3.0 at 100 s, idletrain at 25 s
    assert s["default_loss_at_equal_time"] == 2.5 and s["alone_loss_at_equal_time"] == 3.0
    assert s["best_ddp"] == "ring fp32" and s["best_ddp_loss_at_equal_time"] == 4.0  # free links are the ideal
    assert s["goals_met"] == {"speedup_vs_alone": True, "below_best_ddp_at_equal_time": True}
    assert out["targets"]["0"][-1] == 3.0  # the lone worker's final loss is one of the targets
    assert out["methods"]["ring fp32"]["speedup_vs_alone"]["mean"] == 0.0  # never reached it


def test_intervals_over_seeds():
    iv = report.interval([2.0, 2.2, 2.4])
    assert iv["mean"] == 2.2 and iv["low"] < 2.2 < iv["high"] and iv["n"] == 3
    assert report.interval([1.0])["low"] is None


# -- the network ---------------------------------------------------------------------------------

needs_field = pytest.mark.skipif(available() is not None, reason=str(available()))


@needs_field
def test_links_are_shaped_counted_and_removed():
    sink = (f"import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('{COORD_ADDR}',9100));s.listen();print('up',flush=True);c,_=s.accept();n=0\n"
            "while (b:=c.recv(1<<16)): n+=len(b)\nprint(n)")
    size = 1_250_000  # 1 s at 10 Mbit/s
    with Field(1, up_mbit=10, down_mbit=50, prefix=f"itt{os.getpid() % 1000}") as field:
        names = [field.switch, field.coord, field.worker(0)]
        server = subprocess.Popen(field.command(field.coord, [sys.executable, "-c", sink]), stdout=subprocess.PIPE,
                                  text=True)
        assert server.stdout.readline().strip() == "up"
        before = field.counters(field.worker(0))
        t0 = time.monotonic()
        subprocess.run(field.command(field.worker(0), [
            sys.executable, "-c", f"import socket;s=socket.create_connection(('{COORD_ADDR}',9100));"
                                  f"s.sendall(b'x'*{size});s.close()"], cpu="probe"), check=True, timeout=120)
        received = int(server.communicate(timeout=120)[0].strip())
        elapsed = time.monotonic() - t0
        sent = field.counters(field.worker(0)) - before
        assert received == size
        assert sent.tx >= size  # the interface counted the payload and its headers
        # the shaper's bound: a busy machine may be slower, never faster than the link
        assert elapsed >= 0.8 * size * 8 / 10e6, elapsed
        cgroup = field.cgroup
        assert (cgroup / "probe" / "cpu.cfs_quota_us").read_text().strip() == str(int(100_000 * field.cpu_share))
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed.split() for name in names)
    assert not cgroup.exists()


# -- the data-parallel ranks ----------------------------------------------------------------------


def _ranks(tmp: Path, mode: str, comm: str, shards: Path, workers: int = 2, steps: int = 6) -> dict:
    out = tmp / f"{mode}-{comm}"
    out.mkdir()
    world = workers + 1 if mode == "ps" else workers
    spec = {"mode": mode, "comm": comm, "lr": 3e-3, "seed": 0, "model_seed": 0, "workers": workers, "world": world,
            "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 16},
            "inner": {"batch_size": 4, "weight_decay": 0.1, "grad_clip": 1.0, "warmup_steps": 2},
            "shards": str(shards), "duration_s": 600, "max_steps": steps, "save_every_s": 1e9,
            "powersgd_rank": 2, "master": f"127.0.0.1:{free_port()}", "out": str(out), "started": time.time()}
    (out / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "bench.field.ddp", str(out / "spec.json"), str(r)], env=env,
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    assert json.loads((out / "steps.json").read_text())["steps"] == steps
    last = sorted(out.glob("ckpt-*.pt"))[-1]
    return torch.load(last, weights_only=True)["state"]


@pytest.mark.slow
def test_ring_and_parameter_server_train_the_same_model_and_int8_stays_close(tmp_path: Path):
    rng = np.random.default_rng(0)
    shards = tmp_path / "shards.npy"
    np.save(shards, rng.integers(0, 256, size=(4, 2048), dtype=np.uint8))
    runs = {}

    def go(mode, comm):
        runs[mode, comm] = _ranks(tmp_path, mode, comm, shards)

    threads = [threading.Thread(target=go, args=a) for a in [("ring", "fp32"), ("ps", "fp32"), ("ps", "int8")]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(runs) == 3
    ring, ps, ps8 = (torch.cat([v.flatten() for v in runs[k].values()]) for k in
                     [("ring", "fp32"), ("ps", "fp32"), ("ps", "int8")])
    start = torch.cat([v.flatten() for v in build_model(ModelConfig(n_layer=1, n_head=2, d_model=32, context=16),
                                                        seed=0).state_dict().values()])
    assert torch.allclose(ring, ps, atol=1e-5), (ring - ps).abs().max()  # the same mean gradient, each step
    moved, moved8 = ps - start, ps8 - start
    assert moved.norm() > 0
    cos = torch.nn.functional.cosine_similarity(moved, moved8, dim=0)
    # int8 values under one scale round the smallest entries to 0, and AdamW normalises every entry, so
    # the steps drift apart a little (0.93 here after 6 steps); a broken codec lands near 0
    assert cos > 0.85, cos


# -- the committed results -------------------------------------------------------------------------


def test_committed_results_agree_with_their_rows():
    path = ROOT / "docs" / "benchmarks" / "field" / "results.json"
    results = json.loads(path.read_text())
    again = report.summarise(results["rows"], results["meta"])
    assert again["summary"] == results["summary"]
    for key in ("speedup_vs_alone", "default_loss_at_equal_time", "best_ddp_loss_at_equal_time", "seeds"):
        assert key in results["summary"]
    tried = {(r["method"], r["lr"], r["seed"]) for r in results["rows"]}
    assert len(tried) == len(results["rows"])  # every configuration tried, once


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("IDLETRAIN_HIVEMIND_PYTHON"),
                    reason="needs a venv with hivemind: set IDLETRAIN_HIVEMIND_PYTHON to its python")
def test_hivemind_peers_train_and_average(tmp_path: Path):
    """bench.field.hive's peers on loopback: they find each other through peer 0's DHT, train, and the
    collaboration passes at least one averaging epoch (target 64 samples, 4 a step, 2 peers)."""
    rng = np.random.default_rng(0)
    np.save(tmp_path / "shards.npy", rng.integers(0, 256, size=(4, 4096), dtype=np.uint8))
    out = tmp_path / "hive"
    out.mkdir()
    spec = {"mode": "hivemind", "lr": 3e-3, "seed": 0, "model_seed": 0, "workers": 2, "world": 2,
            "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 16},
            "inner": {"batch_size": 4, "weight_decay": 0.1, "grad_clip": 1.0, "warmup_steps": 2},
            "shards": str(tmp_path / "shards.npy"), "duration_s": 40, "save_every_s": 10, "target_batch_size": 64,
            "addrs": ["127.0.0.1", "127.0.0.1"], "port": 0, "out": str(out), "started": time.time()}
    (out / "spec.json").write_text(json.dumps(spec))
    logs = [tmp_path / f"peer{r}.log" for r in range(2)]  # files: a full pipe would stall a peer mid-step
    procs = [subprocess.Popen([os.environ["IDLETRAIN_HIVEMIND_PYTHON"], "-m", "bench.field.hive",
                               str(out / "spec.json"), str(r)], cwd=ROOT, stdout=log.open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True) for r, log in enumerate(logs)]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:  # the peers' p2p daemons outlive them: their groups go too
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
    assert codes == [0, 0], [log.read_text()[-3000:] for log in logs]
    steps = json.loads((out / "steps.json").read_text())
    assert steps["steps"] > 0 and steps["epochs"] >= 1, steps


def test_the_command_line_refuses_what_it_cannot_run(capsys, tmp_path):
    from bench.__main__ import main

    assert main(["field", "--profile", "huge", "--out", str(tmp_path)]) == 2
    assert "unknown profile 'huge'" in capsys.readouterr().err
    if available() is None:
        assert main(["field", "--cpu-share", "2", "--out", str(tmp_path)]) == 2
        assert "--cpu-share" in capsys.readouterr().err
        assert main(["field", "--hivemind-python", sys.executable, "--out", str(tmp_path)]) == 2
        assert "cannot import hivemind" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()
