"""CoordinatorClient.exchange against httpx.MockTransport."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from shared import protocol
from worker import client as client_mod
from worker.client import CoordinatorClient, CoordinatorError, IntegrityError

API = protocol.API_PREFIX


def make_client(handler, **kw) -> CoordinatorClient:
    return CoordinatorClient("http://coordinator.test", transport=httpx.MockTransport(handler), **kw)


def answer(body: bytes, sha: str | None = None) -> httpx.Response:
    return httpx.Response(200, content=body, headers={protocol.H_SHA256: sha or hashlib.sha256(body).hexdigest()})


def test_exchange_posts_the_bytes_and_returns_the_answer():
    seen = []

    def handler(request):
        seen.append(request)
        return answer(b"correction")

    c = make_client(handler, token="tok")
    assert c.exchange(9, 4, b"values") == b"correction"
    (req,) = seen
    assert req.method == "POST" and req.url.path == f"{API}/leases/9/exchange"
    assert req.url.params["step"] == "4"
    assert req.headers["content-type"] == "application/octet-stream"
    assert req.headers["authorization"] == "Bearer tok"
    assert req.content == b"values"
    assert (c.bytes_up, c.bytes_down) == (6, 10)


def test_exchange_answer_is_checked():
    with pytest.raises(IntegrityError, match="SHA-256"):
        make_client(lambda r: answer(b"tampered", "0" * 64)).exchange(1, 1, b"x")
    with pytest.raises(IntegrityError, match="cap"):
        make_client(lambda r: answer(b"y" * 100), max_download_bytes=99).exchange(1, 1, b"x")


def test_exchange_retries_little_and_raises_refusals(monkeypatch):
    monkeypatch.setattr(client_mod.time, "sleep", lambda s: None)
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(503, json={"detail": "busy"})

    with pytest.raises(CoordinatorError) as info:
        make_client(handler, max_retries=8).exchange(1, 2, b"x")
    assert info.value.status == 503 and len(calls) == CoordinatorClient.EXCHANGE_RETRIES + 1

    with pytest.raises(CoordinatorError) as info:
        make_client(lambda r: httpx.Response(410, json={"detail": "lease 1 is delivered"})).exchange(1, 2, b"x")
    assert info.value.status == 410 and "delivered" in info.value.detail
