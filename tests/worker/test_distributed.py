"""worker/distributed.py: one worker over several local processes (torchrun), tested with 2 gloo
processes on the CPU: the ranks stay identical, a 2-process round equals a 1-process round on the
same batches, rank 0 can set a round aside or refuse what it cannot train and the followers keep up,
a resumed round picks up where it was, and a real torchrun worker trains against a coordinator."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from idletrain.harness import free_port, wait_healthy
from shared import protocol
from shared.config import CompressionConfig, InnerConfig
from shared.model import ModelConfig, build_model, get_params
from tests import procs
from tests.procs import admin_headers, wait_merged
from worker import distributed
from worker.trainer import LocalTrainer, RoundSuspended

MODEL = ModelConfig(n_layer=1, d_model=32, n_head=2, context=16)
WORLD = 2
TORCHRUN = Path(sys.executable).with_name("torchrun")


def make_lease(lease_id: int, *, seed: int, steps: int = 4, batch_size: int = 6, algorithm: str = "diloco",
               base_version: int = 0) -> protocol.Lease:
    return protocol.Lease(
        lease_id=lease_id, run="t", shard_id=0, shard_sha256="0" * 64, base_version=base_version, seed=seed,
        lr=3e-3, algorithm=algorithm,
        inner=InnerConfig(steps=steps, batch_size=batch_size, warmup_steps=3, grad_clip=0.5),
        compression=CompressionConfig(index="topk", fraction=0.1, values="int8"),
        model=MODEL.to_dict(), deadline=datetime(2030, 1, 1, tzinfo=timezone.utc))


def tokens() -> torch.Tensor:
    text = b"the quick brown fox jumps over the lazy dog, again and again; " * 40
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def base(seed: int = 0) -> dict[str, torch.Tensor]:
    return get_params(build_model(MODEL, seed=seed))


# batch 6 over 2 ranks: 3 rows each; batch 5: 2 and 3 rows (uneven shares, weighted)
ROUND_A = make_lease(1, seed=11)
ROUND_B = make_lease(2, seed=12, batch_size=5, base_version=1)
SUSPENDED = make_lease(3, seed=13)
SPARTA = make_lease(4, seed=14, algorithm="sparta")
TOO_SMALL = make_lease(5, seed=15, batch_size=1)
AFTER = make_lease(6, seed=16, steps=2)


def _rank_main(rank: int, port: int, out: str) -> None:
    """One process of the group: rank 0 leads a scripted series of rounds, rank 1 follows."""
    out_dir = Path(out)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    session = distributed.from_env("cpu")
    assert session is not None and session.device == torch.device("cpu")
    if rank != 0:
        def saved() -> None:
            save_file(get_params(session.model), str(out_dir / f"rank{rank}-round{session.rounds}.safetensors"))

        rounds = session.follow(on_round=saved)
        (out_dir / f"rank{rank}.json").write_text(json.dumps({"rounds": rounds}))
        return
    notes: dict = {}
    trainer = distributed.LeadTrainer(session)
    checkpoints = []
    try:
        a = trainer.train_round(ROUND_A, base(0), tokens(), checkpoint=checkpoints.append, checkpoint_every=2)
        save_file(get_params(trainer.model), str(out_dir / "rank0-round1.safetensors"))
        b = trainer.train_round(ROUND_B, base(1), tokens())
        save_file(get_params(trainer.model), str(out_dir / "rank0-round2.safetensors"))
        notes.update(losses_a=a.losses, tokens_a=a.tokens, body_a=a.body.hex(), losses_b=b.losses, tokens_b=b.tokens)

        try:  # rank 0's gate sets the round aside after step 2: the followers drop it and wait
            trainer.train_round(SUSPENDED, base(0), tokens(), gate=lambda step, save: step < 2)
        except RoundSuspended as exc:
            notes["suspended_at"] = exc.step
        for lease in (SPARTA, TOO_SMALL):
            try:
                trainer.train_round(lease, base(0), tokens())
            except RuntimeError as exc:
                notes.setdefault("refused", []).append(str(exc))
        after = trainer.train_round(AFTER, base(0), tokens())
        save_file(get_params(trainer.model), str(out_dir / "rank0-round3.safetensors"))
        notes["losses_after"] = after.losses

        # a restart: a fresh trainer restores round A's checkpoint after step 2 and finishes that round
        fresh = distributed.LeadTrainer(session)
        fresh.restore_state(checkpoints[0])
        resumed = fresh.train_round(ROUND_A, None, tokens(), resume=checkpoints[0].round)
        save_file(get_params(fresh.model), str(out_dir / "rank0-round4.safetensors"))
        notes.update(resumed_at=resumed.resumed_at, resumed_losses=resumed.losses, resumed_body=resumed.body.hex())
    finally:
        session.close()
    (out_dir / "rank0.json").write_text(json.dumps(notes))


@pytest.fixture(scope="module")
def group_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    mp.start_processes(_rank_main, args=(free_port(), str(out)), nprocs=WORLD, join=True, start_method="spawn")
    return out


def test_both_ranks_hold_the_same_weights_after_each_round(group_run: Path):
    follower = json.loads((group_run / "rank1.json").read_text())
    assert follower["rounds"] == 4  # A, B, the one after the refusals, the resumed A; not the suspended one
    for i in (1, 2, 3, 4):
        lead = load_file(str(group_run / f"rank0-round{i}.safetensors"))
        other = load_file(str(group_run / f"rank1-round{i}.safetensors"))
        assert lead.keys() == other.keys()
        for name in lead:
            assert torch.equal(lead[name], other[name]), (i, name)


def test_two_processes_train_as_one_process_on_the_whole_batch(group_run: Path):
    """The real check of the all-reduce: the same leases trained by one LocalTrainer (which draws
    the same batches) end at the same weights, losses and delta, up to float rounding."""
    notes = json.loads((group_run / "rank0.json").read_text())
    torch.set_num_threads(1)
    one = LocalTrainer(torch.device("cpu"))
    a = one.train_round(ROUND_A, base(0), tokens())
    after_a = get_params(one.model)
    b = one.train_round(ROUND_B, base(1), tokens())  # AdamW state and warm-up carried over from A
    for i, (single, losses) in enumerate([(after_a, a.losses), (get_params(one.model), b.losses)], start=1):
        lead = load_file(str(group_run / f"rank0-round{i}.safetensors"))
        for name, t in single.items():
            torch.testing.assert_close(lead[name], t, rtol=1e-4, atol=1e-5)
        # the whole batch's mean loss, not rank 0's rows alone
        assert notes[f"losses_{'ab'[i - 1]}"] == pytest.approx(losses, rel=1e-5)
    # tokens stay honest: the lease's batch, counted once, not once per process
    assert notes["tokens_a"] == a.tokens == ROUND_A.inner.steps * ROUND_A.inner.batch_size * MODEL.context
    assert notes["tokens_b"] == b.tokens
    # and the pseudo-gradient is the same (a value may fall on the other side of an int8 rounding)
    assert len(bytes.fromhex(notes["body_a"])) == pytest.approx(len(a.body), rel=0.05)


def test_a_resumed_round_goes_on_across_the_ranks(group_run: Path):
    notes = json.loads((group_run / "rank0.json").read_text())
    assert notes["resumed_at"] == 2
    uninterrupted = load_file(str(group_run / "rank0-round1.safetensors"))
    resumed = load_file(str(group_run / "rank0-round4.safetensors"))
    for name, t in uninterrupted.items():
        torch.testing.assert_close(resumed[name], t, rtol=0, atol=1e-6)
    assert notes["resumed_losses"] == pytest.approx(notes["losses_a"], rel=1e-6)


def test_set_aside_and_refused_rounds_leave_the_group_in_step(group_run: Path):
    notes = json.loads((group_run / "rank0.json").read_text())
    assert notes["suspended_at"] == 2
    sparta, small = notes["refused"]
    assert "sparta" in sparta and "one process" in sparta and "torchrun" in sparta
    assert "batch of 1 rows" in small and "--nproc-per-node 1" in small
    assert len(notes["losses_after"]) == 2  # a round after all that still trains on both ranks


def test_outside_torchrun_there_is_no_session():
    assert distributed.from_env("auto", environ={}) is None
    assert distributed.from_env("auto", environ={"WORLD_SIZE": "1", "RANK": "0"}) is None


def test_unsupported_setups_are_clear_errors(monkeypatch):
    with pytest.raises(RuntimeError, match="one machine"):
        distributed.from_env("cpu", environ={"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0",
                                             "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(RuntimeError, match="MPS is one device"):
        distributed.rank_device("mps", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distributed.rank_device("auto", 1) == torch.device("cuda", 1)
    assert distributed.rank_device("cpu", 1) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="--nproc-per-node 2 or fewer"):
        distributed.rank_device("cuda", 2)


# -- end to end: a coordinator over loopback and one torchrun worker of 2 processes ----------------

STEPS, BATCH, CONTEXT, ROUNDS = 6, 4, 32, 2


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("IDLETRAIN_") and k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
def test_a_torchrun_worker_of_two_processes_trains_against_a_coordinator(tmp_path: Path, corpus_dir: Path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    coord_log, worker_log = tmp_path / "coordinator.log", tmp_path / "worker.log"
    with open(coord_log, "w") as clog:
        coord = procs.popen([sys.executable, "-m", "idletrain", "--log-level", "WARNING", "coordinator", "serve",
                                  "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(tmp_path / "data"),
                                  "--corpus-dir", str(corpus_dir)],
                                 env=_env(), cwd=tmp_path, stdout=clog, stderr=subprocess.STDOUT)
    worker = None
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            try:
                wait_healthy(client, coord, 300)
            except RuntimeError as exc:
                pytest.fail(f"{exc}:\n{coord_log.read_text()[-3000:]}")
            created = client.post("/api/v1/runs", headers=admin_headers(tmp_path / "data"), json={
                "name": "dist", "corpus": str(corpus_dir), "shard_tokens": 4096, "eval_tokens": 4096,
                "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "context": CONTEXT},
                "inner": {"steps": STEPS, "batch_size": BATCH, "lr": 3e-3, "warmup_steps": 2},
                "compression": {"index": "topk", "fraction": 0.1, "values": "int8"}, "outer": {"group": 1}})
            assert created.status_code == 201, created.text

            # `-m --`: without the `--` torchrun takes the worker's `--run` for an abbreviation of its `--run-path`
            with open(worker_log, "w") as wlog:
                worker = procs.popen(
                    [str(TORCHRUN), "--nnodes", "1", "--nproc-per-node", str(WORLD), "--master-addr", "127.0.0.1",
                     "--master-port", str(free_port()), "-m", "--", "idletrain", "--log-level", "INFO", "worker", "run",
                     "--coordinator", url, "--run", "dist", "--max-rounds", str(ROUNDS), "--threads", "1",
                     "--device", "cpu", "--state-dir", str(tmp_path / "worker"), "--name", "two-procs"],
                    env=_env(), cwd=tmp_path, stdout=wlog, stderr=subprocess.STDOUT)
                try:
                    code = worker.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"the torchrun worker did not finish:\n{worker_log.read_text()[-4000:]}")
            log = worker_log.read_text()
            assert code == 0, log[-4000:]
            assert f"worker done: {ROUNDS} rounds delivered" in log, log[-4000:]
            assert f"rank 0 stopped after {ROUNDS} rounds trained together" in log, log[-4000:]
            assert "worker done (a follower rank" in log and "worker done: 0 rounds" not in log, log[-4000:]

            st = wait_merged(client, "dist", ROUNDS, timeout_s=30)
            assert st["merged_deltas"] == ROUNDS and st["rejected_deltas"] == 0
            assert st["workers_total"] == 1  # one worker to the coordinator: only rank 0 registered
            assert st["tokens_trained"] == ROUNDS * STEPS * BATCH * CONTEXT  # the batch counted once
    finally:
        for proc in (worker, coord):  # torchrun's ranks are its children: stop() ends its whole group
            if proc is not None:
                procs.stop(proc, signal.SIGINT if proc is coord else signal.SIGKILL)

