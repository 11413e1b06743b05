"""worker.loop with settings.overlap: the upload of a round's delta runs on a background thread
(one at a time) while the worker moves on. Proved with a fake coordinator client whose uploads
block until the test says so: no timing thresholds, only the order of events."""

from __future__ import annotations

import hashlib
import threading
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
import torch

from shared import codec, protocol
from shared.algorithms.compress import delta_to_tensors
from shared.config import CompressionConfig, InnerConfig
from shared.model import ModelConfig, build_model, get_params, param_schema
from shared.snapshot import encode_snapshot
from worker.client import CoordinatorError
from worker.loop import Worker
from worker.settings import WorkerSettings
from worker.state import StateStore

URL = "http://coordinator.test"  # the in-process coordinator answers to this name (tests/worker/conftest.py)
MODEL = ModelConfig(n_layer=1, d_model=32, n_head=2, context=32)
SCHEMA = param_schema(build_model(MODEL))
STEPS = 4
WAIT_S = 60.0  # a safety net against a hang: every assertion is about order, never about time



class Killed(BaseException):
    """Stands for SIGKILL: nothing in the worker catches it."""


class FakeCoordinator:
    """What a coordinator remembers (leases, stored deltas), shared by the clients of a worker and of
    its restart. `keeps`: a lease request naming `keep` leaves that lease live (a coordinator that
    keeps a lease whose delta is uploading); otherwise every earlier lease of the worker is given up,
    as the coordinator does today."""

    def __init__(self, *, keeps: bool) -> None:
        self.keeps = keeps
        self.lock = threading.Lock()
        self.events: list[tuple] = []
        self.leases: dict[int, str] = {}  # id -> active | abandoned | delivered
        self.stored: dict[int, str] = {}  # lease id -> sha256 of the delta body stored for it
        self.arrivals: list[int] = []  # every upload that reached the coordinator, duplicates included
        self.refuse: set[int] = set()  # answer these leases' uploads 410
        self.hold: dict[int, threading.Event] = {}  # an upload of this lease waits for the event ...
        self.after_hold: dict[int, str] = {}  # ... then: "answer" (default) or "die" (the worker is killed)
        self.raw = bytes(range(256)) * 64
        self.sha = hashlib.sha256(self.raw).hexdigest()
        self.snapshot = encode_snapshot(get_params(build_model(MODEL)))
        self.compression = CompressionConfig(index="topk", fraction=0.1, values="int8")
        self.base_version = lambda: 0  # the version a new lease hands out

    def note(self, *event) -> None:
        with self.lock:
            self.events.append(event)

    def index(self, *event) -> int:
        return self.events.index(event)


class FakeClient:
    def __init__(self, coord: FakeCoordinator) -> None:
        self.c = coord
        self.token: str | None = None
        self.sent_bytes = self.received_bytes = 0

    def set_transfer(self, **kw) -> None:
        pass

    def close(self) -> None:
        pass

    def health(self, *, max_retries=None):
        return SimpleNamespace(status="ok", api_version=protocol.API_VERSION, keeps_delivering_lease=self.c.keeps)

    def lease(self, run: str, *, keep: int | None = None) -> tuple[protocol.Lease, float]:
        c = self.c
        with c.lock:
            for lid, state in c.leases.items():
                if state == "active" and not (c.keeps and lid == keep):
                    c.leases[lid] = "abandoned"
            lid = len(c.leases) + 1
            c.leases[lid] = "active"
        c.note("lease", lid, keep)
        return protocol.Lease(
            lease_id=lid, run=run, shard_id=0, shard_sha256=c.sha, base_version=c.base_version(), seed=lid, lr=3e-3,
            inner=InnerConfig(steps=STEPS, batch_size=2, warmup_steps=0), compression=c.compression,
            model=MODEL.to_dict(), deadline=datetime(2030, 1, 1, tzinfo=UTC)), 0.0

    def snapshot(self, run: str, version, *, if_sha256=None, max_bytes=None) -> tuple[bytes, int]:
        self.c.note("snapshot", version)
        return self.c.snapshot, int(version)  # the same weights under every version number

    def lease_standing(self, lease_id: int) -> protocol.LeaseStanding:
        with self.c.lock:
            state = self.c.leases.get(lease_id, "active")
        return protocol.LeaseStanding(lease_id=lease_id, state=state, deliverable=state == "active", reason=state)

    def release(self, lease_id: int) -> None:
        with self.c.lock:
            if self.c.leases.get(lease_id) == "active":
                self.c.leases[lease_id] = "abandoned"
        self.c.note("release", lease_id)

    def model_update(self, run: str, start: int, end: int, *, copy: str | None = None,
                     max_bytes=None) -> tuple[bytes, bool]:
        raise CoordinatorError(404, "no updates here: fetch the snapshot")

    def shard(self, run: str, index: int, *, expected_sha256: str, max_bytes=None, max_raw_bytes=None) -> bytes:
        self.c.note("shard", index)
        return self.c.raw

    def renew(self, lease_id: int, *, step: int):
        raise AssertionError("no lease here is near its deadline")

    def upload_delta(self, lease_id: int, body: bytes, *, start_state=None) -> protocol.DeltaAccepted:
        c = self.c
        c.note("upload", lease_id, threading.current_thread() is threading.main_thread())
        sha = hashlib.sha256(body).hexdigest()
        with c.lock:
            c.arrivals.append(lease_id)
            prior = c.stored.get(lease_id)
            refused = lease_id in c.refuse or (prior is None and c.leases.get(lease_id) != "active")
            if prior is None and not refused:
                c.stored[lease_id] = sha
                c.leases[lease_id] = "delivered"
        gate = c.hold.get(lease_id)
        if gate is not None:
            assert gate.wait(WAIT_S), "the test never released this upload"
            if c.after_hold.get(lease_id) == "die":
                raise Killed(f"upload of lease {lease_id}: the worker died before the answer")
        c.note("answered", lease_id)
        if refused:
            raise CoordinatorError(410, f"lease {lease_id} was given up")
        return protocol.DeltaAccepted(lease_id=lease_id, delta_id=lease_id, will_merge_into=lease_id,
                                      duplicate=prior is not None)


def make_worker(coord: FakeCoordinator, tmp_path, *, max_rounds: int, overlap: bool = True,
                lease_ahead: bool | None = None, every: int = 0) -> Worker:
    settings = WorkerSettings(coordinator=URL, run="t", token="x", state_dir=tmp_path / "worker", device="cpu",
                              max_rounds=max_rounds, overlap=overlap, checkpoint_every_steps=every)
    w = Worker(settings, client=FakeClient(coord))
    w.lease_ahead = lease_ahead
    real_on_step = w.progress.on_step

    def on_step(step: int, loss: float) -> None:  # what the trainer reports after each local step
        real_on_step(step, loss)
        coord.note("step", w.progress.lease.lease_id, step)

    w.progress.on_step = on_step
    return w


def at_step(w: Worker, lease_id: int, step: int, action) -> None:
    """Run action() once the worker has taken local step `step` of lease `lease_id`."""
    real_on_step = w.progress.on_step

    def on_step(s: int, loss: float) -> None:
        real_on_step(s, loss)
        if w.progress.lease.lease_id == lease_id and s == step:
            action()

    w.progress.on_step = on_step


def test_the_upload_runs_while_the_next_round_trains(tmp_path):
    coord = FakeCoordinator(keeps=True)
    second_round_trains = threading.Event()
    coord.hold[1] = second_round_trains
    w = make_worker(coord, tmp_path, max_rounds=2, lease_ahead=True)
    # lease 1's upload may answer only now: round 2 trained meanwhile
    at_step(w, 2, STEPS, second_round_trains.set)
    assert w.run() == 2
    ev = coord.events
    # lease 1's upload left on the upload thread; lease 2 was asked for keeping lease 1, and trained all
    # its steps before that upload was answered
    assert ("upload", 1, False) in ev and ("lease", 2, 1) in ev
    assert coord.index("upload", 1, False) < coord.index("step", 2, 1)
    assert coord.index("step", 2, STEPS) < coord.index("answered", 1)
    assert coord.stored.keys() == {1, 2} and coord.arrivals == [1, 2]
    assert StateStore(tmp_path / "worker", URL, "t").load_all_unsent() == []
    u = w.progress.utilisation
    assert u.rounds == 2 and 0 < u.compute_s <= u.wall_s()


def test_without_a_coordinator_that_keeps_the_lease_the_next_lease_waits_for_the_answer(tmp_path):
    """The coordinator of today gives up every earlier lease of a worker that asks for one: the
    upload still runs in the background, but the next lease is asked for once it is answered."""
    coord = FakeCoordinator(keeps=False)
    w = make_worker(coord, tmp_path, max_rounds=3)
    assert w.run() == 3
    for lid in (1, 2):
        assert ("upload", lid, False) in coord.events  # on the upload thread
        assert coord.index("answered", lid) < coord.index("lease", lid + 1, None)
    assert not any(e[0] == "lease" and e[2] is not None for e in coord.events)
    assert coord.stored.keys() == {1, 2, 3} and coord.arrivals == [1, 2, 3]


def test_no_overlap_uploads_on_the_training_thread_before_the_next_lease(tmp_path):
    coord = FakeCoordinator(keeps=True)
    w = make_worker(coord, tmp_path, max_rounds=2, overlap=False, lease_ahead=True)
    real_start = w.delivery.start
    w.delivery.start = lambda *a: (_ for _ in ()).throw(AssertionError("no background upload")) or real_start(*a)
    assert w.run() == 2
    assert [e for e in coord.events if e[0] in ("lease", "upload", "answered")] == [
        ("lease", 1, None), ("upload", 1, True), ("answered", 1),
        ("lease", 2, None), ("upload", 2, True), ("answered", 2)]


def test_a_kill_with_a_delta_in_flight_delivers_it_exactly_once(tmp_path):
    coord = FakeCoordinator(keeps=True)
    released = threading.Event()
    coord.hold[1], coord.after_hold[1] = released, "die"  # lease 1 arrives, its answer never does
    w1 = make_worker(coord, tmp_path, max_rounds=5, lease_ahead=True, every=1)

    def die() -> None:
        released.set()  # the upload thread dies with the process ...
        raise Killed("lease 2, step 3")  # ... killed in the middle of round 2

    at_step(w1, 2, 3, die)
    with pytest.raises(Killed):
        w1.run()
    assert w1.delivery.inflight is not None
    w1.delivery.inflight.done.wait(WAIT_S)
    store = StateStore(tmp_path / "worker", URL, "t")
    assert [u.lease.lease_id for u in store.load_all_unsent()] == [1]
    assert store.load().round.lease.lease_id == 2 and store.load().round.step == 2
    assert coord.stored.keys() == {1}

    coord.hold.clear()  # the coordinator answers the restarted worker at once
    w2 = make_worker(coord, tmp_path, max_rounds=2, lease_ahead=True, every=1)
    assert w2.run() == 2  # lease 1 (arrived before: the same answer), then lease 2 resumed at step 2
    assert coord.arrivals == [1, 1, 2]  # lease 1 reached the coordinator twice ...
    assert list(coord.stored) == [1, 2]  # ... and was stored once; no lease taken meanwhile
    assert [e for e in coord.events if e[0] == "lease"] == [("lease", 1, None), ("lease", 2, 1)]
    assert [e for e in coord.events if e[0] == "step" and e[1] == 2][-2:] == [("step", 2, 3), ("step", 2, 4)]
    assert store.load_all_unsent() == [] and store.load().round is None


def test_a_refused_delta_goes_back_to_the_residual_while_the_next_round_has_trained(tmp_path):
    coord = FakeCoordinator(keeps=True)
    coord.refuse.add(1)
    second_round_done = threading.Event()
    coord.hold[1] = second_round_done
    w = make_worker(coord, tmp_path, max_rounds=2, lease_ahead=True)
    at_step(w, 2, STEPS, second_round_done.set)
    seen: dict = {}
    real_take_back = w.delivery.take_back

    def take_back(lease, body):
        seen["thread"] = threading.current_thread() is threading.main_thread()
        seen["before"] = {n: t.clone() for n, t in w.trainer.residual.items()}
        seen["body"] = body
        real_take_back(lease, body)
        seen["after"] = {n: t.clone() for n, t in w.trainer.residual.items()}
        w.saver.join()  # the state goes to disk in the background: wait for it, as any later read does
        seen["disk"] = StateStore(tmp_path / "worker", URL, "t").load().residual

    w.delivery.take_back = take_back
    assert w.run() == 2  # lease 1 refused: one more round (lease 3) makes two delivered
    assert seen["thread"]  # settled on the training thread, between rounds
    # it was refused after round 2 had trained: round 2's residual takes lease 1's content back
    lease_3 = next(i for i, e in enumerate(coord.events) if e[:2] == ("lease", 3))
    assert coord.index("step", 2, STEPS) < coord.index("answered", 1) < lease_3
    sent = delta_to_tensors(codec.decode(seen["body"], schema=SCHEMA), SCHEMA)
    assert any(t.abs().sum() > 0 for t in sent.values())
    for name, t in sent.items():
        assert torch.equal(seen["after"][name], seen["before"][name] + t)
        assert torch.equal(seen["disk"][name], seen["after"][name])
    assert coord.stored.keys() == {2, 3}
    assert StateStore(tmp_path / "worker", URL, "t").load_all_unsent() == []


def test_a_refusal_is_added_to_the_residual_in_memory_and_on_disk(tmp_path):
    coord = FakeCoordinator(keeps=True)
    coord.refuse.add(1)
    w = make_worker(coord, tmp_path, max_rounds=1, lease_ahead=True)
    settled: dict = {}
    real_settle = w.delivery.settle

    def settle():
        up = w.delivery.inflight if not settled else None  # the first one: lease 1's
        if up is not None:
            up.done.wait(WAIT_S)
            settled["before"] = {n: t.clone() for n, t in w.trainer.residual.items()}
            settled["body"] = up.result.body
        real_settle()
        if up is not None:
            settled["after"] = {n: t.clone() for n, t in w.trainer.residual.items()}
            w.saver.join()
            settled["disk"] = StateStore(tmp_path / "worker", URL, "t").load().residual
            coord.refuse.clear()

    w.delivery.settle = settle
    assert w.run() == 1  # lease 1 refused, lease 2 delivered
    sent = delta_to_tensors(codec.decode(settled["body"], schema=SCHEMA), SCHEMA)
    for name, t in sent.items():
        assert torch.equal(settled["after"][name], settled["before"][name] + t)
        assert torch.equal(settled["disk"][name], settled["after"][name])
    assert coord.stored.keys() == {2}


def test_the_unsent_queue_keeps_deltas_in_lease_order(tmp_path):
    from tests.worker.test_state import make_lease

    store = StateStore(tmp_path, URL, "t")
    store.save_unsent(make_lease(lease_id=7), b"seven")
    store.save_unsent(make_lease(lease_id=8), b"eight")
    assert store.unsent_path.exists()  # the first one where older versions kept their one delta
    assert [(u.lease.lease_id, u.body) for u in store.load_all_unsent()] == [(7, b"seven"), (8, b"eight")]
    store.clear_unsent(7)
    assert [(u.lease.lease_id, u.body) for u in store.load_all_unsent()] == [(8, b"eight")]
    store.save_unsent(make_lease(lease_id=9), b"nine")
    assert [u.lease.lease_id for u in store.load_all_unsent()] == [8, 9]
    store.clear_unsent()
    assert store.load_all_unsent() == [] and store.load_unsent() is None


class _LeaseQueries:
    """Wraps test_resume's AppTransport, noting each lease request's query string."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.lease_queries: list[str] = []

    def handle_request(self, request):
        if request.url.path.endswith("/leases"):
            self.lease_queries.append(request.url.query.decode())
        return self.inner.handle_request(request)


def test_against_the_coordinator_the_next_lease_is_taken_while_the_delta_uploads(api, run, tmp_path):
    # (On PostgreSQL this once deadlocked: accept_delta locked the run FOR UPDATE, which blocked the
    # lease INSERT's foreign-key check; it now takes FOR NO KEY UPDATE.)
    import httpx

    from tests.worker.test_resume import AppTransport
    from worker.client import CoordinatorClient

    transport = _LeaseQueries(AppTransport(api))
    settings = WorkerSettings(coordinator=URL, run="t", state_dir=tmp_path / "worker", device="cpu", max_rounds=3)
    client = CoordinatorClient(URL, transport=httpx.MockTransport(transport.handle_request), max_retries=2)
    w = Worker(settings, client=client)
    assert w.run() == 3
    assert w.lease_ahead is True  # the coordinator's /healthz said it keeps such a lease
    posts = transport.inner.posts()
    # lease 2 was asked for (naming lease 1) before lease 1's delta was sent: fetched during round 1
    assert [p.rsplit("/", 1)[1] for p in posts if p.endswith(("/leases", "/delta"))][:3] == ["leases", "leases",
                                                                                             "delta"]
    assert transport.lease_queries[0] == "" and all(q.startswith("keep=") for q in transport.lease_queries[1:])
    st = api.status()
    assert st["pending_deltas"] + st["merged_deltas"] == 3 and st["rejected_deltas"] == 0
    assert StateStore(tmp_path / "worker", URL, "t").load_all_unsent() == []


def test_the_next_lease_its_model_and_shard_are_fetched_before_the_round_ends(tmp_path):
    coord = FakeCoordinator(keeps=True)
    w = make_worker(coord, tmp_path, max_rounds=3, lease_ahead=True)
    assert w.run() == 3
    ev = [e for e in coord.events if e[0] != "answered"]
    for lid in (2, 3):
        asked = coord.index("lease", lid, lid - 1)  # keeping the lease still training
        assert asked < coord.index("step", lid - 1, STEPS)  # before that round's last step
        # nothing was fetched between the end of one round and the start of the next
        between = ev[ev.index(("step", lid - 1, STEPS)) + 1:ev.index(("step", lid, 1))]
        assert [e for e in between if e[0] in ("lease", "snapshot", "shard")] == []
    assert [e[:2] for e in coord.events if e[0] == "lease"] == [("lease", 1), ("lease", 2), ("lease", 3)]
    assert coord.stored.keys() == {1, 2, 3}


def record_rounds(w: Worker) -> list[tuple[int, dict | None, bytes]]:
    """(lease id, the `ahead` its round started with, its delta body) of every round the worker trains."""
    rounds, real = [], w.trainer.train_round

    def train_round(lease, base, tokens, **kw):
        result = real(lease, base, tokens, **kw)
        rounds.append((lease.lease_id, kw.get("ahead"), result.body))
        return result

    w.trainer.train_round = train_round
    return rounds


def sent(body: bytes) -> dict[str, torch.Tensor]:
    return delta_to_tensors(codec.decode(body, schema=SCHEMA), SCHEMA)


def assert_ahead(got: dict | None, bodies: list[bytes]) -> None:
    assert got is not None and set(got) == set(SCHEMA)
    want = [sent(b) for b in bodies]
    for n in SCHEMA:
        assert torch.allclose(got[n], sum(w[n] for w in want), atol=1e-7), n


def test_a_round_leased_ahead_starts_past_the_own_deltas_its_base_lacks(tmp_path):
    """With the next lease taken while the last delta uploads, its base cannot hold that delta:
    the round starts from base - (own deltas not in it), so it does not learn and send their
    progress twice. Deltas acknowledged as versions the base holds drop out."""
    coord = FakeCoordinator(keeps=True)
    w = make_worker(coord, tmp_path, max_rounds=3, lease_ahead=True)
    rounds = record_rounds(w)
    assert w.run() == 3
    (l1, a1, b1), (l2, a2, b2), (l3, a3, b3) = rounds
    assert (l1, l2, l3) == (1, 2, 3) and a1 is None
    assert_ahead(a2, [b1])  # every lease hands out version 0: no delta of this worker is in it
    assert_ahead(a3, [b1, b2])

    coord2 = FakeCoordinator(keeps=True)
    coord2.base_version = lambda: len(coord2.stored)  # a base that holds every delta stored so far
    w2 = make_worker(coord2, tmp_path / "w2", max_rounds=3, overlap=False)
    rounds2 = record_rounds(w2)
    assert w2.run() == 3
    assert [a for _, a, _ in rounds2] == [None, None, None]


def test_a_refused_delta_is_not_carried_into_the_next_start(tmp_path):
    coord = FakeCoordinator(keeps=True)
    coord.refuse.add(1)
    w = make_worker(coord, tmp_path, max_rounds=2, overlap=False)
    rounds = record_rounds(w)
    assert w.run() == 2
    assert [lid for lid, _, _ in rounds] == [1, 2, 3]
    assert rounds[1][1] is None  # lease 1's delta went back to the residual instead
    assert_ahead(rounds[2][1], [rounds[1][2]])


def test_stopping_gives_back_the_lease_fetched_ahead(tmp_path):
    """Stopped during a round whose successor's lease was already fetched: the round finishes and
    uploads, and the untrained lease is given back (its shard is free at once, not at its deadline)."""
    coord = FakeCoordinator(keeps=True)
    w = make_worker(coord, tmp_path, max_rounds=10, lease_ahead=True)
    at_step(w, 2, STEPS, w.stop.event.set)
    assert w.run() == 2
    assert ("lease", 3, 2) in coord.events and ("release", 3) in coord.events
    assert coord.leases[3] == "abandoned" and coord.stored.keys() == {1, 2}
    assert not any(e[:2] == ("step", 3) for e in coord.events)  # never trained
