"""Fixtures shared by the coordinator, worker, loopback and CLI tests.

    corpus_dir      a small folder of repetitive text files (fast to load, loss falls quickly)
    run_config      factory of tiny RunConfig dicts (one layer, width 32, context 32, 3 steps)
    db_url          the test's database: None (SQLite in the data dir) or a fresh, empty PostgreSQL schema;
                    every test that uses `settings`, `open_api` or `api` runs on both
    app_db_url      like db_url, but already at the newest migration with every table empty (what the
                    apps of `settings`, `open_api` and `api` start on: their start skips the migrations)
    settings        CoordinatorSettings on a tmp data dir (and app_db_url's database; on SQLite a copy of
                    a migrated, empty database file); corpus_dir is an allowed corpus folder; the admin
                    token is generated in the data dir
    open_api        context manager: a TestClient over create_app(start_merger=False), wrapped in Api;
                    requests go to Host 127.0.0.1 (the coordinator refuses names it does not know)
    api             open_api(settings) for the length of one test
    run             the tiny run "t" created on `api` (its RunConfig)
    make_delta      a valid encoded delta for a lease, from a seeded random pseudo-gradient
    train_delta     a valid encoded delta for a lease, from a real LocalTrainer round (local_round)
    encode_unchecked  the delta envelope without the encoder's own checks (NaN, names)

Tests drive merging themselves with `api.drain()`; nothing runs in the background.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import random
import shutil
import struct
import tracemalloc
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
DB_FIXTURES = {"settings", "open_api", "api", "db_url", "app_db_url"}
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


def _on_postgres(backend: str) -> bool:
    """False for SQLite; True for PostgreSQL, where the test is skipped when no server answers."""
    if backend == "sqlite":
        return False
    reason = postgres_reason()
    if reason:
        pytest.skip(reason)
    return True


@contextlib.contextmanager
def fresh_database(backend: str) -> Iterator[str | None]:
    """A fresh, empty PostgreSQL schema's URL (dropped after), or None for SQLite; skips the
    test when PostgreSQL cannot be reached."""
    if not _on_postgres(backend):
        yield None
        return
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


# -- databases already at the newest migration ---------------------------------------------------
# Every app a test opens would otherwise run all the migrations on an empty database first (a few
# tenths of a second each, over a thousand times a suite). The migrations themselves are tested on
# empty databases (test_migrations.py, and every real `serve` process of tests/e2e).

_migrated: dict[str, object] = {}  # this process's "sqlite" template file, "free" schemas, "admin" engine, "head"


def _schema_url(schema: str) -> str:
    return f"{PG_URL}?options=-csearch_path%3D{schema}"


def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database file at the newest migration, every table empty (made once per process)."""
    if "sqlite" not in _migrated:
        from coordinator.db import init_db, make_engine

        path = tmp_path_factory.mktemp("migrated") / "idletrain.sqlite3"
        engine = make_engine(f"sqlite:///{path}")
        init_db(engine)
        engine.dispose()  # the last connection's close folds the write-ahead log into the file
        _migrated["sqlite"] = path
    return _migrated["sqlite"]  # type: ignore[return-value]


def _admin():
    """This process's engine on PG_URL, for making, emptying and dropping schemas."""
    if "admin" not in _migrated:
        from sqlalchemy import create_engine

        _migrated["admin"] = create_engine(PG_URL, pool_size=1)
    return _migrated["admin"]


def _new_migrated_schema() -> str:
    from sqlalchemy import text

    from coordinator.db import init_db, make_engine

    schema = f"m_{uuid.uuid4().hex[:16]}"
    with _admin().begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine = make_engine(_schema_url(schema))
    init_db(engine)
    engine.dispose()
    return schema


def _emptied(schema: str) -> bool:
    """Empty every table of a schema a test is done with (and restart its sequences), so another
    test can start on it; False (the caller drops it) unless it is as the migrations left it: the
    models' tables and no others, at the newest revision, no process holding its merger lock, and
    few rows deleted (the dead ones would slow the next test's scans until a vacuum)."""
    from sqlalchemy import text

    from coordinator import leader, migrate
    from coordinator.models import Base

    if "head" not in _migrated:
        _migrated["head"] = migrate.head()
    try:
        with _admin().begin() as conn:
            conn.execute(text(f"SET LOCAL search_path TO \"{schema}\"; SET LOCAL lock_timeout = '5s'"))
            tables = set(conn.execute(text("SELECT table_name FROM information_schema.tables "
                                           "WHERE table_schema = current_schema()")).scalars())
            if tables != {t.name for t in Base.metadata.sorted_tables} | {"alembic_version"}:
                return False
            if conn.execute(text("SELECT version_num FROM alembic_version")).scalar() != _migrated["head"]:
                return False
            if conn.execute(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                                 "AND classid = :cls AND objid = hashtext(current_database() || '/' || "
                                 "current_schema())::oid"), {"cls": leader.LOCK_CLASS}).scalar():
                return False
            deleted = sum(conn.execute(table.delete()).rowcount  # referencing rows first
                          for table in reversed(Base.metadata.sorted_tables))
            if deleted > 1000:  # its dead rows would slow the next test's scans: a fresh schema instead
                return False
            for seq in conn.execute(text("SELECT sequence_name FROM information_schema.sequences "
                                         "WHERE sequence_schema = current_schema()")).scalars().all():
                conn.execute(text(f'ALTER SEQUENCE "{seq}" RESTART'))
        return True
    except Exception:
        return False


def _drop_schema(schema: str) -> None:
    from sqlalchemy import text

    with _admin().begin() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


@contextlib.contextmanager
def migrated_database(backend: str) -> Iterator[str | None]:
    """A PostgreSQL schema at the newest migration with every table empty (emptied and kept for the
    next test after; dropped when the session ends), or None for SQLite; skips the test when
    PostgreSQL cannot be reached."""
    if not _on_postgres(backend):
        yield None
        return
    free: list[str] = _migrated.setdefault("free", [])  # type: ignore[assignment]
    schema = free.pop() if free else _new_migrated_schema()
    try:
        yield _schema_url(schema)
    finally:
        if _emptied(schema):
            free.append(schema)
        else:
            _drop_schema(schema)


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
    for schema in _migrated.pop("free", []):  # type: ignore[union-attr]
        _drop_schema(schema)


def _skip_reason(report) -> str:
    longrepr = getattr(report, "longrepr", None)
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr or "")


@pytest.fixture
def db_url(db_backend: str) -> Iterator[str | None]:
    """A fresh, empty PostgreSQL schema for this test (dropped after), or None for SQLite."""
    with fresh_database(db_backend) as url:
        yield url


@pytest.fixture
def app_db_url(db_backend: str) -> Iterator[str | None]:
    """A PostgreSQL schema at the newest migration, every table empty, or None for SQLite."""
    with migrated_database(db_backend) as url:
        yield url


def peak_bytes(fn) -> int:
    """The most memory Python and numpy allocations held at once while fn() ran (tracemalloc's peak)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


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
def settings(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, app_db_url: str | None,
             corpus_dir: Path) -> CoordinatorSettings:
    data_dir = tmp_path / "coordinator"
    if app_db_url is None:  # SQLite in the data dir: a copy of the migrated, empty database
        data_dir.mkdir()
        shutil.copyfile(_sqlite_template(tmp_path_factory), data_dir / "idletrain.sqlite3")
    # snapshot_duty 1: every merged version's snapshot is written at once, however long a loaded disk takes
    # (at 0.2 one over 0.25 s holds the next back until the idle merger catches up, and a test reading
    # snapshots/latest after drain() would see an older version); tests of the duty set their own
    return CoordinatorSettings(data_dir=data_dir, database_url=app_db_url, corpus_dirs=[corpus_dir],
                               snapshot_duty=1.0)


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
def open_api(app_db_url: str | None, corpus_dir: Path):
    """open_api(settings) -> context manager yielding an Api; leaving it shuts the app down.
    Settings without a database URL get the test's (so every API test runs on both backends), and
    settings that allow no corpus folder allow corpus_dir."""

    @contextlib.contextmanager
    def _open(settings: CoordinatorSettings) -> Iterator[Api]:
        if settings.database_url is None and app_db_url is not None:
            settings = settings.model_copy(update={"database_url": app_db_url})
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


def local_round(api: Api, lease: protocol.Lease, headers: dict, trainer=None, *, exchange=None):
    """A real local round of `lease` (worker.trainer's RoundResult): its snapshot (unless the trainer
    holds its replica) and shard downloaded through the API, hashes checked; `exchange` as train_round's."""
    from shared.snapshot import decode_snapshot
    from worker.trainer import LocalTrainer

    trainer = trainer or LocalTrainer(torch.device("cpu"))
    params = None
    if trainer.needs_snapshot(lease):
        snap = api.client.get(f"{API}/runs/{lease.run}/snapshots/{lease.base_version}")
        assert hashlib.sha256(snap.content).hexdigest() == snap.headers[protocol.H_SHA256]
        params, _ = decode_snapshot(snap.content, schema=schema_of(lease))
    raw = api.shard(lease.shard_id, headers, run=lease.run)
    assert hashlib.sha256(raw).hexdigest() == lease.shard_sha256
    tokens = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
    return trainer.train_round(lease, params, tokens, exchange=exchange)


@pytest.fixture
def train_delta():
    """train(api, lease, headers, trainer=None) -> encoded delta from a real local round on the
    lease's snapshot and shard (local_round)."""
    def train(api: Api, lease: protocol.Lease, headers: dict, trainer=None) -> bytes:
        return local_round(api, lease, headers, trainer).body

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
