"""A worker under a hostile coordinator (issue 34, item 7): answers far over what the lease implies
are cut off at what it implies, compression bombs in Content-Encoding are decoded within that cap,
bad bytes are asked for again slower and slower, a hostile tokenizer is refused and never kept, and
a 413 naming an absurd cap neither crashes the worker nor shrinks, loses or hot-loops its delta."""

from __future__ import annotations

import gzip
import hashlib
import logging
import threading
import time
import tracemalloc
import zlib

import httpx
import pytest
import zstandard

from shared import protocol
from shared.model import meta_schema
from tests.worker.test_state import MODEL, base_params, make_lease
from tests.worker.test_untrusted_coordinator import URL, _net_worker
from worker import client as client_mod
from worker import downloads as downloads_mod
from worker.answers import UploadTooLarge
from worker.client import CoordinatorClient, IntegrityError

API = protocol.API_PREFIX
SCHEMA = meta_schema(MODEL)  # 23,008 parameters: a snapshot of it weighs at most 158 KB
MACHINE_CAP = 64 << 20  # what this test's machine would allow any answer (a real one: ~1.4 GB)
SNAPSHOT_READ_MAX = 1 << 20  # what three tries at such a snapshot may read, with room to spare
CHUNK = 64 << 10


@pytest.fixture(autouse=True)
def no_client_sleeps(monkeypatch):
    monkeypatch.setattr(client_mod.time, "sleep", lambda s: None)


class Flood:
    """An answer of `total` bytes made as they are read, counting what the worker pulled."""

    def __init__(self, total: int = 3 << 30) -> None:
        self.total, self.pulled = total, 0

    def __iter__(self):
        chunk = b"\x28\xb5\x2f\xfd" + bytes(CHUNK - 4)  # it starts as zstd does
        while self.pulled < self.total:
            self.pulled += len(chunk)
            yield chunk


class Waits(threading.Event):
    """A stop event whose waits take no time and are written down."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []

    def wait(self, timeout=None):
        if timeout is not None:
            self.seconds.append(timeout)
        return self.is_set()


def flooding(floods: list[Flood], *, declare: bool, log: list[str]):
    """A coordinator answering every snapshot request with 3 GiB (saying so in Content-Length when
    `declare`), and releases; leases come from the test."""
    def handler(request: httpx.Request) -> httpx.Response:
        log.append(f"{request.method} {request.url.path}")
        if request.method == "DELETE":
            return httpx.Response(204)
        assert "/snapshots/" in request.url.path, request.url.path
        flood = Flood()
        floods.append(flood)
        headers = {protocol.H_SHA256: "0" * 64, protocol.H_VERSION: "4"}
        if declare:
            headers["Content-Length"] = str(flood.total)
        return httpx.Response(200, content=flood, headers=headers)

    return handler


@pytest.mark.parametrize("declare", [True, False], ids=["content-length", "chunked"])
def test_a_3_gib_snapshot_answer_is_cut_off_at_what_the_leases_model_weighs(tmp_path, caplog, declare):
    floods, log = [], []
    w = _net_worker(tmp_path, flooding(floods, declare=declare, log=log))
    w.client.max_download_bytes = MACHINE_CAP
    w.stop.event = Waits()
    with caplog.at_level(logging.WARNING, logger="worker"):
        assert w._round(make_lease()) is None  # given up; nothing crashed
    read = sum(f.pulled for f in floods)
    assert read == 0 if declare else read < SNAPSHOT_READ_MAX  # not 64 MiB, the machine's cap
    from worker import sizes

    cap = sizes.snapshot_cap_bytes(SCHEMA)
    assert len(floods) == downloads_mod.Downloads.TRIES and read <= len(floods) * (cap + CHUNK)
    assert log[-1] == "DELETE /api/v1/leases/12"
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"over the {cap:,} a snapshot of the lease's model can weigh" in said or \
        f"over the {cap:,} bytes a snapshot of the lease's model can weigh" in said
    assert "giving the lease up" in said


def test_leases_given_up_over_bad_bytes_are_asked_for_slower_and_slower(tmp_path, monkeypatch):
    """Each lease: TRIES downloads with backoff; then it is given up, and the wait before the next
    lease doubles (to backoff_delay's 60 s) instead of coming back every few seconds for ever."""
    monkeypatch.setattr(downloads_mod, "backoff_delay", lambda attempt: float(attempt))
    floods, log = [], []
    w = _net_worker(tmp_path, flooding(floods, declare=False, log=log))
    w.client.max_download_bytes = MACHINE_CAP
    w.stop.event = waits = Waits()
    for lease_id in range(1, 5):
        assert w._round(make_lease(lease_id=lease_id)) is None
    # within a lease: 1 s, 2 s between its 3 downloads; between leases: 1, 2, 3, 4 (doubling, in real life)
    assert waits.seconds == [1.0, 2.0, 1.0] + [1.0, 2.0, 2.0] + [1.0, 2.0, 3.0] + [1.0, 2.0, 4.0]
    assert len(floods) == 4 * downloads_mod.Downloads.TRIES == 12


def test_a_good_round_after_bad_bytes_starts_the_waits_again(tmp_path, monkeypatch):
    monkeypatch.setattr(downloads_mod, "backoff_delay", lambda attempt: float(attempt))
    w = _net_worker(tmp_path, flooding([], declare=False, log=[]))
    w.client.max_download_bytes = MACHINE_CAP
    w.stop.event = Waits()
    w._round(make_lease(lease_id=1))
    assert w.downloads.given_up == 1
    raw = b"the quick brown fox jumps over the lazy dog. " * 20
    w.shards.put(hashlib.sha256(raw).hexdigest(), raw)
    w.downloads.base = lambda lease: base_params()
    assert w.downloads.inputs(make_lease().model_copy(update={"shard_sha256": hashlib.sha256(raw).hexdigest()}),
                              resume=False) is not None
    assert w.downloads.given_up == 0


# -- compression bombs in Content-Encoding ------------------------------------------------------------

def _zstd_bomb(decoded: int) -> bytes:
    cobj = zstandard.ZstdCompressor(level=3).compressobj()
    block = bytes(1 << 20)
    return b"".join([*(cobj.compress(block) for _ in range(decoded >> 20)), cobj.flush()])


def _gzip_bomb(decoded: int) -> bytes:
    cobj = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(1 << 20)
    return b"".join([*(cobj.compress(block) for _ in range(decoded >> 20)), cobj.flush()])


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
def test_a_compression_bomb_in_content_encoding_never_grows_past_the_cap(encoding):
    """A 100 KB answer that says Content-Encoding: zstd (or gzip) and decodes to 256 MiB: httpx would
    decode it whole before any cap were checked."""
    bomb = (_zstd_bomb if encoding == "zstd" else _gzip_bomb)(256 << 20)
    assert len(bomb) < 1 << 20

    def handler(request):
        return httpx.Response(200, content=iter([bomb]), headers={"Content-Encoding": encoding})

    cap = 1 << 20
    client = CoordinatorClient(URL, transport=httpx.MockTransport(handler), max_retries=0, max_download_bytes=cap)
    tracemalloc.start()
    try:
        with pytest.raises(IntegrityError) as refused:
            client.snapshot("t", 4)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < len(bomb) + 8 * cap  # not 256 MiB
    assert ("does not ask for" if encoding == "zstd" else f"over the {cap:,} bytes") in str(refused.value)


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw deflate"])
def test_an_answer_a_proxy_compressed_is_read_as_sent(encoding):
    body = b'{"status": "ok", "api_version": %d, "max_upload_bytes": 4096}' % protocol.API_VERSION
    if encoding == "gzip":
        wire = gzip.compress(body)
    else:
        cobj = zlib.compressobj(wbits=zlib.MAX_WBITS if encoding == "deflate" else -zlib.MAX_WBITS)
        wire = cobj.compress(body) + cobj.flush()
    seen = []

    def handler(request):
        seen.append(request.headers["accept-encoding"])
        return httpx.Response(200, content=iter([wire]), headers={"Content-Encoding": encoding.split()[-1]})

    health = CoordinatorClient(URL, transport=httpx.MockTransport(handler), max_retries=0).health()
    assert health.max_upload_bytes == 4096 and seen == ["gzip, deflate"]


def test_a_cut_short_gzip_answer_is_refused():
    wire = gzip.compress(b"x" * 10_000)[:-20]

    def handler(request):
        return httpx.Response(200, content=iter([wire]), headers={"Content-Encoding": "gzip"})

    with pytest.raises(IntegrityError, match="cut short"):
        CoordinatorClient(URL, transport=httpx.MockTransport(handler), max_retries=0).snapshot("t", 4)


# -- a 413 naming an absurd cap ---------------------------------------------------------------------------

ABSURD = ["0", "-1", str(10**30), "abc", "9" * 5000, "1e9", ""]


@pytest.mark.parametrize("cap", ABSURD, ids=["0", "-1", "1e30", "abc", "5000 digits", "1e9", "empty"])
def test_a_413_naming_an_absurd_cap_is_taken_as_naming_none(cap):
    def handler(request):
        return httpx.Response(413, json={"detail": f"body exceeds the limit of {cap} bytes"},
                              headers={protocol.H_MAX_BODY: cap})

    client = CoordinatorClient(URL, transport=httpx.MockTransport(handler), max_retries=0)
    with pytest.raises(UploadTooLarge) as refused:
        client.upload_delta(5, b"x" * 1000)
    assert refused.value.limit_bytes is None and refused.value.size_bytes == 1000
    assert refused.value.message().startswith("the coordinator refuses uploads this large; this round's delta is "
                                              "1000 bytes")


@pytest.mark.parametrize("cap", [0, -1, 10**30, "abc", True])
def test_a_healthz_naming_an_absurd_upload_cap_names_none(cap):
    health = protocol.Health.model_validate({"status": "ok", "api_version": protocol.API_VERSION,
                                             "max_upload_bytes": cap})
    assert health.max_upload_bytes is None


def test_a_worker_answered_413_with_an_absurd_cap_keeps_its_delta_whole_and_waits(tmp_path, monkeypatch):
    """The cap a number of 5,000 digits (int() refuses to read it), /healthz saying 10^30: the worker
    does not crash, sends the same delta again only after each recheck, and keeps it on disk whole."""
    monkeypatch.setattr(UploadTooLarge, "recheck_s", 0.01)
    raw = b"the quick brown fox jumps over the lazy dog. " * 20
    lease = make_lease().model_copy(update={"shard_sha256": hashlib.sha256(raw).hexdigest()})
    stop, uploads, log, leased = threading.Event(), [], [], []

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        log.append(path)
        if path == "/healthz":
            return httpx.Response(200, json={"status": "ok", "api_version": protocol.API_VERSION,
                                             "max_upload_bytes": 10**30})
        if path == f"{API}/runs/t/leases":
            leased.append(1)
            return httpx.Response(200, json=lease.model_dump(mode="json")) if len(leased) == 1 else \
                httpx.Response(204, headers={"Retry-After": "0"})
        if "/shards/" in path:
            return httpx.Response(200, content=zstandard.ZstdCompressor().compress(raw))
        if path.endswith("/renew"):
            return httpx.Response(200, json={"lease_id": lease.lease_id, "deadline": "2030-01-01T00:00:00Z"})
        assert path == f"{API}/leases/{lease.lease_id}/delta", path
        uploads.append(request.content)
        if len(uploads) >= 4:
            stop.set()
        return httpx.Response(413, json={"detail": "too large"}, headers={protocol.H_MAX_BODY: "9" * 5000})

    w = _net_worker(tmp_path, handler)
    w.stop.event = stop
    w.downloads.base = lambda lease: base_params()
    t0 = time.monotonic()
    assert w.run() == 0  # returns when stopped; nothing raised
    assert len(uploads) == 4 and len(set(uploads)) == 1 and len(uploads[0]) > 1000  # the same delta, whole
    (unsent,) = w.store.load_all_unsent()
    assert unsent.body == uploads[0]
    after_first = log[log.index(f"{API}/leases/{lease.lease_id}/delta"):]
    sends = [i for i, p in enumerate(after_first) if p.endswith("/delta")]
    assert all("/healthz" in after_first[a:b] for a, b in zip(sends, sends[1:]))  # each re-send after a recheck
    assert len(leased) == 1 and time.monotonic() - t0 < 120


# -- the run's tokenizer.json from the coordinator ---------------------------------------------------------

def _hostile_tokenizer(kind: str) -> bytes:
    from shared.tokenizer import train_bpe

    if kind == "huge":  # valid JSON, padded past what a vocab of 256 can weigh (256 B a token + 1 MiB)
        return b'{"model": {"type": "BPE", "vocab": {}, "merges": []}, "pad": "' + b"x" * (2 << 20) + b'"}'
    if kind == "not json":
        return b"\x80\x04\x95 a pickle's first bytes"
    if kind == "not a tokenizer":
        return b'{"model": {"type": "ExecThis", "vocab": {}}}'
    if kind == "nested":
        return b"[" * 200_000 + b"]" * 200_000
    if kind == "merges":  # 100,000 merges for a vocab of 256: within the size cap, absurd all the same
        return (b'{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [' + b",".join([b'"a a"'] * 100_000)
                + b"]}}")
    assert kind == "other vocab"  # a real BPE, of 300 tokens: ids past the model's 256
    text = "the quick brown fox jumps over the lazy dog, and idle machines train models together. " * 50
    return train_bpe(iter([text] * 20), 300).to_json().encode()


@pytest.mark.parametrize("kind", ["huge", "not json", "not a tokenizer", "nested", "merges", "other vocab"])
def test_a_hostile_tokenizer_is_refused_and_never_kept(tmp_path, caplog, kind):
    body = _hostile_tokenizer(kind)
    sha = hashlib.sha256(body).hexdigest()  # the hostile coordinator announces its own file's hash
    served = []

    def handler(request):
        assert request.url.path == f"{API}/runs/t/tokenizer"
        served.append(1)
        return httpx.Response(200, content=body)

    w = _net_worker(tmp_path, handler)
    lease = make_lease().model_copy(update={"tokenizer_sha256": sha})
    with caplog.at_level(logging.WARNING, logger="worker"):
        w.downloads.fetch_tokenizer(lease)  # training does not need it: the round goes on
    assert w.downloads.tokenizers.get(sha) is None and not w.downloads.tokenizers.path(sha).exists()
    assert any("tokenizer was refused" in r.getMessage() for r in caplog.records)
    w.downloads.fetch_tokenizer(lease)
    assert served == [1]  # asked once per process, not at every round


def test_the_runs_real_tokenizer_is_kept(tmp_path):
    from shared.tokenizer import bytes_tokenizer

    body = bytes_tokenizer().to_json().encode()
    sha = hashlib.sha256(body).hexdigest()
    w = _net_worker(tmp_path, lambda request: httpx.Response(200, content=body))
    w.downloads.fetch_tokenizer(make_lease().model_copy(update={"tokenizer_sha256": sha}))
    assert w.downloads.tokenizers.get(sha) == body
