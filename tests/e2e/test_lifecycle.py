"""End to end over 127.0.0.1: a run with a small token budget finishes while a real `idletrain worker
run` process, given no --run, follows the coordinator: it trains the run of highest priority until
that one answers 410 (finished), then moves on to the next one. The finished run has its final
evaluation, its Hugging Face export in the data dir, and its state; `run archive` and `run delete`
from the command line refuse and act as they say."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from idletrain.cli import main
from idletrain.harness import free_port
from tests import procs

STEPS, BATCH, CONTEXT = 3, 4, 32
ROUND_TOKENS = STEPS * BATCH * CONTEXT


def _run(name: str, corpus_dir: Path, **lifecycle) -> dict:
    return {"name": name, "corpus": str(corpus_dir), "corpus_max_bytes": 1 << 18, "shard_tokens": 4096,
            "eval_tokens": 4096, "eval_every": 1, "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "context": CONTEXT},
            "inner": {"steps": STEPS, "batch_size": BATCH, "warmup_steps": 1}, "outer": {"group": 1}, **lifecycle}


def _cli(root: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    """An operator's `idletrain` command against the coordinator's socket, run in this process (a
    command's own process would spend most of its time importing torch)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*args, "--coordinator", url, "--data-dir", str(root / "data")])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _wait_state(client: httpx.Client, run: str, state: str, log: Path, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.get(f"/api/v1/runs/{run}/status").json()
        if st["state"] == state:
            return st
        if time.monotonic() > deadline:
            pytest.fail(f"run {run} is {st['state']}, not {state}:\n{procs.tail(log)}")
        time.sleep(0.3)


@pytest.mark.slow
def test_a_run_reaches_its_budget_and_the_worker_moves_on(tmp_path: Path, corpus_dir: Path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    running = procs.Idletrain(tmp_path)
    logs = running.logs
    try:
        coord = running.spawn("coordinator", "--log-level", "INFO", "coordinator", "serve", "--host", "127.0.0.1",
                              "--port", str(port), "--data-dir", str(tmp_path / "data"), "--corpus-dir",
                              str(corpus_dir))
        with httpx.Client(base_url=url, timeout=120) as client:
            procs.wait_healthy(client, coord, logs / "coordinator.log")
            client.headers.update(procs.admin_headers(tmp_path / "data"))
            for cfg in (_run("first", corpus_dir, token_budget=2 * ROUND_TOKENS, priority=5),
                        _run("second", corpus_dir, priority=1, epochs=0)):
                created = client.post("/api/v1/runs", json=cfg)
                assert created.status_code == 201, created.text

            worker = running.spawn("worker", "--log-level", "INFO", "worker", "run", "--coordinator", url,
                                   "--max-rounds", "4", "--threads", "1", "--device", "cpu",
                                   "--state-dir", str(tmp_path / "worker"), "--name", "follower")
            try:
                code = worker.wait(timeout=180)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the worker did not deliver 4 rounds:\n{procs.tail(logs / 'worker.log')}")
            log = (logs / "worker.log").read_text()
            assert code == 0, log[-3000:]
            assert "training run first (priority 5)" in log and "run first finished" in log, log[-3000:]
            assert "training run second (priority 1)" in log and "worker done: 4 rounds delivered" in log

            st = _wait_state(client, "first", "finished", logs / "coordinator.log")
            assert st["tokens_trained"] == st["token_budget"] == 2 * ROUND_TOKENS  # not a round past it
            assert st["finished_at"] is not None and st["version"] == 2 and st["merged_deltas"] == 2
            assert st["eval_history"][-1]["version"] == 2  # the final evaluation
            export = tmp_path / "data" / "runs" / "1" / "exports" / "final"
            assert json.loads((export / "config.json").read_text())["n_layer"] == 1
            assert (export / "model.safetensors").stat().st_size > 0 and (export / "tokenizer.json").is_file()
            second = client.get("/api/v1/runs/second/status").json()
            assert second["state"] == "active" and second["tokens_trained"] == 2 * ROUND_TOKENS

            # the operator's commands, over the same socket
            shown = _cli(tmp_path, url, "run", "show", "first")
            assert shown.returncode == 0 and "run first is finished: 768 of 768 tokens" in shown.stdout, shown
            refused = _cli(tmp_path, url, "run", "archive", "second")
            assert refused.returncode == 2 and "only a finished or paused run" in refused.stderr, refused
            archived = _cli(tmp_path, url, "run", "archive", "first")
            assert archived.returncode == 0 and "is archived" in archived.stdout, archived
            assert not list((tmp_path / "data" / "runs" / "1" / "shards").iterdir())
            assert (export / "model.safetensors").is_file()
            no = _cli(tmp_path, url, "run", "delete", "second")
            assert no.returncode == 2 and "pass --yes" in no.stderr, no
            active = _cli(tmp_path, url, "run", "delete", "second", "--yes")
            assert active.returncode == 2 and "force" in active.stderr, active
            gone = _cli(tmp_path, url, "run", "delete", "second", "--yes", "--force")
            assert gone.returncode == 0 and "run second deleted" in gone.stdout, gone
            assert [r["name"] for r in client.get("/api/v1/runs").json()] == ["first"]
    finally:
        running.close()
