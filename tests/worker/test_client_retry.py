"""worker.client: 429 and 503 honour Retry-After, what counts as transient, and the worker's
checkpoint setting."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest

from shared import protocol
from worker import client as client_mod
from worker.client import (
    CoordinatorClient,
    CoordinatorError,
    is_transient,
    retry_after_s,
)
from worker.settings import WorkerSettings

BASE = "http://coordinator.test"


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """Backoff delays, recorded instead of slept; jitter pinned to its midpoint."""
    slept: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", slept.append)
    monkeypatch.setattr(client_mod.random, "random", lambda: 0.5)
    return slept


def answers(*responses: httpx.Response):
    it = iter(responses)
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return next(it)

    return handler, calls


HEALTHY = httpx.Response(200, json={"status": "ok", "api_version": protocol.API_VERSION})


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_is_waited_out_before_the_next_try(sleeps, status):
    handler, calls = answers(httpx.Response(status, headers={"Retry-After": "7"}), HEALTHY)
    assert CoordinatorClient(BASE, transport=httpx.MockTransport(handler)).health().status == "ok"
    assert len(calls) == 2
    assert sleeps == [pytest.approx(7 * 1.05)]  # what the server asked, plus a little jitter


def test_429_without_retry_after_backs_off_and_is_bounded(sleeps):
    handler, calls = answers(*[httpx.Response(429, json={"detail": "slow down"})] * 3)
    c = CoordinatorClient(BASE, transport=httpx.MockTransport(handler), max_retries=2)
    with pytest.raises(CoordinatorError) as info:
        c.health()
    assert info.value.status == 429 and info.value.detail == "slow down" and info.value.retry_after is None
    assert len(calls) == 3 and sleeps == [0.5, 1.0]


def test_the_last_refusal_carries_its_retry_after(sleeps):
    handler, _ = answers(httpx.Response(503, headers={"Retry-After": "30"}))
    with pytest.raises(CoordinatorError) as info:
        CoordinatorClient(BASE, transport=httpx.MockTransport(handler), max_retries=0).health()
    assert info.value.status == 503 and info.value.retry_after == 30.0


def test_health_can_be_asked_without_retries(sleeps):
    def handler(request):
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(httpx.ConnectError):
        CoordinatorClient(BASE, transport=httpx.MockTransport(handler), max_retries=5).health(max_retries=0)
    assert sleeps == []


def test_retry_after_values():
    assert retry_after_s("12") == 12.0
    assert retry_after_s("0") == 0.0
    assert retry_after_s("-3") == 0.0
    assert retry_after_s("99999") == client_mod.MAX_RETRY_AFTER_S
    assert retry_after_s(None) is None and retry_after_s("") is None and retry_after_s("soon") is None
    assert retry_after_s("nan") is None
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=60), usegmt=True)
    assert 50 <= retry_after_s(later) <= 60
    earlier = format_datetime(datetime.now(UTC) - timedelta(seconds=60), usegmt=True)
    assert retry_after_s(earlier) == 0.0


def test_what_is_transient():
    req = httpx.Request("GET", BASE)
    assert is_transient(httpx.ConnectError("x", request=req))
    assert is_transient(httpx.ReadTimeout("x", request=req))
    for status in (0, 429, 500, 502, 503, 504):
        assert is_transient(CoordinatorError(status, "x"))
    for status in (400, 401, 403, 404, 409, 410, 413, 422):
        assert not is_transient(CoordinatorError(status, "x"))
    assert not is_transient(ValueError("x"))


def test_checkpoint_every_steps_setting(monkeypatch):
    s = WorkerSettings(coordinator=BASE, run="t")
    assert s.checkpoint_every_steps == 25
    monkeypatch.setenv("IDLETRAIN_WORKER_CHECKPOINT_EVERY_STEPS", "0")
    assert WorkerSettings(coordinator=BASE, run="t").checkpoint_every_steps == 0
    with pytest.raises(ValueError):
        WorkerSettings(coordinator=BASE, run="t", checkpoint_every_steps=-1)


@pytest.mark.parametrize("call", ["upload", "lease"])
def test_a_full_coordinator_disk_is_waited_out_for_uploads_and_leases(sleeps, call):
    """The coordinator answers 503 + Retry-After: 30 while its disk is full (nothing acknowledged):
    the upload (its bytes kept) and the lease request are sent again after those 30 s."""
    full = httpx.Response(503, headers={"Retry-After": "30"},
                          json={"detail": "the coordinator's disk is full; retry later"})
    then = {"upload": httpx.Response(202, json={"lease_id": 1, "delta_id": 1, "will_merge_into": 1}),
            "lease": httpx.Response(204, headers={"Retry-After": "2"})}[call]
    handler, calls = answers(full, then)
    c = CoordinatorClient(BASE, token="t" * 20, transport=httpx.MockTransport(handler))
    if call == "upload":
        assert c.upload_delta(1, b"delta bytes").will_merge_into == 1
        assert [r.content for r in calls] == [b"delta bytes"] * 2
    else:
        assert c.lease("t") == (None, 2.0)
    assert len(calls) == 2 and sleeps == [pytest.approx(30 * 1.05)]
