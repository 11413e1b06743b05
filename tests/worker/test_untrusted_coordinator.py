"""A worker is safe from a malicious coordinator too: no model larger than it agreed to hold,
no model config that does not validate, and no pickle anywhere on what crosses the network."""

from __future__ import annotations

import builtins
import hashlib
import io
import logging
import os
import re
import threading
from pathlib import Path

import httpx
import pytest
import zstandard

from shared import protocol
from shared.model import ModelConfig
from tests.worker.test_client import lease_json, make_client
from tests.worker.test_state import make_lease
from worker import client as client_mod
from worker import memory
from tests.worker.conftest import no_backoff
from worker.client import CoordinatorClient, InvalidAnswer
from worker.downloads import Downloads
from worker.loop import Worker
from worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]


class _NoNetwork:
    def __getattr__(self, name):
        raise AssertionError(f"the worker must refuse before any request ({name})")


def _worker(tmp_path, **kw) -> Worker:
    return Worker(WorkerSettings(coordinator="http://127.0.0.1:9", run="t", state_dir=tmp_path, device="cpu", **kw),
                  client=_NoNetwork())


def test_a_model_above_max_params_is_refused_before_anything_is_downloaded(tmp_path):
    lease = make_lease().model_copy(update={"model": ModelConfig(n_layer=48, n_head=16, d_model=2048,
                                                                 context=2048, vocab_size=256, dropout=0.0)})
    with pytest.raises(RuntimeError, match=r"2,4\d\d,\d{3},\d{3} parameters, above this worker's limit"):
        _worker(tmp_path, max_params=1_000_000_000)._round(lease)


@pytest.mark.parametrize("model", [{"n_layer": 10**9}, {"n_layer": 2, "surprise": 1}, {"n_layer": -1}])
def test_an_invalid_model_config_is_refused(tmp_path, model):
    """Refused as an invalid answer (the loop backs off and asks again), not a crash of the worker."""
    lease = make_lease().model_copy(update={"model": model})
    with pytest.raises(InvalidAnswer, match="not a valid model config"):
        _worker(tmp_path)._round(lease)


def test_no_pickle_or_torch_load_in_code_that_reads_network_bytes():
    """safetensors, JSON and the delta codec are the only formats either side parses."""
    unsafe = "pickle|cloudpickle|dill|shelve|joblib"
    pattern = re.compile(rf"\bimport\s+({unsafe})\b|\bfrom\s+({unsafe})\b|\bpickle\.loads?\(|"
                         r"(?<!safetensors\.)\btorch\.load\(|\bmarshal\.loads?\(|\bnp\.load\([^)]*allow_pickle\s*=\s*True")
    offenders = [f"{p.relative_to(ROOT)}:{i}" for folder in ("coordinator", "worker", "shared", "idletrain")
                 for p in sorted((ROOT / folder).rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


# -- ids the coordinator sends are checked before any is used in a path, a URL or an allocation --------

URL = "http://coordinator.test"
API = protocol.API_PREFIX


@pytest.fixture
def no_waiting(monkeypatch):
    """The loop's and the client's backoff waits take no time here."""
    no_backoff(monkeypatch)
    monkeypatch.setattr(client_mod.time, "sleep", lambda s: None)


class FileSpy:
    """Every path the process stats or opens, while installed."""

    def __init__(self, monkeypatch) -> None:
        self.paths: list[Path] = []
        for mod, name in ((os, "stat"), (os, "lstat"), (os, "open"), (io, "open"), (builtins, "open")):
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, self._wrap(real))

    def _wrap(self, real):
        def spy(path, *args, **kw):
            if isinstance(path, (str, bytes, os.PathLike)):
                self.paths.append(Path(os.fsdecode(path)).absolute())
            return real(path, *args, **kw)

        return spy

    def touched(self, folder: Path) -> list[Path]:
        return [p for p in self.paths if p == folder or folder in p.parents]


def _coordinator(leases: list[dict], stop, *, shards: list[bytes] = ()):
    """A coordinator answering /healthz, these leases (then 204 and stop), these shard bodies in turn
    and lease releases; any other request fails the test. Returns (handler, log of requests)."""
    log: list[tuple[str, str]] = []
    leases, shards = list(leases), list(shards)

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        log.append((request.method, path))
        if path == "/healthz":
            return httpx.Response(200, json={"status": "ok", "api_version": protocol.API_VERSION})
        if request.method == "POST" and path == f"{API}/runs/t/leases":
            if leases:
                return httpx.Response(200, json=leases.pop(0))
            stop.set()
            return httpx.Response(204, headers={"Retry-After": "0"})
        if request.method == "GET" and "/shards/" in path and shards:
            return httpx.Response(200, content=shards.pop(0))
        if request.method == "DELETE" and path.startswith(f"{API}/leases/"):
            return httpx.Response(204)
        raise AssertionError(f"the worker must not ask for {request.method} {path}")

    return handler, log


def _net_worker(tmp_path, handler, **kw) -> Worker:
    settings = WorkerSettings(coordinator=URL, run="t", token="x", state_dir=tmp_path / "worker", device="cpu",
                              max_retries=0, **kw)
    return Worker(settings, client=CoordinatorClient(URL, transport=httpx.MockTransport(handler), max_retries=0))


SECRET_NAME = "id_rsa.bin"  # the worker appends ".bin" to the hash: the attack names a file that ends so


@pytest.mark.parametrize("attack", ["absolute", "dotdot", "63 hex", "uppercase", "newline"])
def test_a_lease_whose_shard_hash_is_not_a_digest_is_refused_and_no_file_outside_the_cache_is_touched(
        tmp_path, monkeypatch, caplog, no_waiting, attack):
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir()
    (secret_dir / SECRET_NAME).write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----\n")
    sha = {"absolute": str(secret_dir / "id_rsa"), "dotdot": "../../../secret/id_rsa", "63 hex": "a" * 63,
           "uppercase": "AB" * 32, "newline": "ab" * 32 + "\n"}[attack]
    bad = make_lease().model_dump(mode="json") | {"shard_sha256": sha}
    stop = threading.Event()
    handler, log = _coordinator([bad], stop)
    w = _net_worker(tmp_path, handler)
    w.stop.event = stop
    w.downloads.base = lambda lease: {}  # no snapshot: were the lease taken, the shard cache would be next
    spy = FileSpy(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="worker"):
        assert w.run() == 0  # it backs off and asks again; it does not crash
    monkeypatch.undo()
    assert spy.touched(secret_dir) == []  # not opened, not even stat'ed (existence would leak)
    assert [p for m, p in log if m == "POST"] == [f"{API}/runs/t/leases"] * 2
    assert not any("/shards/" in p or "/snapshots/" in p for _, p in log)
    assert any("shard_sha256" in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "worker" / "cache" / "shards").exists() or \
        list((tmp_path / "worker" / "cache" / "shards").iterdir()) == []


def test_a_lease_bypassing_the_parser_is_still_refused_before_any_path_is_built(tmp_path, monkeypatch):
    """A lease restored from disk or built in code goes through the same exact-form check."""
    secret = tmp_path / "secret"
    secret.mkdir()
    lease = make_lease().model_copy(update={"shard_sha256": str(secret / "id_rsa")})
    spy = FileSpy(monkeypatch)
    with pytest.raises(InvalidAnswer, match="shard_sha256"):
        _worker(tmp_path / "w")._round(lease)
    monkeypatch.undo()
    assert spy.touched(secret) == []


def _shard(text: bytes = b"the quick brown fox jumps over the lazy dog. " * 20) -> tuple[bytes, str, bytes]:
    """(raw tokens, their sha256, the zstd body a coordinator serves)."""
    return text, hashlib.sha256(text).hexdigest(), zstandard.ZstdCompressor().compress(text)


def test_a_corrupted_cache_hit_is_deleted_and_fetched_again(tmp_path):
    raw, sha, body = _shard()
    handler, log = _coordinator([], threading.Event(), shards=[body])
    w = _net_worker(tmp_path, handler)
    cached = tmp_path / "worker" / "cache" / "shards" / f"{sha}.bin"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"replaced by someone else" + raw[24:])  # same length, other bytes
    lease = make_lease().model_copy(update={"shard_sha256": sha})
    assert bytes(w.downloads.tokens(lease).numpy()) == raw  # the fetched shard, not the cached file
    assert [p for m, p in log if m == "GET"] == [f"{API}/runs/t/shards/1"]
    assert cached.read_bytes() == raw
    assert bytes(w.downloads.tokens(lease).numpy()) == raw and len(log) == 1  # a good hit is used as is


def test_a_shard_failing_its_hash_or_its_zstd_is_fetched_again_and_the_round_goes_on(tmp_path, no_waiting):
    raw, sha, body = _shard()
    wrong = zstandard.ZstdCompressor().compress(raw[::-1])  # valid zstd, other tokens
    handler, log = _coordinator([], threading.Event(), shards=[wrong, b"not zstd at all", body])
    w = _net_worker(tmp_path, handler)
    lease = make_lease().model_copy(update={"shard_sha256": sha})
    assert bytes(w.downloads.tokens(lease).numpy()) == raw
    assert [p for m, p in log if m == "GET"] == [f"{API}/runs/t/shards/1"] * 3
    assert w.shards.get(sha) == raw


def test_a_shard_that_never_arrives_intact_gives_the_lease_up_without_crashing(tmp_path, no_waiting, caplog):
    raw, sha, _ = _shard()
    handler, log = _coordinator([], threading.Event(), shards=[b"garbage"] * Downloads.TRIES)
    w = _net_worker(tmp_path, handler)
    w.downloads.base = lambda lease: {}  # the base model is not what this test is about
    lease = make_lease().model_copy(update={"shard_sha256": sha})
    with caplog.at_level(logging.WARNING, logger="worker"):
        assert w._round(lease) is None
    gets = [p for m, p in log if m == "GET"]
    assert gets == [f"{API}/runs/t/shards/1"] * Downloads.TRIES
    assert log[-1] == ("DELETE", f"{API}/leases/{lease.lease_id}")  # handed back for another worker
    assert w.rounds == 0 and w.store.load_unsent() is None
    assert not w.shards.path(sha).exists()
    assert any("giving the lease up" in r.getMessage() for r in caplog.records)


def test_the_client_refuses_a_lease_whose_shard_hash_is_a_path():
    def handler(request):
        return httpx.Response(200, json=lease_json(shard_sha256="/etc/shadow"))

    with pytest.raises(InvalidAnswer, match="shard_sha256"):
        make_client(handler).lease("t")


@pytest.mark.parametrize("token", ["", "a b", "tok\r\nX-Injected: 1", "x" * 257, "é"])
def test_the_client_refuses_a_registration_token_out_of_form(token):
    def handler(request):
        return httpx.Response(201, json={"worker_id": 3, "token": token})

    with pytest.raises(InvalidAnswer, match="token"):
        make_client(handler).register("t", protocol.RegisterRequest())


# -- the model's size: this machine's cap, checked on the meta device ------------------------------------

XL_1_6B = ModelConfig(vocab_size=256, n_layer=48, n_head=26, d_model=1664, context=1024, dropout=0.0)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the RSS from /proc")
def test_a_model_above_the_memory_derived_cap_is_refused_without_allocating(tmp_path, monkeypatch):
    laptop = memory.Memory(total_ram=16 * 10**9, available_ram=8 * 10**9)
    monkeypatch.setattr(memory, "probe", lambda device: laptop)
    w = _worker(tmp_path)  # no --max-params: the cap comes from the (fake) machine's memory
    assert w.max_params == memory.default_max_params(laptop) < 200_000_000
    lease = make_lease().model_copy(update={"model": XL_1_6B})
    before = _rss_bytes()
    with pytest.raises(RuntimeError, match=r"1,59\d,\d{3},\d{3} parameters, above this worker's limit of "
                                           r"[\d,]+ \(--max-params"):
        w._round(lease)
    assert _rss_bytes() - before < 100 * 2**20  # 1.6B fp32 parameters alone would be 6.4 GB


def test_a_lease_whose_context_needs_more_memory_than_the_cap_is_refused(tmp_path):
    """A small model is no way around the cap: the activations of a context count too. A batch too
    big at once goes in micro-batches (worker/fit.py); a context too long for one row is refused."""
    model = ModelConfig(vocab_size=256, n_layer=3, n_head=4, d_model=128, context=65536, dropout=0.0)
    lease = make_lease().model_copy(update={"model": model,
                                            "inner": make_lease().inner.model_copy(update={"batch_size": 4096})})
    with pytest.raises(RuntimeError, match=r"batch 1 x context 65536 needs about [\d.]+ GB.*--max-params"):
        _worker(tmp_path, max_params=10_000_000)._round(lease)
    big = _worker(tmp_path, max_params=1_000_000_000)  # room for a few rows of it at a time, not 4096
    rows = big.trainer.micro_batch(lease)
    assert rows is not None and rows < 64
    big.downloads.check(lease)  # accepted: it trains in micro-batches of `rows`


def test_the_default_download_cap_follows_the_parameter_cap(tmp_path):
    w = Worker(WorkerSettings(coordinator=URL, run="t", state_dir=tmp_path, device="cpu", max_params=3_000_000_000))
    try:
        assert w.client.max_download_bytes == memory.snapshot_bytes(3_000_000_000) > 12 * 10**9
    finally:
        w.client.close()


@pytest.mark.parametrize("version", ["", "4x", "-4", "5", "9" * 30, " 4"])
def test_a_snapshot_answering_another_or_no_version_is_refused(version):
    body = b"snapshot bytes"

    def handler(request):
        return httpx.Response(200, content=body, headers={protocol.H_SHA256: hashlib.sha256(body).hexdigest(),
                                                          protocol.H_VERSION: version})

    with pytest.raises(client_mod.IntegrityError, match="version"):
        make_client(handler).snapshot("t", 4)


def test_a_snapshot_failing_its_hash_gives_the_lease_up_without_crashing(tmp_path, no_waiting):
    def handler(request):
        if request.method == "DELETE":
            return httpx.Response(204)
        assert request.url.path == f"{API}/runs/t/snapshots/4"
        return httpx.Response(200, content=b"poison", headers={protocol.H_SHA256: "0" * 64, protocol.H_VERSION: "4"})

    w = _net_worker(tmp_path, handler)
    lease = make_lease()
    assert w._round(lease) is None and w.rounds == 0 and w.downloads.held is None
