"""A running Worker (against the in-process coordinator) paused, resumed and watched through its
local control channel: `idletrain worker pause|resume|status`, the status file, fake host readings
(user active, on battery) and the daily transfer cap. The worker runs in the test's thread; an
"operator" thread does what a person would, and the test checks what it saw."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from idletrain import cli
from shared import codec, protocol
from tests.conftest import schema_of
from worker import client as client_mod
from worker import governor as governor_mod
from tests.worker.conftest import no_backoff
from worker.client import CoordinatorClient
from worker.control import ControlFile, StatusFile, WorkerStatus
from worker.host import HostReaders
from worker.loop import Worker
from worker.settings import WorkerSettings
from worker.state import StateStore

URL = "http://coordinator.test"
STEPS = 8



@pytest.fixture(autouse=True)
def no_sleeping(monkeypatch):
    monkeypatch.setattr(client_mod.time, "sleep", lambda s: None)
    no_backoff(monkeypatch)


@pytest.fixture
def long_run(api, run_config):
    api.create_run(run_config(inner={"steps": STEPS, "batch_size": 2, "warmup_steps": 2}))


class Transport(httpx.BaseTransport):
    def __init__(self, api) -> None:
        self.api = api
        self.log: list[tuple[str, str]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.log.append((request.method, request.url.path))
        resp = self.api.client._transport.handle_request(request)
        if not isinstance(resp, httpx.Response):  # starlette's TestClient speaks httpx2 when it is installed
            resp = httpx.Response(resp.status_code, headers=resp.headers.multi_items(), content=resp.read(), request=request)
        return resp

    def posts(self) -> list[str]:
        return [p for m, p in self.log if m == "POST"]


def make_worker(api, tmp_path, *, host: HostReaders | None = None, **over) -> tuple[Worker, Transport]:
    transport = Transport(api)
    fields = dict(coordinator=URL, run="t", state_dir=tmp_path / "worker", device="cpu", max_rounds=1,
                  checkpoint_every_steps=0, check_every_s=0.05)
    fields.update(over)
    client = CoordinatorClient(URL, transport=transport, max_retries=2)
    return Worker(WorkerSettings(**fields), client=client, host=host), transport


def folder(tmp_path):
    return StateStore(tmp_path / "worker", URL, "t").dir


def read_status(tmp_path) -> WorkerStatus | None:
    return StatusFile(folder(tmp_path)).read()


def until(what: Callable[[], object], timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class Operator:
    """A person at the machine, in a thread: `script()` runs while the worker does; its failure is
    re-raised in the test. If it fails, it stops the worker, so the test never hangs."""

    def __init__(self, worker: Worker, script: Callable[[], None]) -> None:
        self.error: BaseException | None = None

        def body() -> None:
            try:
                script()
            except BaseException as exc:  # noqa: BLE001
                self.error = exc
                worker.stop.event.set()
                ControlFile(worker.store.dir).request(paused=False)

        self.thread = threading.Thread(target=body, daemon=True)

    def __enter__(self) -> Operator:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.thread.join(timeout=30)
        if self.error is not None:
            raise self.error


def cli_out(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 0
    return capsys.readouterr().out


def entries(body: bytes, lease: protocol.Lease) -> dict[str, tuple]:
    delta = codec.decode(body, schema=schema_of(lease))
    return {e.name: (e.index_kind, e.value_kind, e.k, e.values.tobytes(),
                     None if e.indices is None else e.indices.tobytes()) for e in delta.entries}


def pause_at_step(worker: Worker, step: int) -> None:
    """`idletrain worker pause` lands right after local step `step` (the next gate sees it)."""
    real = worker.progress.on_step

    def on_step(s: int, loss: float) -> None:
        real(s, loss)
        if s == step:
            ControlFile(worker.store.dir).request(paused=True)

    worker.progress.on_step = on_step


def record_uploads(worker: Worker) -> list[tuple[int, bytes]]:
    uploads: list[tuple[int, bytes]] = []
    real = worker.client.upload_delta

    def upload(lease_id: int, body: bytes, **kw):
        uploads.append((lease_id, body))
        return real(lease_id, body, **kw)

    worker.client.upload_delta = upload
    return uploads


# -- the tests --------------------------------------------------------------------------------------

def test_a_worker_paused_before_it_starts_waits_then_trains_on_resume(api, run, tmp_path, capsys):
    sd = str(tmp_path / "worker")
    out = cli_out(capsys, ["worker", "pause", "--state-dir", sd, "--coordinator", URL + "/", "--run", "t"])
    assert "paused" in out and "no worker running now" in out
    w, t = make_worker(api, tmp_path, max_upload_kbps=80_000, max_download_kbps=800_000)
    seen: dict = {}

    def script() -> None:
        st = until(lambda: (s := read_status(tmp_path)) and s.state == "paused" and s)
        seen["status"] = st
        seen["posts_while_paused"] = t.posts()
        seen["status_out"] = cli_out(capsys, ["worker", "status", "--state-dir", sd])
        seen["json"] = json.loads(cli_out(capsys, ["worker", "status", "--state-dir", sd, "--json"]))
        seen["resume_out"] = cli_out(capsys, ["worker", "resume", "--state-dir", sd])

    with Operator(w, script):
        assert w.run() == 1
    st = seen["status"]
    assert (st.pause_kind, st.run, st.coordinator, st.lease) == ("user", "t", URL, None)
    assert "idletrain worker resume" in st.reason
    assert seen["posts_while_paused"] == []  # no registration, no lease while paused
    assert "run t at http://coordinator.test" in seen["status_out"] and "paused" in seen["status_out"]
    assert "not running" not in seen["status_out"]
    (listed,) = seen["json"]
    assert listed["state"] == "paused" and listed["live"] is True
    assert "resumed" in seen["resume_out"] and "no worker running" not in seen["resume_out"]
    # the limits reached the client (fast enough here that nothing waited on them)
    assert (w.client.upload_bucket.rate, w.client.download_bucket.rate) == (10_000_000, 100_000_000)
    final = read_status(tmp_path)
    assert (final.state, final.rounds) == ("stopped", 1)
    # a shard came in (version 0 was built from the run's seed: only its hash was checked)
    assert final.bytes_sent > 0 and final.bytes_received > 0
    assert "not running" in cli_out(capsys, ["worker", "status", "--state-dir", sd])


def test_a_pause_mid_round_saves_waits_and_goes_on_in_place(api, long_run, tmp_path, caplog, train_delta):
    w, _ = make_worker(api, tmp_path)
    pause_at_step(w, 4)
    uploads = record_uploads(w)
    seen: dict = {}

    def script() -> None:
        seen["status"] = until(lambda: (s := read_status(tmp_path)) and s.state == "paused" and s)
        seen["saved"] = StateStore(tmp_path / "worker", URL, "t").load()
        ControlFile(folder(tmp_path)).request(paused=False)

    with caplog.at_level(logging.INFO), Operator(w, script):
        assert w.run() == 1
    st, saved = seen["status"], seen["saved"]
    assert (st.step, st.steps) == (4, STEPS) and st.lease is not None and st.next_sync_in_s is None
    assert saved.round is not None and saved.round.step == 4  # checkpointed before waiting
    assert saved.round.lease.lease_id == st.lease
    assert f"pausing lease {st.lease} after step 4/{STEPS} (saved)" in caplog.text
    assert "going on after" in caplog.text
    assert "resuming lease" not in caplog.text  # it went on in place, not from disk
    # non-tty: the display's plain lines, one at each change
    assert any(r.name == "worker.progress" and r.getMessage().startswith("paused: ") for r in caplog.records)
    (lease_id, body), = uploads
    headers = {"Authorization": f"Bearer {w.client.token}"}
    assert entries(body, saved.round.lease) == entries(train_delta(api, saved.round.lease, headers),
                                                       saved.round.lease)


def test_a_long_pause_lets_the_lease_go_and_the_saved_round_resumes(api, long_run, tmp_path, caplog, train_delta,
                                                                    monkeypatch):
    monkeypatch.setattr(governor_mod, "hold_limit_s", lambda left_s: 0.2)
    w, t = make_worker(api, tmp_path)
    pause_at_step(w, 4)
    uploads = record_uploads(w)
    seen: dict = {}

    def script() -> None:
        # let go: still paused, between rounds now, the round on disk
        seen["status"] = until(lambda: (s := read_status(tmp_path)) and s.state == "paused" and s.lease is None
                               and "set aside" in caplog.text and s)
        seen["posts"] = t.posts()
        seen["saved"] = StateStore(tmp_path / "worker", URL, "t").load()
        ControlFile(folder(tmp_path)).request(paused=False)

    with caplog.at_level(logging.INFO), Operator(w, script):
        assert w.run() == 1
    assert "letting it go" in caplog.text
    lease = seen["saved"].round.lease
    assert seen["saved"].round.step == 4
    (lease_id, body), = uploads
    assert lease_id == lease.lease_id
    assert f"resuming lease {lease_id} at step 4/{STEPS}" in caplog.text
    assert sum(p.endswith("/leases") for p in seen["posts"]) == 1  # no new lease while paused
    assert sum(p.endswith("/leases") for p in t.posts()) == 1  # the same lease, resumed, delivered
    # and resumed from disk it is the delta an uninterrupted round makes, value for value
    headers = {"Authorization": f"Bearer {w.client.token}"}
    assert entries(body, lease) == entries(train_delta(api, lease, headers), lease)
    state = StateStore(tmp_path / "worker", URL, "t").load()
    assert state.round is None and state.steps_done == STEPS
    api.drain()
    assert api.status()["merged_deltas"] == 1


def test_stopping_while_paused_keeps_the_round_for_the_next_start(api, long_run, tmp_path, caplog):
    w, _ = make_worker(api, tmp_path)
    pause_at_step(w, 4)

    def script() -> None:
        until(lambda: (s := read_status(tmp_path)) and s.state == "paused")
        w.stop.event.set()  # Ctrl-C while paused

    with caplog.at_level(logging.INFO), Operator(w, script):
        assert w.run() == 0
    assert "stopping while paused" in caplog.text
    saved = StateStore(tmp_path / "worker", URL, "t").load()
    assert saved.round.step == 4
    assert read_status(tmp_path).state == "stopped"
    # the pause outlives the process: a restart stays paused until resumed
    w2, t2 = make_worker(api, tmp_path)

    def script2() -> None:
        until(lambda: (s := read_status(tmp_path)) and s.state == "paused" and s.pid)
        ControlFile(folder(tmp_path)).request(paused=False)

    caplog.clear()
    with caplog.at_level(logging.INFO), Operator(w2, script2):
        assert w2.run() == 1
    assert f"resuming lease {saved.round.lease.lease_id} at step 4/{STEPS}" in caplog.text
    assert sum(p.endswith("/leases") for p in t2.posts()) == 0


def test_idle_mode_waits_for_the_user_and_the_power_cord(api, run, tmp_path):
    host = {"idle_s": 0.0, "battery": True}
    readers = HostReaders(user_idle_s=lambda: host["idle_s"], on_battery=lambda: host["battery"])
    w, t = make_worker(api, tmp_path, host=readers, when="idle", idle_minutes=1)
    kinds: list[str] = []

    def watch(kind: str) -> WorkerStatus:
        st = until(lambda: (s := read_status(tmp_path)) and s.pause_kind == kind and s)
        kinds.append(kind)
        assert t.posts() == []
        return st

    def script() -> None:
        assert "plugged in" in watch("battery").reason
        host["battery"] = False
        assert "in use" in watch("active").reason
        host["idle_s"] = 61.0  # the user left a minute ago

    with Operator(w, script):
        assert w.run() == 1
    assert kinds == ["battery", "active"]
    assert read_status(tmp_path).rounds == 1


def test_the_daily_cap_pauses_until_tomorrow_and_survives_a_restart(api, run, tmp_path):
    w, _ = make_worker(api, tmp_path, daily_transfer_mb=0.001, max_rounds=2)  # 1000 bytes: one round crosses it

    def script() -> None:
        st = until(lambda: (s := read_status(tmp_path)) and s.pause_kind == "cap" and s)
        assert st.rounds == 1 and st.transfer_today_bytes > 1000 and st.transfer_cap_bytes == 1000
        assert "00:00 UTC" in st.reason
        w.stop.event.set()

    with Operator(w, script):
        assert w.run() == 1
    stored = json.loads((tmp_path / "worker" / "transfer.json").read_text())
    assert stored["bytes"] == read_status(tmp_path).transfer_today_bytes > 1000
    w2, t2 = make_worker(api, tmp_path, daily_transfer_mb=0.001)

    def script2() -> None:
        until(lambda: (s := read_status(tmp_path)) and s.pause_kind == "cap" and s.rounds == 0)
        w2.stop.event.set()

    with Operator(w2, script2):
        assert w2.run() == 0
    assert t2.posts() == []


def test_status_and_pause_without_any_worker(tmp_path, capsys):
    assert cli.main(["worker", "status", "--state-dir", str(tmp_path)]) == 2
    assert "no worker has run under" in capsys.readouterr().err
    assert cli.main(["worker", "pause", "--state-dir", str(tmp_path), "--run", "t"]) == 2
