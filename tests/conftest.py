"""Fixtures shared by the coordinator, worker, loopback and CLI tests.

    corpus_dir      a small folder of repetitive text files (fast to load, loss falls quickly)
    run_config      factory of tiny RunConfig dicts (one layer, width 32, context 32, 3 steps)
    db_url          the test's database: None (SQLite in the data dir) or a fresh PostgreSQL schema;
                    every test that uses `settings`, `open_api` or `api` runs on both
    settings        CoordinatorSettings on a tmp data dir (and db_url's database); corpus_dir is an
                    allowed corpus folder; the admin token is generated in the data dir
    open_api        context manager: a TestClient over create_app(start_merger=False), wrapped in Api;
                    requests go to Host 127.0.0.1 (the coordinator refuses names it does not know)
    api             open_api(settings) for the length of one test
    run             the tiny run "t" created on `api` (its RunConfig)
    make_delta      a valid encoded delta for a lease, from a seeded random pseudo-gradient
    train_delta     a valid encoded delta for a lease, from a real LocalTrainer round
    encode_unchecked  the delta envelope without the encoder's own checks (NaN, names)

Tests drive merging themselves with `api.drain()`; nothing runs in the background.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import random
import struct
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

with warnings.catch_warnings():  # starlette nags about httpx2; the TestClient works as it is
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.settings import CoordinatorSettings
from shared import codec, protocol
from shared.algorithms.compress import compress
from shared.codec.envelope import HEADER
from shared.codec.indices import IndexKind
from shared.codec.values import ValueKind
from shared.config import CompressionConfig, RunConfig
from shared.model import build_model, param_schema
from tests import procs

API = protocol.API_PREFIX

_WORDS = ("the model learns from bytes while idle machines train one shared network over plain http "
          "each worker leases a shard and sends back a small delta the coordinator merges in order").split()


def pytest_configure(config: pytest.Config) -> None:
    # `slow` is declared in pyproject; tests marked with it still run by default (deselect with -m "not slow").
    config.addinivalue_line("filterwarnings", "ignore::starlette.exceptions.StarletteDeprecationWarning")


# -- the database backends ----------------------------------------------------------------------

PG_URL = os.environ.get("IDLETRAIN_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
DB_FIXTURES = {"settings", "open_api", "api", "db_url"}
_pg: dict[str, object] = {}


def postgres_reason() -> str | None:
    """None when PostgreSQL answers at PG_URL, else why not (checked once per session)."""
    if "reason" not in _pg:
        try:
            import psycopg  # noqa: F401
            from sqlalchemy import create_engine, text

            engine = create_engine(PG_URL, connect_args={"connect_timeout": 3})
            with engine.connect() as conn:
                conn.execute(text("select 1"))
            engine.dispose()
            _pg["reason"] = None
        except Exception as exc:  # no driver, no server, no database: all mean "cannot test it here"
            _pg["reason"] = f"PostgreSQL is not reachable at {PG_URL} ({type(exc).__name__}: {exc})"
    return _pg["reason"]  # type: ignore[return-value]


@contextlib.contextmanager
def fresh_database(backend: str) -> Iterator[str | None]:
    """A fresh, empty PostgreSQL schema's URL (dropped after), or None for SQLite; skips the
    test when PostgreSQL cannot be reached."""
    if backend == "sqlite":
        yield None
        return
    reason = postgres_reason()
    if reason:
        pytest.skip(reason)
    from sqlalchemy import create_engine, text

    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # A module whose fixtures pick the backend themselves (module-scoped apps) says so.
    if getattr(metafunc.module, "OWN_DB_BACKENDS", False):
        return
    if DB_FIXTURES & set(metafunc.fixturenames) and "db_backend" not in metafunc.fixturenames:
        metafunc.fixturenames.append("db_backend")
    if "db_backend" in metafunc.fixturenames:
        metafunc.parametrize("db_backend", ["sqlite", "postgresql"], scope="function")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    reason = _pg.get("reason")
    if reason is None:  # under pytest-xdist the workers tried the server; their skips carry the reason
        reason = next((_skip_reason(r) for r in terminalreporter.stats.get("skipped", [])
                       if "PostgreSQL is not reachable" in _skip_reason(r)), None)
    if reason:
        terminalreporter.write_sep("!", "PostgreSQL tests SKIPPED", red=True, bold=True)
        terminalreporter.write_line(f"{reason}; start it (see .ci/run) to test the PostgreSQL backend", red=True)


def pytest_sessionfinish(session, exitstatus) -> None:
    # every process a test started (tests/procs.py) and did not stop, with its children: none outlives the suite
    procs.kill_leftovers()


def _skip_reason(report) -> str:
    longrepr = getattr(report, "longrepr", None)
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr or "")


@pytest.fixture
def db_url(db_backend: str) -> Iterator[str | None]:
    """A fresh, empty PostgreSQL schema for this test (dropped after), or None for SQLite."""
    with fresh_database(db_backend) as url:
        yield url


def write_corpus(root: Path, *, n_files: int = 40, file_bytes: int = 1000, seed: int = 0) -> Path:
    """Repetitive pseudo-English in `n_files` .txt files (every 20th file becomes the eval split)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < file_bytes:
            words.append(rng.choice(_WORDS))
        (root / f"doc{i:03d}.txt").write_text(" ".join(words)[:file_bytes])
    return root


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models train faster in one torch thread than in two on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 files of 1000 bytes: 38 KB of training text (4 shards of 8192) and 2 KB held out."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


TINY_MODEL = {"n_layer": 1, "d_model": 32, "n_head": 2, "context": 32}


@pytest.fixture
def run_config(corpus_dir: Path):
    """make(name="t", **overrides) -> a tiny RunConfig as a JSON-able dict (nested overrides merge)."""

    def make(name: str = "t", **overrides) -> dict:
        base = {"name": name, "corpus": str(corpus_dir), "corpus_max_bytes": 1 << 18, "shard_tokens": 8192,
                "eval_tokens": 4096, "model": dict(TINY_MODEL), "inner": {"steps": 3, "batch_size": 4},
                "outer": {"group": 2}, "epochs": 0}  # epochs repeat (the default stops after one: lifecycle tests)
        return _deep_merge(base, overrides)

    return make


@pytest.fixture
def settings(tmp_path: Path, db_url: str | None, corpus_dir: Path) -> CoordinatorSettings:
    return CoordinatorSettings(data_dir=tmp_path / "coordinator", database_url=db_url, corpus_dirs=[corpus_dir])


# What the in-process app is asked for: a loopback name, as a local worker would (the default
# TestClient's "testserver" is a name the coordinator does not answer to).
BASE_URL = "http://127.0.0.1"


class Api:
    """A TestClient over the in-process app plus the few calls every test makes."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    @property
    def admin(self) -> dict:
        """The operator's Authorization header (the app's token: given, or generated in its data dir)."""
        return {"Authorization": f"Bearer {self.client.app.state.admin_token}"}

    def operator(self, method: str, path: str, **kwargs):
        """An operator request (admin token sent): api.operator("post", f"{API}/runs/t/pause")."""
        return self.client.request(method.upper(), path, headers={**self.admin, **kwargs.pop("headers", {})},
                                   **kwargs)

    # the app's live objects
    @property
    def coordinator(self):
        return self.client.app.state.coordinator

    @property
    def merger(self):
        return self.client.app.state.merger

    def runtime(self, run: str = "t"):
        (rt,) = [rt for rt in self.coordinator.live.runtime_list() if rt.config.name == run]
        return rt

    def db(self):
        """An ORM session on the app's database, for a test to look at (or set up) rows directly."""
        from sqlalchemy.orm import Session

        return Session(self.coordinator.db.engine, expire_on_commit=False)

    def drain(self) -> int:
        return self.merger.drain()

    # HTTP
    def create_run(self, cfg: dict, headers: dict | None = None) -> dict:
        """As the operator (the app's admin token, unless `headers` say otherwise)."""
        resp = self.client.post(f"{API}/runs", json=cfg, headers=self.admin if headers is None else headers)
        assert resp.status_code == 201, resp.text
        return resp.json()

    def register(self, run: str = "t", **body) -> dict:
        """Register a worker; returns its Authorization headers."""
        resp = self.client.post(f"{API}/runs/{run}/workers", json=body)
        assert resp.status_code == 201, resp.text
        return {"Authorization": f"Bearer {resp.json()['token']}"}

    def lease(self, headers: dict, run: str = "t") -> protocol.Lease:
        resp = self.client.post(f"{API}/runs/{run}/leases", headers=headers)
        assert resp.status_code == 200, (resp.status_code, resp.text)
        return protocol.Lease.model_validate(resp.json())

    def upload(self, lease_id: int, body: bytes, headers: dict, content_type: str = "application/octet-stream"):
        return self.client.post(f"{API}/leases/{lease_id}/delta", content=body,
                                headers={**headers, "Content-Type": content_type})

    def accept(self, lease_id: int, body: bytes, headers: dict) -> protocol.DeltaAccepted:
        resp = self.upload(lease_id, body, headers)
        assert resp.status_code == 202, (resp.status_code, resp.text)
        return protocol.DeltaAccepted.model_validate(resp.json())

    def status(self, run: str = "t") -> dict:
        resp = self.client.get(f"{API}/runs/{run}/status")
        assert resp.status_code == 200, resp.text
        return resp.json()

    def snapshot(self, version: int | str = "latest", run: str = "t") -> bytes:
        resp = self.client.get(f"{API}/runs/{run}/snapshots/{version}")
        assert resp.status_code == 200, resp.text
        return resp.content

    def shard(self, index: int, headers: dict, run: str = "t") -> bytes:
        """The raw tokens of a shard (decompressed)."""
        resp = self.client.get(f"{API}/runs/{run}/shards/{index}", headers=headers)
        assert resp.status_code == 200, resp.text
        return zstandard.ZstdDecompressor().stream_reader(resp.content).read()


@pytest.fixture
def open_api(db_url: str | None, corpus_dir: Path):
    """open_api(settings) -> context manager yielding an Api; leaving it shuts the app down.
    Settings without a database URL get the test's (so every API test runs on both backends), and
    settings that allow no corpus folder allow corpus_dir."""

    @contextlib.contextmanager
    def _open(settings: CoordinatorSettings) -> Iterator[Api]:
        if settings.database_url is None and db_url is not None:
            settings = settings.model_copy(update={"database_url": db_url})
        if not settings.corpus_dirs:
            settings = settings.model_copy(update={"corpus_dirs": [corpus_dir]})
        with TestClient(create_app(settings, start_merger=False), base_url=BASE_URL) as client:
            yield Api(client)

    return _open


@pytest.fixture
def api(open_api, settings: CoordinatorSettings) -> Iterator[Api]:
    with open_api(settings) as a:
        yield a


@pytest.fixture
def run(api: Api, run_config) -> RunConfig:
    """The tiny run "t" (4 shards of 8192 tokens), created through the API."""
    cfg = run_config()
    created = api.create_run(cfg)
    assert created["n_shards"] == 4
    return RunConfig.model_validate(cfg)


def schema_of(lease: protocol.Lease) -> dict[str, tuple[int, ...]]:
    return param_schema(build_model(lease.model))


@pytest.fixture
def make_delta():
    """make(lease, seed=None, scale=1e-3, base_version=None, compression=None) -> encoded delta bytes.

    A random pseudo-gradient seeded by `seed` and the lease's id (the same lease and seed give the
    same bytes; two leases never do: the coordinator merges identical bytes once per run), compressed
    the way the lease says (or `compression`). The default scale is what an honest round of the tiny run could move (3 steps of
    lr 2e-3: at most ~6e-3 per element); the coordinator's screen refuses far larger values."""

    def make(lease: protocol.Lease, *, seed: int | None = None, scale: float = 1e-3, base_version: int | None = None,
             compression: CompressionConfig | None = None) -> bytes:
        gen = torch.Generator().manual_seed((seed or 0) * 1_000_003 + lease.lease_id)
        grads = {n: torch.randn(shape, generator=gen) * scale for n, shape in schema_of(lease).items()}
        delta = compress(grads, compression or lease.compression,
                         base_version=lease.base_version if base_version is None else base_version,
                         round_seed=lease.seed)
        return codec.encode(delta)

    return make


@pytest.fixture
def train_delta():
    """train(api, lease, headers, trainer=None) -> encoded delta from a real local round on the
    lease's snapshot and shard (downloaded through the API, hashes checked)."""
    from shared.snapshot import decode_snapshot
    from worker.trainer import LocalTrainer

    def train(api: Api, lease: protocol.Lease, headers: dict, trainer: LocalTrainer | None = None) -> bytes:
        snap = api.client.get(f"{API}/runs/{lease.run}/snapshots/{lease.base_version}")
        assert hashlib.sha256(snap.content).hexdigest() == snap.headers[protocol.H_SHA256]
        params, _ = decode_snapshot(snap.content, schema=schema_of(lease))
        raw = api.shard(lease.shard_id, headers, run=lease.run)
        assert hashlib.sha256(raw).hexdigest() == lease.shard_sha256
        tokens = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
        trainer = trainer or LocalTrainer(torch.device("cpu"))
        return trainer.train_round(lease, params, tokens).body

    return train


def _encode_unchecked(base_version: int, entries: list[tuple[str, np.ndarray]]) -> bytes:
    """A delta envelope of dense fp32 entries, built by hand: no finiteness or name checks, so
    tests can send what a buggy or hostile worker would."""
    body = bytearray(struct.pack("<QI", base_version, len(entries)))
    for name, values in entries:
        raw_name = name.encode()
        values = np.asarray(values, dtype="<f4").reshape(-1)
        body += struct.pack("<H", len(raw_name)) + raw_name
        body += struct.pack("<BBQQ", IndexKind.DENSE, ValueKind.FP32, values.size, values.size)
        body += values.tobytes()
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(bytes(body))
    return HEADER.pack(codec.MAGIC, codec.FORMAT_VERSION, len(body)) + frame


@pytest.fixture
def encode_unchecked():
    return _encode_unchecked



@pytest.fixture
def database_full():
    """database_full(engine) -> context manager: every INSERT, UPDATE and DELETE on `engine` fails
    inside it the way the driver fails on a full disk (SQLite's "database or disk is full",
    PostgreSQL's 53100 disk_full), so SQLAlchemy wraps it and rolls back as it would for real."""
    from sqlalchemy import event

    @contextlib.contextmanager
    def _full(engine) -> Iterator[None]:
        if engine.dialect.name == "sqlite":
            import sqlite3

            def error() -> Exception:
                return sqlite3.OperationalError("database or disk is full")
        else:
            import psycopg

            def error() -> Exception:
                return psycopg.errors.DiskFull("could not extend file: No space left on device")

        def refuse(_conn, _cursor, statement, *_args):
            if statement.lstrip().split(None, 1)[0].upper() in ("INSERT", "UPDATE", "DELETE"):
                raise error()

        event.listen(engine, "before_cursor_execute", refuse)
        try:
            yield
        finally:
            event.remove(engine, "before_cursor_execute", refuse)

    return _full
