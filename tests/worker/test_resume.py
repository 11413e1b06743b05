"""worker.loop against the in-process coordinator: a killed worker delivers its saved delta or
finishes its interrupted round before asking for a new lease, and a coordinator that is down
or restarting is waited for."""

from __future__ import annotations

import logging
import re
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import update

from coordinator.models import Lease, utcnow
from shared import codec, protocol
from tests.conftest import schema_of
from worker import client as client_mod
from tests.worker.conftest import no_backoff
from worker.client import CoordinatorClient
from worker.loop import Worker
from worker.settings import WorkerSettings
from worker.state import StateStore, TrainerState

API = protocol.API_PREFIX
URL = "http://coordinator.test"
STEPS = 8



@pytest.fixture(autouse=True)
def no_sleeping(monkeypatch):
    """Backoff waits of the client and of the loop take no time here."""
    monkeypatch.setattr(client_mod.time, "sleep", lambda s: None)
    no_backoff(monkeypatch)


class Killed(BaseException):
    """Stands for SIGKILL or a laptop's lid: nothing in the worker catches it."""


class AppTransport(httpx.BaseTransport):
    """The in-process app behind a CoordinatorClient, with a log of requests and switches to play
    a coordinator that is down or an answer that is lost."""

    def __init__(self, api) -> None:
        self.api = api
        self.log: list[tuple[str, str]] = []
        self.down = 0  # refuse this many more connections
        self.fail_path: str | None = None  # requests to paths ending so ...
        self.fail_times = 0  # ... fail this many times (connection refused) ...
        self.kill_after: str | None = None  # ... or reach the app, then the worker dies before the answer

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.log.append((request.method, path))
        if self.down > 0:
            self.down -= 1
            raise httpx.ConnectError("connection refused", request=request)
        if self.fail_path and path.endswith(self.fail_path) and self.fail_times > 0:
            self.fail_times -= 1
            raise httpx.ConnectError("connection refused", request=request)
        resp = self.api.client._transport.handle_request(request)
        if not isinstance(resp, httpx.Response):  # starlette's TestClient speaks httpx2 when it is installed
            resp = httpx.Response(resp.status_code, headers=resp.headers.multi_items(), content=resp.read(), request=request)
        if self.kill_after and path.endswith(self.kill_after):
            resp.read()
            raise Killed(path)
        return resp

    def posts(self) -> list[str]:
        return [p for m, p in self.log if m == "POST"]


def make_worker(api, tmp_path, *, max_rounds: int | None = 1, every: int = 3,
                max_retries: int = 2, run: str = "t") -> tuple[Worker, AppTransport]:
    transport = AppTransport(api)
    settings = WorkerSettings(coordinator=URL, run=run, state_dir=tmp_path / "worker", device="cpu",
                              max_rounds=max_rounds, checkpoint_every_steps=every, max_retries=max_retries)
    client = CoordinatorClient(URL, transport=transport, max_retries=max_retries)
    return Worker(settings, client=client), transport


@pytest.fixture
def long_run(api, run_config):
    """A tiny run whose rounds are long enough to be interrupted: 8 steps."""
    api.create_run(run_config(inner={"steps": STEPS, "batch_size": 2, "warmup_steps": 2}))


def kill_at_step(worker: Worker, step: int) -> list[int]:
    """Make the worker die right after its checkpoint at `step` reached the disk."""
    saved: list[int] = []
    real = worker.saver.save

    def save(state: TrainerState) -> None:
        real(state)
        saved.append(state.round.step if state.round else -1)
        if state.round is not None and state.round.step == step:
            raise Killed(f"step {step}")

    worker.saver.save = save
    return saved


def entries(body: bytes, lease: protocol.Lease) -> dict[str, tuple]:
    delta = codec.decode(body, schema=schema_of(lease))
    return {e.name: (e.index_kind, e.value_kind, e.k, e.values.tobytes(),
                     None if e.indices is None else e.indices.tobytes()) for e in delta.entries}


def delta_uploads(transport: AppTransport) -> list[int]:
    return [int(m.group(1)) for p in transport.posts() if (m := re.search(r"/leases/(\d+)/delta$", p))]


def test_unsent_delta_is_delivered_on_restart_before_any_new_lease(api, run, tmp_path, caplog):
    w1, t1 = make_worker(api, tmp_path)
    t1.fail_path, t1.fail_times = "/delta", 1
    # the upload fails (connection refused, no retries left), then the worker is killed while waiting
    w1.client.max_retries = 0
    w1.connection.wait = lambda attempt, exc: (_ for _ in ()).throw(Killed("while waiting"))
    with pytest.raises(Killed):
        w1.run()
    store = StateStore(tmp_path / "worker", URL, "t")
    unsent = store.load_unsent()
    assert unsent is not None
    lease_id = unsent.lease.lease_id
    assert api.status()["merged_deltas"] + api.status()["pending_deltas"] == 0

    w2, t2 = make_worker(api, tmp_path)
    with caplog.at_level(logging.INFO, logger="worker"):
        assert w2.run() == 1
    # the first thing the new process posts is the saved delta; it asks for no lease at all
    assert t2.posts() == [f"{API}/leases/{lease_id}/delta"]
    assert f"lease {lease_id}: delivering its delta saved before the interruption" in caplog.text
    assert store.load_unsent() is None
    assert api.status()["pending_deltas"] == 1
    api.drain()
    st = api.status()
    assert (st["merged_deltas"], st["rejected_deltas"]) == (1, 0)


def test_a_delta_that_arrived_but_whose_answer_was_lost_is_not_counted_twice(api, run, tmp_path, caplog):
    w1, t1 = make_worker(api, tmp_path)
    t1.kill_after = "/delta"  # the coordinator stored it; the worker died before reading the 202
    with pytest.raises(Killed):
        w1.run()
    assert api.status()["pending_deltas"] == 1
    w2, t2 = make_worker(api, tmp_path, max_rounds=2)
    with caplog.at_level(logging.INFO, logger="worker"):
        assert w2.run() == 2  # the saved delta again (same answer), then one new round
    assert "it had arrived before" in caplog.text
    uploads = delta_uploads(t2)
    assert len(uploads) == 2 and uploads[0] == delta_uploads(t1)[0]
    assert api.status()["pending_deltas"] == 2  # two deltas, not three
    api.drain()
    assert api.status()["merged_deltas"] == 2


def test_a_round_killed_midway_resumes_and_delivers_the_same_lease(api, long_run, tmp_path, caplog, train_delta):
    w1, _ = make_worker(api, tmp_path, every=3)
    saved = kill_at_step(w1, 6)
    with pytest.raises(Killed):
        w1.run()
    assert saved == [3, 6]
    state = StateStore(tmp_path / "worker", URL, "t").load()
    lease = state.round.lease
    lease_id = lease.lease_id
    assert state.round.step == 6 and len(state.round.losses) == 6

    w2, t2 = make_worker(api, tmp_path, every=3)
    uploaded: list[bytes] = []
    real_upload = w2.client.upload_delta
    w2.client.upload_delta = lambda lid, body, **kw: (uploaded.append(body), real_upload(lid, body, **kw))[1]
    with caplog.at_level(logging.INFO, logger="worker"):
        assert w2.run() == 1
    assert f"resuming lease {lease_id} at step 6/{STEPS}" in caplog.text
    assert "(resumed at step 6)" in caplog.text
    # no new lease, no snapshot: the round's own state was enough; the shard came from the cache
    assert t2.posts() == [f"{API}/leases/{lease_id}/delta"]
    assert not any("/snapshots/" in p or "/shards/" in p for _, p in t2.log)
    # and the delta is the one an uninterrupted round of that lease makes, value for value (the bytes
    # differ only in the order of the tensors, which follows the snapshot's, which safetensors shuffles)
    headers = {"Authorization": f"Bearer {w2.client.token}"}
    assert len(uploaded) == 1
    assert entries(uploaded[0], lease) == entries(train_delta(api, lease, headers), lease)
    state = StateStore(tmp_path / "worker", URL, "t").load()
    assert state.round is None and state.steps_done == STEPS  # between rounds now
    assert StateStore(tmp_path / "worker", URL, "t").load_unsent() is None
    api.drain()
    assert api.status()["merged_deltas"] == 1


def test_a_resumed_lease_the_coordinator_gave_away_is_dropped(api, long_run, tmp_path, caplog):
    w1, _ = make_worker(api, tmp_path, every=4)
    kill_at_step(w1, 4)
    with pytest.raises(Killed):
        w1.run()
    old = StateStore(tmp_path / "worker", URL, "t").load().round.lease.lease_id
    # the same worker takes another lease meanwhile (another process with its token): the old one is given up
    headers = {"Authorization": f"Bearer {w1.client.token}"}
    api.lease(headers)
    w2, t2 = make_worker(api, tmp_path, every=0)
    with caplog.at_level(logging.INFO, logger="worker"):
        assert w2.run() == 1
    # asked before training on: not resumed, not trained, not sent (it once trained on, then got 410)
    assert (f"lease {old}: it was given up when this worker took a newer lease; its round saved at step "
            f"4/{STEPS} is dropped, and this worker takes a new lease") in caplog.text
    assert f"resuming lease {old}" not in caplog.text
    uploads = delta_uploads(t2)
    assert len(uploads) == 1 and uploads[0] != old  # a new lease, delivered
    assert api.status()["pending_deltas"] == 1


@pytest.mark.parametrize("leased_again", [True, False])
def test_a_resumed_lease_that_expired_meanwhile_is_asked_about_first(api, long_run, tmp_path, caplog, leased_again):
    """The worker was down past its lease's deadline. If the shard went to another worker meanwhile,
    the saved round is dropped before any step (it once trained 75 steps more, then got 410); if not,
    its delta is still taken, so it resumes."""
    w1, _ = make_worker(api, tmp_path, every=4)
    kill_at_step(w1, 4)
    with pytest.raises(Killed):
        w1.run()
    old = StateStore(tmp_path / "worker", URL, "t").load().round.lease.lease_id
    with api.db() as s:
        s.execute(update(Lease).where(Lease.id == old).values(deadline=utcnow() - timedelta(seconds=5)))
        s.commit()
    api.coordinator.leases.expire()
    if leased_again:
        api.lease(api.register(name="other"))  # the shard of the expired lease: the least trained
        with api.db() as s:
            assert s.get(Lease, old).shard_id in {row.shard_id for row in s.query(Lease).filter(Lease.id != old)}
    w2, t2 = make_worker(api, tmp_path, every=0)
    with caplog.at_level(logging.INFO, logger="worker"):
        assert w2.run() == 1
    uploads = delta_uploads(t2)
    if leased_again:
        assert f"lease {old}: it expired at " in caplog.text and "its shard was leased to another worker since; " \
            f"its round saved at step 4/{STEPS} is dropped" in caplog.text
        assert old not in uploads and len(uploads) == 1
    else:
        assert f"resuming lease {old} at step 4/{STEPS}" in caplog.text
        assert uploads == [old] and api.status()["pending_deltas"] == 1


def test_corrupt_local_state_is_ignored(api, run, tmp_path, caplog):
    store = StateStore(tmp_path / "worker", URL, "t")
    store.dir.mkdir(parents=True)
    store.state_path.write_bytes(b"0" * 64 + b"\nnot safetensors")
    store.unsent_path.write_bytes(b"half a fi")
    w, t = make_worker(api, tmp_path)
    with caplog.at_level(logging.WARNING):
        assert w.run() == 1
    assert caplog.text.count("unusable") == 2
    assert delta_uploads(t) and store.load() is not None  # trained and saved a good state


def test_the_worker_waits_for_a_coordinator_that_is_not_up_yet(api, run, tmp_path, caplog):
    w, t = make_worker(api, tmp_path)
    t.down = 5
    with caplog.at_level(logging.WARNING):
        assert w.run() == 1
    assert caplog.text.count(f"coordinator {URL} unreachable") == 5
    assert "retrying in" in caplog.text
    assert [p for _, p in t.log[:6]] == ["/healthz"] * 6


def test_a_coordinator_restart_during_the_upload_is_waited_out(api, run, tmp_path, caplog):
    w, t = make_worker(api, tmp_path, max_retries=2)
    t.fail_path, t.fail_times = "/delta", 7  # longer than one request's retries (3 tries), then up again
    with caplog.at_level(logging.WARNING):
        assert w.run() == 1
    assert "unreachable" in caplog.text
    posts = t.posts()
    assert sum(p.endswith("/leases") for p in posts) == 1  # the delta waited on disk: no second lease
    assert len(delta_uploads(t)) == 8
    assert StateStore(tmp_path / "worker", URL, "t").load_unsent() is None
    assert api.status()["pending_deltas"] == 1


def test_the_first_ctrl_c_ends_the_wait_for_the_coordinator(api, run, tmp_path):
    w, t = make_worker(api, tmp_path)
    t.down = 10 ** 6
    waits: list[float] = []

    def wait(timeout: float) -> bool:
        waits.append(timeout)
        if len(waits) == 3:
            w.stop.event.set()
        return w.stop.event.is_set()

    w.stop.event.wait = wait
    assert w.run() == 0
    assert len(waits) == 3


def test_a_refusal_no_retry_mends_waits_instead_of_stopping_the_worker(api, run, tmp_path):
    """(tests/worker/test_refusals.py has the rest.) A run that is not there: the worker says so and
    waits; it exits only when stopped, so a service manager does not restart it in a loop."""
    w, _ = make_worker(api, tmp_path, run="no-such-run")
    refused = []

    def wait_blocked(exc) -> None:
        refused.append(exc)
        w.stop.event.set()

    w.connection.wait_blocked = wait_blocked
    assert w.run() == 0
    assert [type(e).__name__ for e in refused] == ["RunUnavailable"] and refused[0].status == 404


def test_a_kill_between_saving_the_delta_and_the_state_delivers_without_training_again(api, long_run, tmp_path,
                                                                                        caplog):
    w1, _ = make_worker(api, tmp_path, every=3)

    def killed() -> None:
        raise Killed("after the delta, before the end-of-round state")

    w1.saver.save_trainer = killed
    with pytest.raises(Killed):
        w1.run()
    store = StateStore(tmp_path / "worker", URL, "t")
    lease_id = store.load_unsent().lease.lease_id
    assert store.load().round.lease.lease_id == lease_id  # the last checkpoint of the same round
    w2, t2 = make_worker(api, tmp_path)
    with caplog.at_level(logging.INFO, logger="worker"):
        assert w2.run() == 1
    assert f"lease {lease_id} ended before the restart" in caplog.text
    assert "resuming" not in caplog.text
    assert t2.posts() == [f"{API}/leases/{lease_id}/delta"]
    state = store.load()
    assert state.round is None and state.residual == {}  # that residual was already in the delta


def test_two_workers_cannot_share_one_state_folder(api, run, tmp_path):
    other = StateStore(tmp_path / "worker", URL, "t")
    assert other.lock()
    try:
        w, t = make_worker(api, tmp_path)
        with pytest.raises(RuntimeError, match="its own --state-dir"):
            w.run()
        assert t.log == []
    finally:
        other.unlock()
    w, _ = make_worker(api, tmp_path)
    assert w.run() == 1
    assert other.lock()  # released when run() returned
    other.unlock()


def test_a_worker_of_a_finished_run_says_so_once_and_stops(api, run, tmp_path, caplog):
    """A worker started with --run on a run that is finished: one INFO line that says so (its detail
    not wrapped in itself), then it exits 0 (no restart loop: the service files restart on failure
    only) instead of waiting with an ERROR line repeated."""
    import logging

    assert api.operator("post", f"{API}/runs/t/finish", params={"grace_s": 0}).status_code == 200
    w, _ = make_worker(api, tmp_path, max_rounds=None)
    w.connection.wait_blocked = lambda exc: pytest.fail(f"waited on a finished run: {exc.message()}")
    with caplog.at_level(logging.INFO, logger="worker"):
        assert w.run() == 0
    said = [r for r in caplog.records if "nothing more to train" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, caplog.text
    assert said[0].getMessage().startswith("run 't' finished (") and "finished (run 't'" not in said[0].getMessage()
    assert w.left is not None and w.left.status == 410
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_first_ctrl_c_saves_the_round_at_its_step_and_the_second_quits(api, long_run, tmp_path, caplog,
                                                                            monkeypatch):
    """Issue 36: the first Ctrl-C acted only once the whole lease was trained (minutes at 21M
    parameters). Now it saves the round after the step it is in and the worker exits, saying so; the
    restart resumes from that step. A second Ctrl-C raises KeyboardInterrupt at once."""
    import signal

    from worker.control import StopFlag

    w, t = make_worker(api, tmp_path, max_rounds=None, every=0)  # no periodic checkpoint: the stop saves
    real = w._step_hook

    def hook(lease):
        inner = real(lease)

        def on_step(step: int, loss: float) -> None:
            inner(step, loss)
            if step == 3:
                w.stop.event.set()
        return on_step

    monkeypatch.setattr(w, "_step_hook", hook)
    with caplog.at_level(logging.INFO, logger="worker"):
        assert w.run() == 0
    lease_id = StateStore(tmp_path / "worker", URL, "t").load().round.lease.lease_id
    assert f"lease {lease_id}: stopped after step 3/{STEPS} (saved: the round resumes there" in caplog.text
    assert delta_uploads(t) == [] and StateStore(tmp_path / "worker", URL, "t").load().round.step == 3
    w2, t2 = make_worker(api, tmp_path, every=0)
    with caplog.at_level(logging.INFO, logger="worker"):
        assert w2.run() == 1
    assert f"resuming lease {lease_id} at step 3/{STEPS}" in caplog.text and delta_uploads(t2) == [lease_id]

    flag, handlers = StopFlag(), {}
    monkeypatch.setattr(signal, "signal", lambda sig, fn: handlers.__setitem__(sig, fn))
    flag.install()
    handlers[signal.SIGINT](signal.SIGINT, None)
    assert flag.event.is_set() and "saved when its current step ends" in caplog.text
    with pytest.raises(KeyboardInterrupt):
        handlers[signal.SIGTERM](signal.SIGTERM, None)
