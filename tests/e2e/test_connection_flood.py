"""Connections anyone can hold open, against a real `idletrain coordinator serve` over real sockets.

One address (127.0.0.9) holds 2,000 sockets that send nothing and 60 uploads trickling 10 B/s (with
valid tokens and leases, so they pass the app's checks before the body), re-dialing whatever the
server closes, while honest workers from 127.0.0.2-5 lease and upload small deltas on fresh
connections. Every honest request is answered (no 503, no timeout) with p99 under 1 s; the
attacker's trickles get 408 once their grace ends, its sockets past the per-address cap get 503 at
once, and those admitted are closed at the head deadline. Before the connection guard, the idle
sockets filled limit_concurrency (1024) and every other request got 503.

`serve --processes 2` runs the same guard in each process: checked with short bounds.
"""

from __future__ import annotations

import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch

from idletrain.harness import free_port
from shared import codec, protocol
from shared.algorithms.compress import compress
from shared.model import build_model, param_schema
from tests import procs
from tests.attackers import Flood
from tests.conftest import fresh_database, write_corpus

API = protocol.API_PREFIX
RUN = "flood"
ATTACKER = "127.0.0.9"
HONEST = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
IDLE, TRICKLES, TRICKLE_TOKENS = 2000, 60, 30  # two uploads in flight per token: max_concurrent_uploads
ATTACK_S = 45.0  # past the head deadline (20 s) and the body grace (10 s), twice over
REDIAL_S = 5.0  # the attacker dials each slot again this long after the server closed it
HEAD_S, GRACE_S, PER_ADDRESS = 20.0, 10.0, 128  # the defaults under test (coordinator/settings.py)
LATE_S = 10.0  # the most a cut may come after its deadline on a loaded machine


def raise_open_files(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if min(hard, resource.getrlimit(resource.RLIMIT_NOFILE)[0]) < n:
        pytest.skip(f"this test holds {n} sockets; the open-files hard limit is {hard}")


def client(url: str, source: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=30, transport=httpx.HTTPTransport(local_address=source))


def delta_for(lease: protocol.Lease) -> bytes:
    gen = torch.Generator().manual_seed(lease.lease_id)
    grads = {n: torch.randn(shape, generator=gen) * 1e-3 for n, shape in param_schema(build_model(lease.model)).items()}
    return codec.encode(compress(grads, lease.compression, base_version=lease.base_version, round_seed=lease.seed))


class Honest(threading.Thread):
    """A worker at `source`: lease, upload a small delta, on a fresh connection each round (a real
    worker's pooled connection expires during its round), noting each request's seconds and status."""

    def __init__(self, url: str, source: str, token: str) -> None:
        super().__init__(daemon=True)
        self.url, self.source, self.auth = url, source, {"Authorization": f"Bearer {token}"}
        self.timings: list[tuple[str, int | str, float]] = []  # (what, status or error, seconds)
        self.stop = threading.Event()

    def round(self) -> None:
        with client(self.url, self.source) as http:
            t0 = time.perf_counter()
            resp = http.post(f"{API}/runs/{RUN}/leases", headers=self.auth)
            self.timings.append(("lease", resp.status_code, time.perf_counter() - t0))
            if resp.status_code != 200:
                return
            lease = protocol.Lease.model_validate(resp.json())
            body = delta_for(lease)
            t0 = time.perf_counter()
            resp = http.post(f"{API}/leases/{lease.lease_id}/delta", content=body,
                             headers={**self.auth, "Content-Type": "application/octet-stream"})
            self.timings.append(("upload", resp.status_code, time.perf_counter() - t0))

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.round()
            except httpx.HTTPError as exc:
                self.timings.append(("error", type(exc).__name__, 0.0))
            self.stop.wait(0.4)


def upload_head(lease_id: int, token: str, declared: int = 100_000) -> bytes:
    return (f"POST {API}/leases/{lease_id}/delta HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {declared}\r\n\r\n").encode()


def p99(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(len(xs) * 0.99 + 0.5) - 1)]


def run_config(corpus: Path) -> dict:
    """A tiny run with a shard for every lease the test makes (four times what the honest workers took
    on an idle machine: with every free shard out, a lease request gets 204); no screen refuses a random delta (the
    honest workers' standing must not throttle them into 429s), no spot check takes the CPU."""
    return {"name": RUN, "corpus": str(corpus), "corpus_max_bytes": 1 << 21, "shard_tokens": 1024,
            "eval_tokens": 4096, "eval_every": 50, "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
            "inner": {"steps": 3, "batch_size": 2}, "outer": {"group": 4}, "robust": {"enabled": False},
            "compression": {"index": "dense", "values": "int8", "error_feedback": False}, "epochs": 0}


def attacker_leases(url: str) -> list[tuple[int, str]]:
    """TRICKLE_TOKENS workers registered and leased from ATTACKER: (lease id, token) for each trickle."""
    out = []
    with client(url, ATTACKER) as http:
        for _ in range(TRICKLE_TOKENS):
            resp = http.post(f"{API}/runs/{RUN}/workers", json={})
            assert resp.status_code == 201, resp.text
            token = resp.json()["token"]
            resp = http.post(f"{API}/runs/{RUN}/leases", headers={"Authorization": f"Bearer {token}"})
            assert resp.status_code == 200, resp.text
            out += [(resp.json()["lease_id"], token)] * 2
    return out


@pytest.mark.slow
def test_idle_sockets_and_trickling_uploads_from_one_address_leave_honest_workers_served(tmp_path: Path):
    raise_open_files(IDLE + TRICKLES + 500)
    corpus = write_corpus(tmp_path / "corpus", n_files=1600)  # 1.6 MB: ~1,560 shards of 1024 tokens
    its = procs.Idletrain(tmp_path)
    floods: list[Flood] = []
    try:
        # 30 tokens from one address: the attacker's set-up, faster than its registration burst allows
        url = its.serve(tmp_path / "data", corpus, IDLETRAIN_REGISTER_BURST="40", IDLETRAIN_SPOT_CHECK_RATE="0")
        port = int(url.rsplit(":", 1)[1])
        with httpx.Client(base_url=url, timeout=60) as http:
            resp = http.post(f"{API}/runs", json=run_config(corpus), headers=procs.admin_headers(tmp_path / "data"))
            assert resp.status_code == 201, resp.text
            tokens = []
            for source in HONEST:
                with client(url, source) as c:
                    tokens.append(c.post(f"{API}/runs/{RUN}/workers", json={}).json()["token"])
        honest = [Honest(url, source, token) for source, token in zip(HONEST, tokens)]
        warm = 0
        for w in honest:  # warm-up: the first requests of a process import and compile what they need
            for _ in range(3):
                w.round()
            warm += sum(1 for what, status, _ in w.timings if what == "upload" and status == 202)
            w.timings.clear()
        trickles = Flood(port, source=ATTACKER, openings=[upload_head(*lt) for lt in attacker_leases(url)],
                         feed=b"x" * 10, redial_s=REDIAL_S)
        idle = Flood(port, source=ATTACKER, openings=[b""] * IDLE, feed=b"", redial_s=REDIAL_S)
        floods.extend((trickles, idle))
        trickles.start()  # the trickles take their connections first, then the flood fills the rest
        idle.start()
        for w in honest:
            w.start()
        time.sleep(ATTACK_S)
        for w in honest:
            w.stop.set()
        for w in honest:
            w.join(60)
        check(honest, trickles.finish(), idle.finish(), its.logs / "coordinator.log")
        with httpx.Client(base_url=url, timeout=60) as http:  # nothing acknowledged is lost
            accepted = sum(1 for w in honest for what, status, _ in w.timings if what == "upload" and status == 202)
            deadline = time.monotonic() + 120
            while (st := http.get(f"{API}/runs/{RUN}/status").json())["pending_deltas"] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert st["merged_deltas"] + st["rejected_deltas"] == accepted + warm, (st, accepted, warm)
        assert not list((tmp_path / "data").rglob(".lease-*.part"))  # no cut upload left a file behind
    finally:
        for flood in floods:
            flood.kill()
        its.close()


def spread(xs: list[float]) -> str:
    return f"{min(xs):.1f}-{max(xs):.1f} s" if xs else "never"


def status_of(got: bytes) -> str:
    """An outcome's status line ("HTTP/1.1 408 Request Timeout"), or "closed" when nothing came."""
    return got.split(b"\r\n", 1)[0].decode(errors="replace") or "closed"


def check(honest: list[Honest], trickles: list[tuple[bytes, float]], idle: list[tuple[bytes, float]],
          log: Path) -> None:
    """What everyone got: the honest workers' answers and seconds, the attacker's sockets' outcomes
    (printed first, then held to the bounds)."""
    timings = [t for w in honest for t in w.timings]
    bad = [t for t in timings if t[1] not in (200, 202)]
    seconds = sorted(s for what, status, s in timings if status in (200, 202))
    cut = [(s, got) for got, s in trickles if got.startswith(b"HTTP/1.1 408 ")]
    refused = [s for got, s in idle if got.startswith(b"HTTP/1.1 503 ")]
    closed = [s for got, s in idle if not got]
    print(f"\nhonest: {len(timings)} requests, {len(bad)} failed; seconds p50 "
          f"{statistics.median(seconds) if seconds else 0:.3f} p99 {p99(seconds) if seconds else 0:.3f} "
          f"max {max(seconds, default=0):.3f}\n"
          f"trickles: {Counter(status_of(got) for got, _ in trickles)}; 408 after {spread([s for s, _ in cut])}\n"
          f"idle: {Counter(status_of(got) for got, _ in idle)}; 503 p99 {p99(refused) if refused else 0:.3f} s, "
          f"closed after {spread(closed)}")
    assert not bad, f"{len(bad)} of {len(timings)} honest requests failed, e.g. {bad[:5]}\n{procs.tail(log)}"
    assert sum(what == "upload" for what, _, _ in timings) >= 40, len(timings)
    assert p99(seconds) < 1.0, seconds[-10:]

    assert len(cut) >= TRICKLES, len(cut)  # before: none (100 KB at 10 B/s take 2.8 hours)
    assert all(b"below the 2048 bytes/s" in got for _, got in cut), cut[0]
    assert all(GRACE_S - 0.5 <= s <= GRACE_S + LATE_S for s, _ in cut), sorted(s for s, _ in cut)

    assert len(refused) >= IDLE - PER_ADDRESS  # the first wave past the cap, at least
    assert all(b"connections open" in got for got, _ in idle if got.startswith(b"HTTP/1.1 503 "))
    assert len(closed) >= PER_ADDRESS - TRICKLES - 10, len(closed)
    assert all(HEAD_S - 0.5 <= s <= HEAD_S + LATE_S for s in closed), closed
    assert len(refused) + len(closed) == len(idle)  # nothing else: no answer to a socket that sent nothing


@pytest.mark.slow
def test_each_of_several_processes_guards_its_connections(tmp_path: Path, corpus_dir: Path):
    """`serve --processes 2`: the guard reaches each process (uvicorn spawns them with a pickled copy)."""
    with fresh_database("postgresql") as db_url:
        port, log = free_port(), tmp_path / "coordinator.log"
        proc = procs.popen([sys.executable, "-m", "idletrain", "--log-level", "WARNING", "coordinator", "serve",
                            "--port", str(port), "--data-dir", str(tmp_path / "data"), "--database-url", db_url,
                            "--processes", "2", "--corpus-dir", str(corpus_dir)],
                           stdout=log.open("ab"), stderr=subprocess.STDOUT,
                           env={**procs.env(), "IDLETRAIN_HEAD_TIMEOUT_S": "2", "IDLETRAIN_MAX_CONNECTIONS_PER_ADDRESS": "3"})
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                procs.wait_healthy(http, proc, log)
            held = []
            for _ in range(20):  # at most 3 per process are admitted, whichever process takes each
                s = socket.socket()
                s.bind((ATTACKER, 0))
                s.settimeout(30)
                s.connect(("127.0.0.1", port))
                held.append(s)
            answers = []
            for s in held:
                with s:
                    t0, data = time.monotonic(), b""
                    while chunk := s.recv(4096):
                        data += chunk
                    answers.append((data[:13], time.monotonic() - t0))
            refused = [a for a in answers if a[0] == b"HTTP/1.1 503 "]
            closed = [a for a in answers if a[0] == b""]
            assert len(refused) >= 14 and len(refused) + len(closed) == 20, answers
            assert closed and all(s <= 2 + LATE_S for _, s in closed), answers  # the head deadline, in each process
        finally:
            procs.stop(proc, signal.SIGINT)
