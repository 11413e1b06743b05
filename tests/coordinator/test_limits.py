"""The HTTP layer's bounds (coordinator/limits.py, the upload routes of coordinator/api/uploads.py),
against the attacks of issue 18: uploads buffered in memory before auth and rate limits, slow
bodies never timed out, zstd bombs, unbounded JSON bodies and 422 answers echoing their input.

Each attack: its status code, the model unchanged, and the worker's standing and counts as they
should be. The stalled-body and concurrency cases go over a real socket (uvicorn in a thread):
the TestClient hands the app a body only whole.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import uvicorn
import zstandard

from coordinator.app import create_app
from coordinator.settings import CoordinatorSettings
from shared import codec, protocol
from shared.codec.envelope import HEADER
from tests.conftest import API

# -- helpers -----------------------------------------------------------------------------------


class Pulled:
    """A request body as a generator that records whether the server pulled any of it: the
    TestClient reads a generator body on the app's first receive(), and not before."""

    def __init__(self, data: bytes = b"x" * 4096) -> None:
        self.data, self.pulled = data, False

    def __iter__(self):
        self.pulled = True
        yield self.data


def post_stream(api, lease_id: int, body: Pulled, headers: dict) -> httpx.Response:
    return api.client.post(f"{API}/leases/{lease_id}/delta", content=iter(body),
                           headers={**headers, "Content-Type": "application/octet-stream"})


def files_in(storage, folder: str) -> list[str]:
    """The names of the blobs in a storage folder, without the folder."""
    return sorted(name.rsplit("/", 1)[-1] for name in storage.list(folder))


def params_of(api) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in api.runtime().state.params.items()}


def unchanged(before: dict[str, torch.Tensor], api) -> bool:
    after = api.runtime().state.params
    return all(torch.equal(before[n], after[n]) for n in before)


def worker_row(api, run: str = "t") -> dict:
    (w,) = api.operator("get", f"{API}/runs/{run}/workers").json()
    return w


def bomb(base_version: int, declared: int = 100 << 20) -> bytes:
    """A valid envelope whose zstd frame (a few KB) holds `declared` bytes: a body header, then zeros."""
    body = struct.pack("<QI", base_version, 1) + bytes(declared - 12)
    frame = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(body)
    return HEADER.pack(codec.MAGIC, codec.FORMAT_VERSION, declared) + frame


# -- before the body: token, lease, rate limit, uploads in flight ----------------------------------


def test_upload_to_another_workers_lease_is_refused_before_the_body_is_read(api, run):
    owner, other = api.register(), api.register()
    lease = api.lease(owner)
    before = params_of(api)
    body = Pulled()
    resp = post_stream(api, lease.lease_id, body, other)
    assert resp.status_code == 403, resp.text
    assert not body.pulled  # before: the whole body was read into memory, then the lease checked
    # an unknown lease: 404, nothing read either
    body = Pulled()
    resp = post_stream(api, 999_999, body, other)
    assert resp.status_code == 404 and not body.pulled
    # a bad token: 401, nothing read
    body = Pulled()
    assert post_stream(api, lease.lease_id, body, {"Authorization": "Bearer nope"}).status_code == 401
    assert not body.pulled
    assert unchanged(before, api) and api.drain() == 0
    assert all(w["deltas_rejected"] == 0 and w["standing"] == "ok"
               for w in api.operator("get", f"{API}/runs/t/workers").json())
    assert not files_in(api.coordinator.storage, api.coordinator.storage.deltas(api.runtime().run_id))


def test_upload_over_the_rate_limit_is_refused_before_the_body_is_read(tmp_path, open_api, run_config, make_delta):
    settings = CoordinatorSettings(data_dir=tmp_path / "c", upload_rate=0.001, upload_burst=1)
    with open_api(settings) as api:
        api.create_run(run_config())
        headers = api.register()
        lease = api.lease(headers)
        api.accept(lease.lease_id, make_delta(lease), headers)  # takes the one token
        second = api.lease(headers)
        body = Pulled(make_delta(second))
        resp = post_stream(api, second.lease_id, body, headers)
        assert resp.status_code == 429 and int(resp.headers["Retry-After"]) >= 1, resp.text
        assert not body.pulled
        assert worker_row(api)["deltas_rejected"] == 0


def test_upload_to_a_lease_given_up_is_refused_before_the_body_is_read(api, run):
    headers = api.register()
    first = api.lease(headers)
    api.lease(headers)  # gives the first one up
    body = Pulled()
    resp = post_stream(api, first.lease_id, body, headers)
    assert resp.status_code == 410 and not body.pulled, resp.text


def test_an_upload_past_the_workers_in_flight_cap_is_429_before_its_body(api, run, make_delta):
    """The worker already has max_concurrent_uploads (2) uploads in flight: the next is 429 +
    Retry-After, unread; once one finishes, it goes through. (Over a real socket below, too.)"""
    headers = api.register()
    lease = api.lease(headers)
    worker_id = worker_row(api)["worker_id"]
    inflight = api.coordinator.uploads.in_flight
    assert api.coordinator.settings.max_concurrent_uploads == 2
    with inflight.hold(worker_id), inflight.hold(worker_id):
        body = Pulled(make_delta(lease))
        resp = post_stream(api, lease.lease_id, body, headers)
        assert resp.status_code == 429 and resp.headers["Retry-After"], resp.text
        assert not body.pulled
    assert inflight.count(worker_id) == 0
    assert api.accept(lease.lease_id, make_delta(lease), headers).will_merge_into == 1
    assert inflight.count(worker_id) == 0  # released after the answer


# -- the body: streamed to disk, capped, nothing kept on a refusal --------------------------------


def test_a_chunked_body_over_the_cap_is_413_and_leaves_no_file(tmp_path, open_api, run_config):
    # a cap the tiny run's rounds fit (run create refuses a run whose rounds cannot), and a body twice it
    settings = CoordinatorSettings(data_dir=tmp_path / "c", max_upload_bytes=64 << 10)
    with open_api(settings) as api:
        api.create_run(run_config())
        headers = api.register()
        lease = api.lease(headers)
        before = params_of(api)
        resp = post_stream(api, lease.lease_id, Pulled(b"\x00" * (128 << 10)), headers)  # no Content-Length
        assert resp.status_code == 413, resp.text
        assert files_in(api.coordinator.storage, api.coordinator.storage.deltas(api.runtime().run_id)) == []
        assert unchanged(before, api) and api.drain() == 0
        assert worker_row(api)["deltas_rejected"] == 0 and worker_row(api)["deltas_accepted"] == 0


def test_an_accepted_upload_is_staged_from_the_streamed_file_and_a_retry_answers_the_same(api, run, make_delta):
    headers = api.register()
    lease = api.lease(headers)
    body = make_delta(lease)
    first = post_stream(api, lease.lease_id, Pulled(body), headers)
    assert first.status_code == 202, first.text
    storage = api.coordinator.storage
    folder = storage.deltas(api.runtime().run_id)
    staged = [n for n in files_in(storage, folder) if n.endswith(".staged")]
    assert len(staged) == 1 and not [n for n in files_in(storage, folder) if n.endswith(".part")]
    (name,) = [n for n in storage.list(folder) if n.endswith(".staged")]
    assert storage.read(name) == body
    again = post_stream(api, lease.lease_id, Pulled(body), headers)
    assert again.status_code == 202 and again.json()["duplicate"] is True
    assert again.json()["will_merge_into"] == first.json()["will_merge_into"]
    other = post_stream(api, lease.lease_id, Pulled(body + b"\x00"), headers)
    assert other.status_code == 409
    assert not [n for n in files_in(storage, folder) if n.endswith(".part")]
    assert api.drain() == 1


def test_a_zstd_bomb_upload_is_422_counted_and_never_decompressed(api, run, monkeypatch):
    """3 KB declaring 100 MB: refused from its header alone (codec.MAX_UPLOAD_RATIO), counted
    against the worker's standing like any refused delta, the model untouched."""
    import shared.codec.envelope as env

    decompressed = []
    real = env._decompress
    monkeypatch.setattr(env, "_decompress", lambda frame, n: decompressed.append(n) or real(frame, n))
    # the tiny test model's own cap (its dense fp32 size) would refuse 100 MB anyway: give it a big one
    monkeypatch.setattr(env, "max_body_bytes", lambda schema: 1 << 30)
    headers = api.register()
    lease = api.lease(headers)
    blob = bomb(lease.base_version)
    assert len(blob) < 8 << 10
    before = params_of(api)
    resp = api.upload(lease.lease_id, blob, headers)
    assert resp.status_code == 422 and "times its" in resp.json()["detail"], resp.text
    assert decompressed == []  # before: 100 MB allocated and decompressed twice, then refused
    assert unchanged(before, api) and api.drain() == 0
    w = worker_row(api)
    assert w["deltas_rejected"] == 1 and w["deltas_accepted"] == 0
    assert files_in(api.coordinator.storage, api.coordinator.storage.deltas(api.runtime().run_id)) == []


# -- JSON bodies and 422 answers -------------------------------------------------------------------


def test_a_1mib_registration_is_413_before_it_is_read(api, run):
    big = {"name": "x" * (1 << 20)}
    resp = api.client.post(f"{API}/runs/t/workers", json=big)
    assert resp.status_code == 413 and "limit of 65536 bytes" in resp.json()["detail"], resp.text[:200]
    # chunked (no Content-Length): counted while it streams
    raw = json.dumps(big).encode()
    resp = api.client.post(f"{API}/runs/t/workers", content=iter([raw[i:i + 8192] for i in range(0, len(raw), 8192)]),
                           headers={"Content-Type": "application/json"})
    assert resp.status_code == 413, resp.text[:200]
    assert api.operator("get", f"{API}/runs/t/workers").json() == []  # nobody registered
    # a registration of an ordinary size still works
    assert api.register(name="ok")


def test_a_422_answer_says_what_was_wrong_without_echoing_the_input(api, run):
    secret = "S3CRET-" + "v" * 2000
    resp = api.client.post(f"{API}/runs/t/workers", json={"name": secret, "bogus": secret, secret[:80]: 1})
    assert resp.status_code == 422, resp.text[:300]
    text = resp.text
    assert "S3CRET" not in text and "vvvvvvvvvv" not in text  # before: every value came back ("input")
    detail = resp.json()["detail"]
    assert isinstance(detail, str) and "body." in detail
    # a path parameter out of range: where and why, not the value
    resp = api.client.post(f"{API}/leases/98765432109876/delta", content=b"x",
                           headers={**api.register(), "Content-Type": "application/octet-stream"})
    assert resp.status_code == 422 and "98765432109876" not in resp.text and "lease_id" in resp.text


# -- over a real socket: stalled bodies, uploads in flight ------------------------------------------


@contextlib.contextmanager
def real_server(settings: CoordinatorSettings) -> Iterator[tuple[object, str]]:
    """The app under uvicorn on a loopback port, in a thread: (app, base URL)."""
    app = create_app(settings, start_merger=False)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, what="uvicorn to start")
        yield app, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_until(cond, *, what: str, limit_s: float = 60.0) -> None:
    """Poll `cond` until true (a synchronisation, not an assertion on time)."""
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def setup_lease(base: str, app, run_config) -> tuple[httpx.Client, dict, protocol.Lease, int]:
    client = httpx.Client(base_url=base, timeout=60)
    admin = {"Authorization": f"Bearer {app.state.admin_token}"}
    assert client.post(f"{API}/runs", json=run_config(), headers=admin).status_code == 201
    resp = client.post(f"{API}/runs/t/workers", json={})
    assert resp.status_code == 201, resp.text
    headers = {"Authorization": f"Bearer {resp.json()['token']}"}
    lease = protocol.Lease.model_validate(client.post(f"{API}/runs/t/leases", headers=headers).json())
    return client, headers, lease, resp.json()["worker_id"]


def start_upload(base: str, lease_id: int, headers: dict, *, declared: int, sent: bytes) -> socket.socket:
    """An upload over a raw socket that sends its head and `sent` of its `declared` bytes, then stalls."""
    port = int(base.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = (f"POST {API}/leases/{lease_id}/delta HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: {headers['Authorization']}\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {declared}\r\n\r\n").encode()
    s.sendall(head + sent)
    return s


def read_status(s: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]), data


@pytest.fixture
def served(tmp_path, db_url, corpus_dir):
    def make(**overrides):
        return real_server(CoordinatorSettings(data_dir=tmp_path / "c", database_url=db_url,
                                               corpus_dirs=[corpus_dir], **overrides))
    return make


def test_a_stalled_body_is_cut_off_with_408_and_nothing_kept(served, run_config):
    with served(body_timeout_s=0.5) as (app, base):
        client, headers, lease, worker_id = setup_lease(base, app, run_config)
        coord = app.state.coordinator
        s = start_upload(base, lease.lease_id, headers, declared=100_000, sent=b"\x00" * 1000)
        with s:
            status, head = read_status(s)  # before: it waited for ever (no timeout on a body)
        assert status == 408, head
        (run_id,) = coord.live.runtimes  # the one run "t"
        assert files_in(coord.storage, coord.storage.deltas(run_id)) == []
        assert coord.uploads.in_flight.count(worker_id) == 0
        (w,) = client.get(f"{API}/runs/t/workers", headers={"Authorization": f"Bearer {app.state.admin_token}"}).json()
        assert w["deltas_accepted"] == 0 and w["standing"] == "ok"
        assert client.get(f"{API}/runs/t/status").json()["version"] == 0
        client.close()


def test_a_third_concurrent_upload_over_a_socket_is_429(served, run_config, make_delta):
    with served(body_timeout_s=120) as (app, base):
        client, headers, lease, worker_id = setup_lease(base, app, run_config)
        coord = app.state.coordinator
        stalled = [start_upload(base, lease.lease_id, headers, declared=100_000, sent=b"\x00" * 100) for _ in range(2)]
        try:
            wait_until(lambda: coord.uploads.in_flight.count(worker_id) == 2, what="two uploads in flight")
            resp = client.post(f"{API}/leases/{lease.lease_id}/delta", content=make_delta(lease),
                               headers={**headers, "Content-Type": "application/octet-stream"})
            assert resp.status_code == 429 and resp.headers["Retry-After"], resp.text
        finally:
            for s in stalled:
                s.close()
        wait_until(lambda: coord.uploads.in_flight.count(worker_id) == 0, what="the cut uploads to end")
        # nothing kept from the two cut off; the real one now goes through
        (run_id,) = coord.live.runtimes
        assert not coord.storage.partial_uploads(run_id)
        resp = client.post(f"{API}/leases/{lease.lease_id}/delta", content=make_delta(lease),
                           headers={**headers, "Content-Type": "application/octet-stream"})
        assert resp.status_code == 202, resp.text
        client.close()


def test_a_run_whose_rounds_cannot_fit_the_upload_cap_is_refused_at_create(settings, open_api, run_config):
    """The worst-case encoded delta is held against max_upload_bytes before anything is read or
    written: a dense fp32 round of the tiny model (~80 KB) cannot pass a 32 KiB cap, its int4 form can."""
    with open_api(settings.model_copy(update={"max_upload_bytes": 32 << 10})) as api:
        fp32 = run_config("big", compression={"index": "dense", "values": "fp32", "error_feedback": False})
        resp = api.client.post(f"{API}/runs", json=fp32, headers=api.admin)
        assert resp.status_code == 422, resp.text
        detail = resp.json()["detail"]
        assert "run 'big' is refused: a round's delta of this run can take up to" in detail, detail
        assert "upload cap of 32.0 KiB" in detail and "IDLETRAIN_MAX_UPLOAD_BYTES" in detail, detail
        assert api.client.get(f"{API}/runs").json() == []  # nothing was created
        sparta = run_config("ex", algorithm="sparta", sparta={"p": 1.0, "values": "fp32"})
        resp = api.client.post(f"{API}/runs", json=sparta, headers=api.admin)
        assert resp.status_code == 422 and "an exchange of this run" in resp.json()["detail"], resp.text
        api.create_run(run_config("small", compression={"index": "dense", "values": "int4"}))
