"""worker.client.CoordinatorClient against httpx.MockTransport: retries, errors, integrity checks."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
import zstandard

from shared import protocol
from worker import client as client_mod
from worker.client import CoordinatorClient, CoordinatorError, IntegrityError

API = protocol.API_PREFIX
BASE = "http://coordinator.test"


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """Backoff delays, recorded instead of slept; jitter pinned to its midpoint."""
    slept: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", slept.append)
    monkeypatch.setattr(client_mod.random, "random", lambda: 0.5)
    return slept


def make_client(handler, **kw) -> CoordinatorClient:
    return CoordinatorClient(BASE, transport=httpx.MockTransport(handler), **kw)


def lease_json(**over) -> dict:
    body = {"lease_id": 7, "run": "t", "shard_id": 2, "shard_sha256": "ab" * 32, "base_version": 3, "seed": 11,
            "lr": 1e-3, "inner": {"steps": 3}, "compression": {}, "model": {"n_layer": 1},
            "deadline": "2030-01-01T00:00:00Z"}
    body.update(over)
    return body


def test_retries_transport_errors_with_growing_backoff(sleeps):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) <= 3:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"status": "ok", "api_version": protocol.API_VERSION})

    c = make_client(handler, max_retries=5)
    assert c.health().status == "ok"
    assert len(calls) == 4
    assert sleeps == [0.5, 1.0, 2.0]  # 0.5 * 2^attempt at mid jitter


def test_backoff_is_capped_and_jittered(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", slept.append)
    for r in (0.0, 0.999):
        monkeypatch.setattr(client_mod.random, "random", lambda r=r: r)
        CoordinatorClient._backoff(1, "test")
        CoordinatorClient._backoff(20, "test")
    assert slept[0] == pytest.approx(0.5) and slept[2] == pytest.approx(1.499)
    # the step is capped at 60 s and the jitter spreads around it: 30 s .. 90 s, never more
    assert slept[1] == pytest.approx(30.0) and slept[3] == pytest.approx(60 * 1.499)


def test_retries_5xx_then_succeeds(sleeps):
    codes = iter([503, 500, 200])

    def handler(request):
        code = next(codes)
        if code == 200:
            return httpx.Response(200, json=lease_json())
        return httpx.Response(code, text="upstream sad")

    c = make_client(handler)
    lease, wait = c.lease("t")
    assert lease.lease_id == 7 and wait == 0.0
    assert len(sleeps) == 2


def test_gives_up_after_max_retries_on_transport_errors(sleeps):
    calls = []

    def handler(request):
        calls.append(request)
        raise httpx.ReadTimeout("slow", request=request)

    c = make_client(handler, max_retries=3)
    with pytest.raises(httpx.ReadTimeout):
        c.status("t")
    assert len(calls) == 4  # the first try and 3 retries
    assert len(sleeps) == 3


def test_gives_up_after_max_retries_on_5xx(sleeps):
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(502, json={"detail": "bad gateway"})

    c = make_client(handler, max_retries=2)
    with pytest.raises(CoordinatorError) as info:
        c.status("t")
    assert info.value.status == 502 and info.value.detail == "bad gateway"
    assert len(calls) == 3 and len(sleeps) == 2


def test_no_retries_when_max_retries_is_zero(sleeps):
    def handler(request):
        raise httpx.ConnectError("down", request=request)

    with pytest.raises(httpx.ConnectError):
        make_client(handler, max_retries=0).health()
    assert sleeps == []


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 410, 413, 422])
def test_4xx_is_a_coordinator_error_with_the_detail_and_no_retry(sleeps, status):
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(status, json={"detail": f"because {status}"})

    with pytest.raises(CoordinatorError) as info:
        make_client(handler).upload_delta(5, b"delta")
    assert info.value.status == status
    assert info.value.detail == f"because {status}"
    assert str(status) in str(info.value)
    assert len(calls) == 1 and sleeps == []


def test_4xx_without_json_keeps_the_text(sleeps):
    def handler(request):
        return httpx.Response(404, text="<html>not here</html>")

    with pytest.raises(CoordinatorError) as info:
        make_client(handler).status("t")
    assert info.value.detail == "<html>not here</html>"


def test_requests_carry_the_token_and_upload_headers():
    seen = []

    def handler(request):
        seen.append(request)
        return httpx.Response(202, json={"lease_id": 5, "delta_id": 1, "will_merge_into": 4})

    c = make_client(handler, token="tok-123")
    ack = c.upload_delta(5, b"\x00\x01payload")
    assert ack.will_merge_into == 4 and ack.duplicate is False
    (req,) = seen
    assert req.method == "POST" and req.url.path == f"{API}/leases/5/delta"
    assert req.headers["authorization"] == "Bearer tok-123"
    assert req.headers["content-type"] == "application/octet-stream"
    assert req.content == b"\x00\x01payload"
    assert c.bytes_up == len(b"\x00\x01payload")


def test_register_sends_the_request_without_a_token():
    seen = []

    def handler(request):
        seen.append(request)
        return httpx.Response(201, json={"worker_id": 3, "token": "fresh"})

    reg = make_client(handler).register("t", protocol.RegisterRequest(name="ada", join_key="k" * 8))
    assert (reg.worker_id, reg.token) == (3, "fresh")
    assert "authorization" not in seen[0].headers
    # fields left out rather than null: a coordinator of an earlier release refuses fields it does not know
    assert json.loads(seen[0].content) == {"name": "ada", "join_key": "k" * 8}


def test_lease_204_means_wait(sleeps):
    def handler(request):
        return httpx.Response(204, headers={"Retry-After": "7"})

    assert make_client(handler).lease("t") == (None, 7.0)
    assert sleeps == []


def test_lease_204_with_a_bad_retry_after_waits_a_default():
    assert make_client(lambda r: httpx.Response(204, headers={"Retry-After": "soon"})).lease("t") == (None, 2.0)
    assert make_client(lambda r: httpx.Response(204)).lease("t") == (None, 2.0)


# -- downloads ----------------------------------------------------------------------------------

def snapshot_handler(body: bytes, sha: str, version: int = 4):
    def handler(request):
        return httpx.Response(200, content=body, headers={protocol.H_SHA256: sha, protocol.H_VERSION: str(version)})

    return handler


def test_snapshot_hash_checked():
    body = b"pretend zstd safetensors"
    c = make_client(snapshot_handler(body, hashlib.sha256(body).hexdigest()))
    assert c.snapshot("t", 4) == (body, 4)
    assert c.bytes_down == len(body)


@pytest.mark.parametrize("sha", ["0" * 64, "", hashlib.sha256(b"other").hexdigest()])
def test_snapshot_hash_mismatch_is_an_integrity_error(sha):
    c = make_client(snapshot_handler(b"tampered bytes", sha))
    with pytest.raises(IntegrityError, match="SHA-256"):
        c.snapshot("t", "latest")


def test_download_cap():
    body = b"x" * 100
    c = make_client(snapshot_handler(body, hashlib.sha256(body).hexdigest()), max_download_bytes=99)
    with pytest.raises(IntegrityError, match="cap"):
        c.snapshot("t", 1)


def shard_handler(blob: bytes):
    def handler(request):
        return httpx.Response(200, content=blob)

    return handler


def test_shard_is_decompressed_and_checked():
    raw = bytes(range(256)) * 40
    blob = zstandard.ZstdCompressor().compress(raw)
    c = make_client(shard_handler(blob))
    assert c.shard("t", 0, expected_sha256=hashlib.sha256(raw).hexdigest()) == raw


def test_shard_hash_mismatch_is_an_integrity_error():
    raw = b"some tokens" * 100
    blob = zstandard.ZstdCompressor().compress(raw)
    with pytest.raises(IntegrityError, match="SHA-256"):
        make_client(shard_handler(blob)).shard("t", 0, expected_sha256=hashlib.sha256(raw + b"!").hexdigest())


def test_shard_not_zstd_is_an_integrity_error():
    with pytest.raises(IntegrityError, match="zstd"):
        make_client(shard_handler(b"plain, not compressed")).shard("t", 1, expected_sha256="0" * 64)


def test_shard_larger_than_allowed_is_an_integrity_error():
    raw = b"a" * 5000
    blob = zstandard.ZstdCompressor().compress(raw)  # a tiny bomb: 5000 bytes from a few dozen
    with pytest.raises(IntegrityError):
        make_client(shard_handler(blob)).shard("t", 0, expected_sha256=hashlib.sha256(raw).hexdigest(),
                                               max_raw_bytes=4096)


def test_renew_reports_the_rounds_step():
    """The coordinator renews a lease only while its round progresses (issue 18): the step travels."""
    seen = []

    def handler(request):
        seen.append(request)
        return httpx.Response(200, json={"lease_id": 7, "deadline": "2030-01-01T00:00:00Z"})

    renewed = make_client(handler, token="tok").renew(7, step=12)
    assert renewed.lease_id == 7
    (req,) = seen
    assert req.method == "POST" and req.url.path == f"{API}/leases/7/renew"
    assert req.url.params["step"] == "12"
