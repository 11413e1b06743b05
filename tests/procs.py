"""Real processes for the tests that cross a socket: `python -m idletrain ...`, nginx, a browser.

Every process a test starts goes through `popen`, which puts it in a session (process group) of its
own and remembers it, so that:
    stop(proc, sig)   signals the process, waits, then kills whatever is left of its group: the API
                      processes of `serve --processes N`, a worker's children — nothing outlives it;
    kill_leftovers()  (the suite's conftest calls it when the session ends) kills every group a test
                      started and did not stop, also when the test was interrupted.

    env()             the environment of a spawned process: no IDLETRAIN_* of the caller's, one thread
    tail(path)        the end of a log, for a failure message
    admin_headers     the operator's Authorization header for a `serve` on a data dir
    wait_healthy      until a started coordinator answers /healthz (the test fails with its log if not)
    wait_merged       until a run has merged all it acknowledged and reached a version
    Idletrain         the `python -m idletrain` processes of one test (a coordinator first, then
                      workers: train() runs them for some rounds), each logging to logs/NAME.log;
                      close() stops them all
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from idletrain.harness import free_port
from idletrain.harness import wait_healthy as _wait_healthy_or_raise

_started: list[subprocess.Popen] = []


def popen(argv: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen in a process group of its own, remembered until the session ends."""
    proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
    _started.append(proc)
    return proc


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group's id is the leader's pid (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass  # nothing of the group is left


def stop(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the process, give it 20 s to exit, then kill it and every process of its group."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    _kill_group(proc)


def kill_leftovers() -> int:
    """Kill the group of every process a test started; how many leaders were still running."""
    alive = 0
    for proc in _started:
        if proc.poll() is None:
            alive += 1
            proc.kill()
            proc.wait(timeout=10)
        _kill_group(proc)
    _started.clear()
    return alive


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("IDLETRAIN_")}
    out.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return out


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text()[-n:]
    except OSError:
        return "(no log)"


def admin_headers(data_dir: Path) -> dict[str, str]:
    """The operator's Authorization header for a `serve` started on `data_dir` without a token: the
    one it generated there (written before it listens, so once it answers /healthz)."""
    return {"Authorization": f"Bearer {(data_dir / 'admin_token').read_text().strip()}"}


def wait_healthy(client: httpx.Client, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    """Until a started coordinator answers /healthz: about 6 s on an idle 2-core machine, ten times that
    beside a busy suite; the bound only ends a test whose coordinator never starts."""
    try:
        _wait_healthy_or_raise(client, proc, timeout_s)
    except RuntimeError as exc:
        pytest.fail(f"{exc}:\n{tail(log)}")


def wait_merged(client: httpx.Client, run: str, version: int, *, log: Path | None = None,
                timeout_s: float = 180) -> dict:
    """Wait until the run has merged everything queued and reached `version`; its status."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.get(f"/api/v1/runs/{run}/status").json()
        if st["pending_deltas"] == 0 and st["version"] >= version:
            return st
        assert time.monotonic() < deadline, f"merger did not catch up: {st}" + (f"\n{tail(log)}" if log else "")
        time.sleep(0.2)


def assert_trained(st: dict, final_loss: float, deltas: int) -> None:
    """A run's status after its workers' rounds: every one of `deltas` merged, none rejected, and the
    final evaluation more than 0.05 below the first."""
    assert st["merged_deltas"] == deltas and st["rejected_deltas"] == 0, st
    losses = [e["loss"] for e in st["eval_history"]]
    assert final_loss < losses[0] - 0.05, (losses, final_loss)


class Idletrain:
    """`python -m idletrain ARGS` processes of one test, run in `root`, each logging to
    root/logs/NAME.log. close() kills the workers (everything after the first) and stops the first,
    the coordinator, with SIGINT, as its operator would."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir(exist_ok=True)
        self.started: list[subprocess.Popen] = []
        self._files: list = []

    def spawn(self, name: str, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        out = open(self.logs / f"{name}.log", "w")
        self._files.append(out)
        proc = popen([sys.executable, "-m", "idletrain", *args], env={**env(), **(extra_env or {})}, cwd=self.root,
                     stdout=out, stderr=subprocess.STDOUT)
        self.started.append(proc)
        return proc

    def serve(self, data: Path, corpus_dir: Path, **extra_env: str) -> str:
        """`coordinator serve` (the first process, logging WARNING and up to coordinator.log) on a free
        loopback port, with `extra_env` added to its environment, once it answers healthy; its URL."""
        url = f"http://127.0.0.1:{free_port()}"
        coord = self.spawn("coordinator", "--log-level", "WARNING", "coordinator", "serve", "--host", "127.0.0.1",
                           "--port", url.rsplit(":", 1)[1], "--data-dir", str(data), "--corpus-dir", str(corpus_dir),
                           extra_env=extra_env)
        with httpx.Client(base_url=url, timeout=60) as client:
            wait_healthy(client, coord, self.logs / "coordinator.log")
        return url

    def settle(self, client: httpx.Client, run: str, deltas: int) -> tuple[float, dict]:
        """After the workers' rounds: wait until `deltas` deltas are merged, evaluate the global model once
        more; (its loss, the run's status). The coordinator (the first process) must still be running."""
        log = self.logs / "coordinator.log"
        wait_merged(client, run, deltas, log=log)
        final = client.post(f"/api/v1/runs/{run}/evaluate")
        assert final.status_code == 200, final.text
        st = client.get(f"/api/v1/runs/{run}/status").json()
        assert self.started[0].poll() is None, tail(log)
        return final.json()["loss"], st

    def spot_checks(self, client: httpx.Client, run: str, judged: int, timeout_s: float = 120) -> list[dict]:
        """Each worker's spot checks by verdict, once `judged` of them are judged (the replays run in the
        background, one round each; a pending check is not judged yet) or `timeout_s` has passed. The
        coordinator (the first process) must still be running."""
        deadline = time.monotonic() + timeout_s
        while True:
            checks = [w["spot_checks"] for w in client.get(f"/api/v1/runs/{run}/workers").json()]
            done = sum(n for c in checks for state, n in c.items() if state != "pending")
            if done == judged or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert self.started[0].poll() is None, tail(self.logs / "coordinator.log")
        return checks

    def train(self, url: str, run: str, *, workers: int, rounds: int, timeout_s: float = 120,
              prefix: str = "") -> list[str]:
        """`worker run` processes w0..w{workers-1} (named PREFIXworker{i}, state in root/PREFIXworker{i})
        for `rounds` rounds each; the test fails unless each exits 0 having delivered them all.
        Returns each worker's log."""
        started = [self.spawn(f"{prefix}worker{i}", "--log-level", "INFO", "worker", "run", "--coordinator", url,
                              "--run", run, "--max-rounds", str(rounds), "--threads", "1", "--device", "cpu",
                              "--state-dir", str(self.root / f"{prefix}worker{i}"), "--name", f"w{i}")
                   for i in range(workers)]
        logs = []
        for i, proc in enumerate(started):
            log_path = self.logs / f"{prefix}worker{i}.log"
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {i} did not finish {rounds} rounds:\n{tail(log_path)}")
            log = log_path.read_text()
            assert code == 0, f"worker {i} exited {code}:\n{log[-3000:]}"
            assert f"worker done: {rounds} rounds delivered" in log, log[-3000:]
            logs.append(log)
        return logs

    @classmethod
    @contextlib.contextmanager
    def serving(cls, root: Path, corpus_dir: Path) -> Iterator[tuple[Idletrain, str, httpx.Client]]:
        """(the processes, the coordinator's URL, an operator's client) of a `coordinator serve` in
        `root`, for the length of the block; every process is stopped after it."""
        lb = cls(root)
        try:
            url = lb.serve(lb.root / "data", corpus_dir)
            with httpx.Client(base_url=url, timeout=120) as admin:
                admin.headers.update(admin_headers(lb.root / "data"))
                yield lb, url, admin
        finally:
            lb.close()

    def close(self) -> None:
        for proc in self.started[1:]:
            stop(proc, signal.SIGKILL)
        if self.started:
            stop(self.started[0], signal.SIGINT)
        for f in self._files:
            f.close()
