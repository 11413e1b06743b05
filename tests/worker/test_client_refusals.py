"""How the client classifies the coordinator's refusals (worker/answers.py): the ones no retry mends
raise Blocked errors that say what is wrong and what to do, with the numbers the answer carried."""

from __future__ import annotations

import httpx
import pytest

from shared import protocol
from worker import client as client_mod
from worker.answers import size_text, version_refusal
from worker.client import (Blocked, CoordinatorClient, CoordinatorError, NotAdmitted, RunUnavailable, UploadTooLarge,
                           VersionRefused, is_transient)

API = protocol.API_PREFIX
BASE = "http://coordinator.test"


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    monkeypatch.setattr(client_mod.time, "sleep", lambda s: None)


def client_answering(status: int, *, seen: list | None = None, **response) -> CoordinatorClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return httpx.Response(status, **response)

    return CoordinatorClient(BASE, transport=httpx.MockTransport(handler), max_retries=2)


def test_requests_say_the_workers_api_version():
    seen: list[httpx.Request] = []
    client_answering(200, seen=seen, json={"status": "ok", "api_version": 2}).health()
    CoordinatorClient(BASE, transport=httpx.MockTransport(lambda r: seen.append(r) or httpx.Response(
        200, json={"status": "ok", "api_version": 2})), api_version=7).health()
    assert [r.headers[protocol.H_API_VERSION] for r in seen] == [str(protocol.API_VERSION), "7"]
    assert seen[1].headers["user-agent"] == "idletrain-worker/api7"


def test_413_is_upload_too_large_with_the_cap_and_the_size():
    seen: list[httpx.Request] = []
    c = client_answering(413, seen=seen, json={"detail": "body exceeds the limit of 1048576 bytes"},
                         headers={protocol.H_MAX_BODY: str(1 << 20)})
    with pytest.raises(UploadTooLarge) as refused:
        c.upload_delta(5, b"x" * 2_000_000)
    exc = refused.value
    assert (exc.status, exc.limit_bytes, exc.size_bytes) == (413, 1 << 20, 2_000_000) and len(seen) == 1
    assert exc.message().startswith("the coordinator refuses uploads over 1.0 MiB; this round's delta is 1.9 MiB: "
                                    "ask the operator to raise its upload cap (IDLETRAIN_MAX_UPLOAD_BYTES)")
    assert isinstance(exc, Blocked) and isinstance(exc, CoordinatorError) and not is_transient(exc)


def test_an_older_coordinators_413_names_its_cap_in_words():
    c = client_answering(413, json={"detail": "body of 80000 bytes exceeds the limit of 4096 bytes"})
    with pytest.raises(UploadTooLarge) as refused:
        c.upload_delta(5, b"x" * 80000)
    assert refused.value.limit_bytes == 4096
    assert f"over {size_text(4096)}; this round's delta is {size_text(80000)}" in refused.value.message()


def test_a_delta_over_the_cap_healthz_said_is_not_sent():
    seen: list[httpx.Request] = []
    c = client_answering(200, seen=seen, json={"status": "ok", "api_version": protocol.API_VERSION,
                                               "max_upload_bytes": 4096})
    c.health()
    with pytest.raises(UploadTooLarge) as refused:
        c.upload_delta(5, b"x" * 5000)
    assert [r.url.path for r in seen] == ["/healthz"]
    assert (refused.value.limit_bytes, refused.value.size_bytes) == (4096, 5000)
    assert refused.value.fits(5000) and not refused.value.fits(4999) and refused.value.fits(None)


def test_426_is_version_refused_with_the_range_and_what_to_install():
    body = {"detail": "this coordinator serves worker API v3..v4, not v2", "min_api_version": 3, "api_version": 4,
            "worker_install": "pip install -U 'idletrain==9.0'"}
    with pytest.raises(VersionRefused) as refused:
        client_answering(426, json=body).lease("t")
    exc = refused.value
    assert (exc.min_version, exc.max_version, exc.mine) == (3, 4, protocol.API_VERSION)
    assert exc.message().startswith(f"the coordinator accepts worker API v3..v4, this worker speaks "
                                    f"v{protocol.API_VERSION}: install a worker it accepts (pip install -U "
                                    "'idletrain==9.0'")


def test_version_refusal_from_healthz():
    def health(**kw) -> protocol.Health:
        return protocol.Health.model_validate({"status": "ok", **kw})

    assert version_refusal(health(api_version=3, min_api_version=2), 2) is None  # a newer coordinator serving v2
    assert version_refusal(health(api_version=2), 2) is None
    old = version_refusal(health(api_version=2), 3)  # an older coordinator, which does not say its range
    assert old is not None and "accepts worker API v2, this worker speaks v3" in old.message()
    assert "the operator may also upgrade the coordinator" in old.message()
    gone = version_refusal(health(api_version=5, min_api_version=4, worker_install="pip install x==5"), 2)
    assert gone is not None and "v4..v5" in gone.message() and "pip install x==5" in gone.message()


def connection_to(health: dict, seen: list, tmp_path, **client_kw):
    """A worker's Connection to a coordinator whose /healthz says `health` (every request kept in `seen`);
    a blocked wait is kept in its `refusals` and stops the worker instead of waiting."""
    from worker.caches import TokenStore
    from worker.connection import Connection
    from worker.control import StopFlag
    from worker.settings import WorkerSettings

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"status": "ok", **health})

    client = CoordinatorClient(BASE, transport=httpx.MockTransport(handler), max_retries=0, **client_kw)
    settings = WorkerSettings(coordinator=BASE, run="t", state_dir=tmp_path)
    conn = Connection(client, settings, TokenStore(tmp_path), StopFlag(), device_type="cpu")
    conn.refusals = []
    conn.wait_blocked = lambda exc: conn.refusals.append(exc) or conn.stop.event.set()
    return conn


@pytest.mark.parametrize("health", [{"api_version": 2}, {"api_version": 2, "min_api_version": 2}])
def test_a_worker_speaks_an_older_coordinators_version_it_still_knows(tmp_path, health):
    """A coordinator serving only v2 (one from before v3): this worker speaks v2 to it from its
    /healthz on, and is not blocked; once the coordinator serves v3 too, it speaks v3."""
    assert protocol.API_VERSION > 2 and protocol.MIN_API_VERSION <= 2
    seen: list[httpx.Request] = []
    conn = connection_to(health, seen, tmp_path)
    assert conn.wait_until_up() is not None and conn.refusals == []
    conn.client.health()
    assert [r.headers[protocol.H_API_VERSION] for r in seen] == [str(protocol.API_VERSION), "2"]
    assert seen[-1].headers["user-agent"] == "idletrain-worker/api2" and conn.api_version == 2
    upgraded = protocol.Health(status="ok", api_version=protocol.API_VERSION, min_api_version=2)
    assert conn.agree_version(upgraded) is None and conn.client.api_version == protocol.API_VERSION


def test_a_worker_is_blocked_by_a_coordinator_serving_none_of_its_versions(tmp_path):
    seen: list[httpx.Request] = []
    conn = connection_to({"api_version": 6, "min_api_version": 5}, seen, tmp_path)
    assert conn.wait_until_up() is None
    (refused,) = conn.refusals
    assert isinstance(refused, VersionRefused)
    assert (refused.min_version, refused.max_version, refused.mine) == (5, 6, protocol.API_VERSION)
    assert f"accepts worker API v5..v6, this worker speaks v{protocol.MIN_API_VERSION}..v{protocol.API_VERSION}" in (
        refused.message())
    assert [r.headers[protocol.H_API_VERSION] for r in seen] == [str(protocol.API_VERSION)]
    # ... as by one that serves only versions below its oldest
    old = version_refusal(protocol.Health(status="ok", api_version=1), protocol.API_VERSION, oldest=2)
    assert old is not None and "this worker is newer" in old.message()


@pytest.mark.parametrize("status", [401, 403])
def test_401_and_403_are_not_admitted(status):
    with pytest.raises(NotAdmitted) as refused:
        client_answering(status, json={"detail": "this worker's token was revoked by the operator"}).lease("t")
    assert "does not admit this worker (this worker's token was revoked by the operator)" in refused.value.message()


@pytest.mark.parametrize("status", [404, 410])
def test_a_run_that_is_not_there_is_run_unavailable_to_leases_and_registrations(status):
    c = client_answering(status, json={"detail": "run 't' is finished"})
    with pytest.raises(RunUnavailable) as refused:
        c.lease("t")
    assert (refused.value.status, refused.value.run, refused.value.detail) == (status, "t", "run 't' is finished")
    with pytest.raises(RunUnavailable):
        c.register("t", protocol.RegisterRequest())
    with pytest.raises(CoordinatorError) as other:  # the same status elsewhere is about that thing only
        c.snapshot("t", 3)
    assert type(other.value) is CoordinatorError


def test_408_is_transient():
    assert is_transient(CoordinatorError(408, "the body stopped arriving"))


@pytest.mark.parametrize("status", [400, 409, 422])
def test_a_refused_registration_is_not_admitted(status):
    c = client_answering(status, json={"detail": "the name 'ada' is taken in run 't'"})
    with pytest.raises(NotAdmitted) as refused:
        c.register("t", protocol.RegisterRequest(name="ada"))
    assert refused.value.message().startswith("the coordinator does not admit this worker (the name 'ada' is taken "
                                              "in run 't'): change --name, --team, --contributor-key or --team-key")
