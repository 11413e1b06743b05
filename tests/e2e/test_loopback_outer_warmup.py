"""The outer warm-up end to end over real sockets on 127.0.0.1: DiLoCo's published outer optimiser
(lr 0.7, Nesterov 0.9) with its lr ramped over the first 4 momentum steps, trained by two
`idletrain worker run` processes against one `idletrain coordinator serve`. The coordinator
checkpoints every 2 versions, and its checkpoints show the momentum steps done (the warm-up's place)
advancing with the merged deltas, through the ramp."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from idletrain.harness import free_port
from tests import procs

ROUNDS = 4  # per worker
WORKERS = 2  # = group: one momentum step per two deltas
WARMUP = 4
CHECKPOINT_EVERY = 2


class Loopback(procs.Idletrain):
    def spawn_with(self, name: str, env: dict[str, str], *args: str) -> subprocess.Popen:
        """spawn, with `env` added to the process's environment."""
        out = open(self.logs / f"{name}.log", "w")
        self._files.append(out)
        proc = procs.popen([sys.executable, "-m", "idletrain", *args], env={**procs.env(), **env}, cwd=self.root,
                           stdout=out, stderr=subprocess.STDOUT)
        self.started.append(proc)
        return proc


def checkpoint_meta(path: Path) -> dict[str, str]:
    """The metadata of a coordinator checkpoint (a sha256 line, then a safetensors file)."""
    raw = path.read_bytes().partition(b"\n")[2]
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])["__metadata__"]


@pytest.mark.slow
def test_nesterov_09_with_an_outer_warmup_trains_over_loopback(tmp_path: Path, corpus_dir: Path):
    lb = Loopback(tmp_path)
    url = f"http://127.0.0.1:{free_port()}"
    data = tmp_path / "data"
    try:
        coord = lb.spawn_with("coordinator", {"IDLETRAIN_CHECKPOINT_EVERY": str(CHECKPOINT_EVERY)},
                              "--log-level", "WARNING", "coordinator", "serve", "--host", "127.0.0.1",
                              "--port", url.rsplit(":", 1)[1], "--data-dir", str(data),
                              "--corpus-dir", str(corpus_dir))
        with httpx.Client(base_url=url, timeout=120) as client:
            procs.wait_healthy(client, coord, lb.logs / "coordinator.log")
            client.headers.update(procs.admin_headers(data))
            created = client.post("/api/v1/runs", json={
                "name": "warm", "algorithm": "diloco", "corpus": str(corpus_dir), "shard_tokens": 4096,
                "eval_tokens": 4096, "eval_every": 2, "epochs": 0,
                "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "context": 32},
                "inner": {"steps": 10, "batch_size": 8, "lr": 3e-3, "warmup_steps": 3},
                "compression": {"index": "topk", "fraction": 0.1, "values": "int8"},
                "outer": {"lr": 0.7, "momentum": 0.9, "warmup": WARMUP, "group": WORKERS}})
            assert created.status_code == 201, created.text

            lb.train(url, "warm", workers=WORKERS, rounds=ROUNDS)
            acknowledged = WORKERS * ROUNDS
            procs.wait_merged(client, "warm", acknowledged, log=lb.logs / "coordinator.log")
            final = client.post("/api/v1/runs/warm/evaluate")
            assert final.status_code == 200, final.text
            st = client.get("/api/v1/runs/warm/status").json()
        assert st["merged_deltas"] == acknowledged and st["rejected_deltas"] == 0, st
        assert st["version"] == acknowledged and final.json()["version"] == acknowledged
        losses = [e["loss"] for e in st["eval_history"]]
        print("eval losses", [(e["version"], round(e["loss"], 3)) for e in st["eval_history"]],
              "final", round(final.json()["loss"], 3))
        assert final.json()["loss"] < losses[0], (losses, final.json())

        # every delta merged: after version v, v // group momentum steps, the ramp's place
        ckpts = sorted(data.glob("runs/*/checkpoints/*.ckpt"))
        metas = [checkpoint_meta(p) for p in ckpts]
        seen = [(int(m["version"]), int(m["groups"]), int(m["in_group"])) for m in metas]
        assert [v for v, _, _ in seen] == [4, 6, 8], seen  # the newest three, one per CHECKPOINT_EVERY
        assert all(g == v // WORKERS and k == 0 for v, g, k in seen), seen
        assert seen[-1][1] == WARMUP  # the ramp's groups all done: full lr from here on
        assert json.loads(metas[-1]["config"])["outer"]["warmup"] == WARMUP
        assert coord.poll() is None, procs.tail(lb.logs / "coordinator.log")
    finally:
        lb.close()
