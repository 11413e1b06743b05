"""A worker refused in a way retrying cannot mend (an upload over the coordinator's cap, an API
version out of its range, a run gone) says what is wrong and what to do once, keeps what it
trained, waits (shown as "blocked" in its status) and never exits; Ctrl-C stops it at once, and it
goes on once the coordinator changes."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest

from shared import protocol
from tests.worker.test_resume import URL, AppTransport, delta_uploads, make_worker, no_sleeping  # noqa: F401
from worker.answers import Blocked, UploadTooLarge, VersionRefused, size_text
from worker.client import CoordinatorClient, RunUnavailable
from worker.loop import Worker
from worker.settings import WorkerSettings
from worker.state import StateStore

SMALL_CAP = 4096  # bytes: below the tiny run's round delta (~12 KiB), above every JSON body


@pytest.fixture(autouse=True)
def quick_rechecks(monkeypatch):
    """A blocked worker asks the coordinator again every 20 ms here, not every few minutes."""
    monkeypatch.setattr(UploadTooLarge, "recheck_s", 0.02)
    monkeypatch.setattr(VersionRefused, "recheck_s", 0.02)
    monkeypatch.setattr(Blocked, "recheck_s", 0.02)


def until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def start(worker) -> tuple[threading.Thread, dict]:
    """Run the worker on a thread; the dict gets its return value or what it raised."""
    out: dict = {}

    def run() -> None:
        try:
            out["rounds"] = worker.run()
        except BaseException as exc:  # noqa: BLE001 -- the test asserts there is none
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def guard(transport: AppTransport) -> threading.Lock:
    """A lock each request holds: held, the test may swap the app behind the transport."""
    lock, handle = threading.Lock(), transport.handle_request

    def handle_request(request):
        with lock:
            return handle(request)

    transport.handle_request = handle_request
    return lock


def errors_saying(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and text in r.getMessage()]


@pytest.mark.parametrize("told_by", ["healthz", "413"])
def test_a_delta_over_the_upload_cap_waits_on_disk_until_the_cap_is_raised(open_api, settings, run_config,
                                                                           tmp_path, caplog, told_by):
    """The cap known from /healthz (the delta is not even sent) or learnt from the coordinator's 413."""
    caplog.set_level(logging.INFO)
    with open_api(settings) as api:
        api.create_run(run_config())
    small = open_api(settings.model_copy(update={"max_upload_bytes": SMALL_CAP}))
    api = small.__enter__()
    worker, transport = make_worker(api, tmp_path, max_rounds=1)
    swap = guard(transport)
    if told_by == "413":  # the worker does not know the cap: it sends the delta, the coordinator refuses it
        real = worker.client.health

        def health(**kw):
            answer = real(**kw)
            worker.client.max_upload_bytes = None
            return answer

        worker.client.health = health
    thread, out = start(worker)
    try:
        until(lambda: worker.status().state == "blocked")
        store = StateStore(tmp_path / "worker", URL, "t")
        (unsent,) = store.load_all_unsent()  # the round's delta is kept
        said = f"the coordinator refuses uploads over {size_text(SMALL_CAP)}; this round's delta is " \
               f"{size_text(len(unsent.body))}"
        assert said in worker.status().reason and "IDLETRAIN_MAX_UPLOAD_BYTES" in worker.status().reason
        checks = len([p for m, p in transport.log if p == "/healthz"])
        until(lambda: len([p for m, p in transport.log if p == "/healthz"]) >= checks + 3)  # it asks again ...
        assert len(errors_saying(caplog, said)) == 1  # ... and says it once
        assert thread.is_alive() and "error" not in out
        assert len(delta_uploads(transport)) == (0 if told_by == "healthz" else 1)
        # the operator raises the cap and restarts the coordinator; the worker was down meanwhile
        with swap:
            transport.down = 10**9
    finally:
        small.__exit__(None, None, None)
    with open_api(settings) as api:
        with swap:
            transport.api, transport.down = api, 0
        thread.join(60)
        assert not thread.is_alive() and out == {"rounds": 1}
        assert store.load_all_unsent() == []
        status = api.status()
        assert status["merged_deltas"] + status["pending_deltas"] == 1, status


def test_a_blocked_worker_stops_at_once(open_api, settings, run_config, tmp_path, monkeypatch):
    monkeypatch.setattr(UploadTooLarge, "recheck_s", 600.0)  # as in real life: Ctrl-C must not wait for it
    with open_api(settings) as api:
        api.create_run(run_config())
    with open_api(settings.model_copy(update={"max_upload_bytes": SMALL_CAP})) as api:
        worker, _ = make_worker(api, tmp_path, max_rounds=None)
        thread, out = start(worker)
        until(lambda: worker.status().state == "blocked")
        t0 = time.monotonic()
        worker.stop.event.set()
        thread.join(30)
        assert not thread.is_alive() and time.monotonic() - t0 < 10 and out == {"rounds": 0}
        assert len(StateStore(tmp_path / "worker", URL, "t").load_all_unsent()) == 1  # still there for the next start


def test_a_worker_outside_the_coordinators_range_waits_saying_what_to_install(api, run, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    mine = protocol.API_VERSION + 1
    worker, transport = make_worker(api, tmp_path)
    worker.client = worker.connection.client = CoordinatorClient(URL, transport=transport, max_retries=2,
                                                                 api_version=mine, min_api_version=mine)
    thread, out = start(worker)
    until(lambda: worker.status().state == "blocked")
    until(lambda: len(transport.log) >= 4)  # /healthz asked again, nothing else
    install = api.client.get("/healthz").json()["worker_install"]
    said = (f"accepts worker API v{protocol.MIN_API_VERSION}" if protocol.MIN_API_VERSION == protocol.API_VERSION
            else f"accepts worker API v{protocol.MIN_API_VERSION}..v{protocol.API_VERSION}")
    (line,) = errors_saying(caplog, said)
    assert f"this worker speaks v{mine}" in line and install in line
    assert worker.status().reason == line
    assert {p for _, p in transport.log} == {"/healthz"}  # never registered, leased or trained
    worker.stop.event.set()
    thread.join(30)
    assert not thread.is_alive() and out == {"rounds": 0}


def test_a_newer_coordinator_that_still_serves_the_worker_works(api, run, tmp_path, monkeypatch):
    monkeypatch.setattr(protocol, "API_VERSION", protocol.API_VERSION + 1)  # the coordinator moved on ...
    worker, _ = make_worker(api, tmp_path)  # ... this worker speaks the older version, still served
    assert worker.client.api_version == protocol.API_VERSION - 1
    assert worker.run() == 1


def test_426_mid_run_waits_until_the_coordinator_serves_the_worker_again(api, run, tmp_path, caplog):
    """The coordinator stops serving this worker's version while it runs (426 to its registration),
    then serves it again: the worker waits, then trains and delivers."""
    upgrade = pytest.MonkeyPatch()  # its own: undoing it must keep the quick rechecks
    worker, transport = make_worker(api, tmp_path)
    mine = worker.client.api_version
    real = worker.client.health
    started = threading.Event()

    def health(**kw):
        answer = real(**kw)
        if not started.is_set():  # the worker passed its start check: the coordinator is upgraded
            started.set()
            upgrade.setattr(protocol, "MIN_API_VERSION", mine + 1)
            upgrade.setattr(protocol, "API_VERSION", mine + 1)
        return answer

    worker.client.health = health
    try:
        thread, out = start(worker)
        until(lambda: worker.status().state == "blocked")
        assert f"this worker speaks v{mine}" in worker.status().reason
        assert transport.posts() == [f"{protocol.API_PREFIX}/runs/t/workers"]  # its registration was answered 426
    finally:
        upgrade.undo()  # the operator rolls back
    thread.join(60)
    assert out == {"rounds": 1}


def test_a_lease_request_for_a_run_that_is_not_there_is_run_unavailable(api, run):
    client = CoordinatorClient(URL, transport=AppTransport(api), max_retries=0)
    client.token = api.register()["Authorization"].split()[1]
    with pytest.raises(RunUnavailable) as refused:
        client.lease("nosuchrun")
    assert refused.value.status == 404 and refused.value.run == "nosuchrun"
    assert "run 'nosuchrun' is not available" in refused.value.message()


@pytest.mark.parametrize("status", [400, 422])
def test_a_delta_whose_bytes_are_refused_goes_back_to_the_residual_and_the_worker_goes_on(api, run, tmp_path, caplog,
                                                                                         status):
    """Refused for that delta only: its content is kept (the residual), the worker trains on."""
    worker, transport = make_worker(api, tmp_path, max_rounds=2)
    handle, refused = transport.handle_request, []

    def handle_request(request):
        if request.url.path.endswith("/delta") and not refused:
            refused.append(request.url.path)
            return httpx.Response(status, json={"detail": "the delta does not decode"}, request=request)
        return handle(request)

    transport.handle_request = handle_request
    taken_back = []
    real = worker.trainer.undeliverable_body
    worker.trainer.undeliverable_body = lambda body: (taken_back.append(len(body)), real(body))[1]
    assert worker.run() == 2
    assert len(refused) == 1 and len(taken_back) == 1
    assert f"delta refused (HTTP {status}: the delta does not decode)" in caplog.text
    assert StateStore(tmp_path / "worker", URL, "t").load_all_unsent() == []


@pytest.mark.parametrize("answer", [httpx.Response(404, text="<html>Not Found</html>"),
                                    httpx.Response(200, text="<html>a web site</html>")])
def test_an_address_that_is_not_a_coordinator_is_waited_on_saying_check_the_address(tmp_path, caplog, answer):
    caplog.set_level(logging.INFO)
    asked = []

    def handler(request):
        asked.append(request.url.path)
        return answer

    client = CoordinatorClient(URL, transport=httpx.MockTransport(handler), max_retries=0)
    worker = Worker(WorkerSettings(coordinator=URL, run="t", state_dir=tmp_path / "worker", device="cpu"),
                    client=client)
    thread, out = start(worker)
    until(lambda: worker.status().state == "blocked" and len(asked) >= 2)  # and asks again
    (line,) = errors_saying(caplog, f"{URL} does not answer /healthz as an idletrain coordinator")
    assert "check --coordinator" in line
    worker.stop.event.set()
    thread.join(30)
    assert not thread.is_alive() and out == {"rounds": 0} and set(asked) == {"/healthz"}
