"""The dashboard in a real headless Chromium: a coordinator serving on a loopback socket, a tiny run
with workers uploading deltas through the real client and evaluations between them; the page must
render the chart's points and the leaderboard, and a screenshot is kept as a test artefact
(test-artifacts/dashboard.png under the repository root, or $IDLETRAIN_TEST_ARTIFACTS/dashboard.png).

Needs `chromium` (or `chromium-browser`) on PATH: `apt-get install -y chromium` (.ci/run installs it).
Without it the test is skipped, loudly.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import struct
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from coordinator.app import create_app
from coordinator.settings import CoordinatorSettings
from idletrain.harness import free_port
from shared import codec, protocol
from shared.algorithms.compress import compress
from shared.model import build_model, param_schema
from tests import procs
from worker.client import CoordinatorClient

API = protocol.API_PREFIX
ROOT = Path(__file__).resolve().parents[2]
WORKERS = ({"name": "ada", "team": "blue", "device": "cuda"}, {"name": "grace", "team": "blue", "device": "mps"},
           {"device": "cpu"})
ROUNDS = 2  # per worker; the model is evaluated after every merged delta


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def artefact_dir() -> Path:
    path = Path(os.environ.get("IDLETRAIN_TEST_ARTIFACTS") or ROOT / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Server:
    """create_app under uvicorn on 127.0.0.1:`port`, in a thread, merger running."""

    def __init__(self, settings: CoordinatorSettings, port: int) -> None:
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="dashboard-coordinator", daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def browse(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--disable-background-networking", "--no-first-run", "--hide-scrollbars", f"--user-data-dir={profile}",
           "--virtual-time-budget=8000", *args, url]
    # chromium starts helpers (zygote, renderer, gpu) of its own: in a process group of its own, all of
    # them are killed with it whether it exits, hangs past the timeout or the test is interrupted
    proc = procs.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        procs.stop(proc, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


@pytest.mark.slow
def test_dashboard_renders_in_headless_chromium(tmp_path: Path, corpus_dir: Path):
    if chromium() is None:
        pytest.skip("!!! CHROMIUM NOT FOUND: the dashboard was NOT tested in a browser. "
                    "Install it (apt-get install -y chromium; .ci/run does) to run this test. !!!")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    admin = "dashboard-admin-token-0123456789"
    settings = CoordinatorSettings(data_dir=tmp_path / "coordinator", merge_idle_s=0.01, admin_token=admin,
                                   corpus_dirs=[corpus_dir])
    with Server(settings, port), httpx.Client(base_url=url, timeout=60,
                                              headers={"Authorization": f"Bearer {admin}"}) as http:
        deadline = time.monotonic() + 60
        while True:
            try:
                if http.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the coordinator did not come up"
            time.sleep(0.1)
        resp = http.post(f"{API}/runs", json={
            "name": "dash", "corpus": str(corpus_dir), "corpus_max_bytes": 1 << 18, "shard_tokens": 1024,
            "eval_tokens": 4096, "eval_every": 1000, "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
            "inner": {"steps": 3, "batch_size": 2}, "outer": {"group": 3},
            "compression": {"index": "topk", "fraction": 0.1, "values": "int8"}})
        assert resp.status_code == 201, resp.text
        clients = []
        for who in WORKERS:
            reg = CoordinatorClient(url, max_retries=2).register("dash", protocol.RegisterRequest(**who))
            clients.append(CoordinatorClient(url, token=reg.token, max_retries=2))
        version = 0
        for rnd in range(ROUNDS):
            for i, client in enumerate(clients):
                lease, _ = client.lease("dash")
                assert lease is not None
                client.snapshot("dash", lease.base_version)  # traffic, as a real worker's
                client.shard("dash", lease.shard_id, expected_sha256=lease.shard_sha256)
                gen = torch.Generator().manual_seed(100 * rnd + i)
                schema = param_schema(build_model(lease.model))
                grads = {n: torch.randn(shape, generator=gen) * 1e-3 for n, shape in schema.items()}
                body = codec.encode(compress(grads, lease.compression, base_version=lease.base_version,
                                             round_seed=lease.seed))
                version = client.upload_delta(lease.lease_id, body).will_merge_into
                deadline = time.monotonic() + 60
                while http.get(f"{API}/runs/dash/status").json()["version"] < version:
                    assert time.monotonic() < deadline, "the merger did not catch up"
                    time.sleep(0.05)
                assert http.post(f"{API}/runs/dash/evaluate").status_code == 200
        for client in clients:
            client.close()
        evals = len(http.get(f"{API}/runs/dash/status").json()["eval_history"])
        assert evals == 1 + ROUNDS * len(WORKERS)

        page = f"{url}/?run=dash&who=ada"  # ada's history shows too
        dom = browse(page, tmp_path / "profile-dom", "--dump-dom")
        assert dom.returncode == 0, dom.stderr[-3000:]
        html = dom.stdout
        assert f'data-points="{evals}"' in html, html[-3000:]
        assert len(re.findall(r"<circle [^>]*data-version=", html)) == evals
        assert "<polyline" in html
        board = re.search(r'<tbody id="leaderboard">(.*?)</tbody>', html, flags=re.S).group(1)
        assert len(re.findall(r'<tr data-worker="\d+">', board)) == len(WORKERS)
        assert "ada" in board and "grace" in board and "blue" in board and "worker " in board  # unnamed: by id
        live = re.search(r'<tbody id="live">(.*?)</tbody>', html, flags=re.S).group(1)
        assert len(re.findall(r"<tr data-worker=", live)) == len(WORKERS) and "cuda" in live
        assert f'data-version="{version}"' in html  # <body>: the JSON was rendered
        assert re.search(r'<span id="status" class="muted">updated ', html)  # no error on the last poll
        assert 'data-progress="none"' in html  # the run has no token budget: a bar without a value
        history = re.search(r'<tbody id="history">(.*?)</tbody>', html, flags=re.S).group(1)
        assert len(re.findall(r'<tr data-day="\d{4}-\d\d-\d\d">', history)) == 1, history
        assert len(re.findall(r"<rect ", re.search(r'<svg id="spark".*?</svg>', html, flags=re.S).group(0))) == 1
        over_time = browse(f"{page}&x=time", tmp_path / "profile-time", "--dump-dom")
        assert f'data-points="{evals}" data-mode="time"' in over_time.stdout, over_time.stderr[-3000:]

        shot = artefact_dir() / "dashboard.png"
        shot.unlink(missing_ok=True)
        done = browse(page, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1280,900")
        assert done.returncode == 0, done.stderr[-3000:]
        assert shot.exists() and shot.stat().st_size > 20_000, "the screenshot is missing or blank"
        assert png_size(shot) == (1280, 900)
