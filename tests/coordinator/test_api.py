"""The coordinator's HTTP API, in process (TestClient over create_app, merging driven by the test)."""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
import torch

from coordinator.settings import CoordinatorSettings
from shared import codec, protocol
from shared.codec import Delta, Entry, IndexKind, ValueKind
from shared.config import RunConfig
from shared.model import build_model, count_params, get_params, param_schema
from shared.snapshot import decode_snapshot

API = protocol.API_PREFIX


def test_healthz(api):
    resp = api.client.get("/healthz")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok", "api_version": protocol.API_VERSION, "keeps_delivering_lease": True}


def test_openapi_lists_every_route(api):
    resp = api.client.get("/openapi.json")
    assert resp.status_code == 200
    paths = resp.json()["paths"]
    expected = {
        ("get", "/healthz"),
        ("post", f"{API}/runs"), ("get", f"{API}/runs"),
        ("get", f"{API}/runs/{{run}}/status"), ("get", f"{API}/runs/{{run}}/config"),
        ("post", f"{API}/runs/{{run}}/evaluate"),
        ("post", f"{API}/runs/{{run}}/workers"),
        ("post", f"{API}/runs/{{run}}/leases"),
        ("get", f"{API}/runs/{{run}}/snapshots/{{version}}"),
        ("get", f"{API}/runs/{{run}}/shards/{{shard}}"),
        ("post", f"{API}/leases/{{lease_id}}/delta"),
    }
    listed = {(method, path) for path, ops in paths.items() for method in ops}
    assert expected <= listed, expected - listed
    upload = paths[f"{API}/leases/{{lease_id}}/delta"]["post"]
    assert "application/octet-stream" in upload["requestBody"]["content"]
    assert "204" in paths[f"{API}/runs/{{run}}/leases"]["post"]["responses"]


# -- runs -------------------------------------------------------------------------------------

def test_create_run_then_duplicate_name_conflicts(api, run_config):
    cfg = run_config()
    created = api.create_run(cfg)
    model = build_model(RunConfig.model_validate(cfg).model)
    assert created["name"] == "t"
    assert created["n_shards"] == 4
    assert created["n_params"] == count_params(model)
    assert created["train_tokens"] == 4 * 8192
    assert created["eval_tokens"] > 0

    resp = api.client.post(f"{API}/runs", json=run_config(inner={"steps": 7}))
    assert resp.status_code == 409
    assert "'t'" in resp.json()["detail"]
    runs = api.client.get(f"{API}/runs").json()
    assert [(r["name"], r["state"], r["version"]) for r in runs] == [("t", "active", 0)]
    # the first run's config stands
    assert api.client.get(f"{API}/runs/t/config").json()["inner"]["steps"] == 3


@pytest.mark.parametrize("overrides", [
    {"name": "bad name!"},
    {"inner": {"steps": 0}},
    {"no_such_field": 1},
    {"compression": {"index": "dense", "fraction": 0.1}},
    {"model": {"n_head": 3}},  # 32 is not divisible by 3
    {"model": {"colour": "blue"}},
    {"shard_tokens": 16},  # below the context
    {"corpus": "/nonexistent/corpus/folder"},  # refused by the service, not the schema
    {"shard_tokens": 1 << 20},  # the corpus is smaller than one shard
    {"model": {"context": 1100}, "eval_tokens": 1024, "shard_tokens": 4096},  # eval_tokens shorter than a context
], ids=["name", "steps", "extra-field", "dense-fraction", "heads", "model-key", "shard-vs-context", "corpus",
        "shard-vs-corpus", "eval-vs-context"])
def test_invalid_run_config_is_422_and_leaves_nothing_behind(api, run_config, overrides):
    resp = api.client.post(f"{API}/runs", json=run_config(**overrides))
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"]
    assert api.client.get(f"{API}/runs").json() == []
    # the name is still free: a refused run leaves no half-made run behind
    assert api.create_run(run_config())["name"] == "t"


def test_config_hides_the_join_key(api, run_config):
    api.create_run(run_config(join_key="sesame-open-1234"))
    cfg = api.client.get(f"{API}/runs/t/config").json()
    assert "join_key" not in cfg
    assert cfg["inner"]["steps"] == 3


# -- workers ----------------------------------------------------------------------------------

def test_register_returns_a_token(api, run):
    resp = api.client.post(f"{API}/runs/t/workers", json={"name": "alice", "team": "x", "device": "cpu"})
    assert resp.status_code == 201
    body = resp.json()
    assert isinstance(body["worker_id"], int) and len(body["token"]) >= 32
    second = api.client.post(f"{API}/runs/t/workers", json={}).json()
    assert second["worker_id"] != body["worker_id"] and second["token"] != body["token"]
    assert api.status()["workers_total"] == 2


def test_register_refuses_unknown_fields(api, run):
    resp = api.client.post(f"{API}/runs/t/workers", json={"nmae": "typo"})
    assert resp.status_code == 422
    assert api.status()["workers_total"] == 0


def test_join_key(api, run_config):
    api.create_run(run_config(join_key="sesame-open-1234"))
    missing = api.client.post(f"{API}/runs/t/workers", json={})
    assert missing.status_code == 401
    assert "join key" in missing.json()["detail"]
    wrong = api.client.post(f"{API}/runs/t/workers", json={"join_key": "sesame-open-9999"})
    assert wrong.status_code == 403
    assert "join key" in wrong.json()["detail"]
    assert api.status()["workers_total"] == 0
    right = api.client.post(f"{API}/runs/t/workers", json={"join_key": "sesame-open-1234"})
    assert right.status_code == 201
    assert api.status()["workers_total"] == 1


def test_lease_fields(api, run):
    headers = api.register()
    before = datetime.now(timezone.utc)
    resp = api.client.post(f"{API}/runs/t/leases", headers=headers)
    assert resp.status_code == 200
    lease = protocol.Lease.model_validate(resp.json())
    assert lease.run == "t"
    assert lease.base_version == 0
    assert 0 <= lease.shard_id < 4
    assert lease.lr == pytest.approx(run.inner.lr)  # nothing trained yet: the peak lr
    assert lease.inner == run.inner
    assert lease.compression == run.compression
    assert lease.model == run.model.to_dict()
    ttl = timedelta(seconds=run.lease_ttl_s)
    assert before + ttl - timedelta(seconds=5) <= lease.deadline <= datetime.now(timezone.utc) + ttl
    raw = api.shard(lease.shard_id, headers)
    assert hashlib.sha256(raw).hexdigest() == lease.shard_sha256
    # a second worker gets another shard and its own seed
    other = api.lease(api.register())
    assert other.shard_id != lease.shard_id
    assert other.seed != lease.seed and other.lease_id != lease.lease_id
    assert api.status()["workers_active"] == 2


def test_lease_needs_a_token(api, run):
    assert api.client.post(f"{API}/runs/t/leases").status_code == 401
    resp = api.client.post(f"{API}/runs/t/leases", headers={"Authorization": "Bearer nope"})
    assert resp.status_code == 401
    assert resp.json()["detail"] == "unknown token"
    assert resp.headers["www-authenticate"] == "Bearer"


def test_worker_of_another_run_is_refused(api, run, run_config):
    api.create_run(run_config(name="u"))
    headers_u = api.register("u")
    resp = api.client.post(f"{API}/runs/t/leases", headers=headers_u)
    assert resp.status_code == 403
    assert "another run" in resp.json()["detail"]
    assert api.client.get(f"{API}/runs/t/shards/0", headers=headers_u).status_code == 403
    assert api.status()["workers_active"] == 0


# -- snapshots and shards ---------------------------------------------------------------------

def _check_snapshot_headers(resp, *, version: int, immutable: bool) -> str:
    assert resp.status_code == 200
    sha = hashlib.sha256(resp.content).hexdigest()
    assert resp.headers[protocol.H_SHA256] == sha
    assert resp.headers["etag"] == f'"{sha}"'
    assert resp.headers[protocol.H_VERSION] == str(version)
    assert resp.headers["content-type"] == "application/octet-stream"
    if immutable:
        assert "immutable" in resp.headers["cache-control"] and "max-age=31536000" in resp.headers["cache-control"]
    else:
        assert resp.headers["cache-control"] == "no-cache"
    return sha


def test_snapshot_by_version_and_latest(api, run, make_delta):
    numbered = api.client.get(f"{API}/runs/t/snapshots/0")
    latest = api.client.get(f"{API}/runs/t/snapshots/latest")
    sha0 = _check_snapshot_headers(numbered, version=0, immutable=True)
    assert _check_snapshot_headers(latest, version=0, immutable=False) == sha0
    assert numbered.content == latest.content

    model = build_model(run.model, seed=run.seed)
    params, meta = decode_snapshot(numbered.content, schema=param_schema(model))
    assert meta["version"] == "0" and meta["run"] == "t"
    for name, t in get_params(model).items():
        assert torch.equal(params[name], t), name

    # If-None-Match with the current ETag: 304, no body
    for path in ("0", "latest"):
        resp = api.client.get(f"{API}/runs/t/snapshots/{path}", headers={"If-None-Match": f'"{sha0}"'})
        assert resp.status_code == 304 and resp.content == b""
        assert resp.headers["etag"] == f'"{sha0}"'
    stale = api.client.get(f"{API}/runs/t/snapshots/0", headers={"If-None-Match": '"something-else"'})
    assert stale.status_code == 200 and stale.content == numbered.content

    # after a merge, latest moves (and a cached latest is no longer fresh); version 0 does not
    headers = api.register()
    lease = api.lease(headers)
    api.accept(lease.lease_id, make_delta(lease), headers)
    assert api.drain() == 1
    moved = api.client.get(f"{API}/runs/t/snapshots/latest", headers={"If-None-Match": f'"{sha0}"'})
    sha1 = _check_snapshot_headers(moved, version=1, immutable=False)
    assert sha1 != sha0
    assert api.client.get(f"{API}/runs/t/snapshots/0").content == numbered.content
    assert _check_snapshot_headers(api.client.get(f"{API}/runs/t/snapshots/1"), version=1, immutable=True) == sha1


def test_snapshot_304_moves_no_bytes(api, run):
    first = api.client.get(f"{API}/runs/t/snapshots/0")
    counted = api.status()["bytes_down_model"]
    assert counted == len(first.content)
    resp = api.client.get(f"{API}/runs/t/snapshots/0", headers={"If-None-Match": first.headers["etag"]})
    assert resp.status_code == 304
    assert api.status()["bytes_down_model"] == counted  # a 304 carries no body


def test_unknown_snapshot_version(api, run):
    resp = api.client.get(f"{API}/runs/t/snapshots/5")
    assert resp.status_code == 404
    assert "latest is 0" in resp.json()["detail"]
    bad = api.client.get(f"{API}/runs/t/snapshots/abc")
    assert bad.status_code == 422 and bad.json()["detail"]


def test_shard(api, run):
    headers = api.register()
    lease = api.lease(headers)
    resp = api.client.get(f"{API}/runs/t/shards/{lease.shard_id}", headers=headers)
    assert resp.status_code == 200
    import zstandard
    raw = zstandard.ZstdDecompressor().stream_reader(resp.content).read()
    assert len(raw) == run.shard_tokens
    assert resp.headers[protocol.H_SHA256] == hashlib.sha256(raw).hexdigest() == lease.shard_sha256
    assert api.status()["bytes_down_data"] == len(resp.content)
    # every shard is distinct text from the corpus
    shas = {api.client.get(f"{API}/runs/t/shards/{i}", headers=headers).headers[protocol.H_SHA256] for i in range(4)}
    assert len(shas) == 4
    assert api.client.get(f"{API}/runs/t/shards/4", headers=headers).status_code == 404
    assert api.client.get(f"{API}/runs/t/shards/0").status_code == 401


def _shard_shas(api, run: str, n: int) -> list[str]:
    headers = api.register(run)
    assert api.client.get(f"{API}/runs/{run}/shards/{n}", headers=headers).status_code == 404
    return [api.client.get(f"{API}/runs/{run}/shards/{i}", headers=headers).headers[protocol.H_SHA256]
            for i in range(n)]


def test_shards_are_numbered_in_an_order_the_run_seed_shuffles(api, run_config, corpus_dir):
    from shared.data import cut_shards, load_corpus

    train = load_corpus(str(corpus_dir), max_bytes=1 << 18).train
    pieces = [hashlib.sha256(p.tobytes()).hexdigest() for p in cut_shards(train, 4096)]
    for name, extra in [("shuffled", {"seed": 3}), ("inorder", {"seed": 3, "shuffle_shards": False})]:
        api.create_run(run_config(name, shard_tokens=4096, **extra))
    shuffled, inorder = _shard_shas(api, "shuffled", len(pieces)), _shard_shas(api, "inorder", len(pieces))
    assert inorder == pieces  # the corpus's own order
    assert sorted(shuffled) == sorted(pieces) and shuffled != pieces
    expected = [hashlib.sha256(p.tobytes()).hexdigest() for p in cut_shards(train, 4096, shuffle_seed=3)]
    assert shuffled == expected  # the seed's order, the same on every coordinator


# -- deltas -----------------------------------------------------------------------------------

def test_upload_then_merge(api, run, train_delta):
    headers = api.register()
    lease = api.lease(headers)
    body = train_delta(api, lease, headers)
    v0 = api.snapshot("latest")
    down_before = api.status()["bytes_down"]

    resp = api.upload(lease.lease_id, body, headers)
    assert resp.status_code == 202, resp.text
    ack = protocol.DeltaAccepted.model_validate(resp.json())
    assert ack.lease_id == lease.lease_id and ack.will_merge_into == 1 and ack.duplicate is False

    queued = api.status()
    tokens = run.inner.steps * run.inner.batch_size * run.model.context
    assert (queued["version"], queued["pending_deltas"], queued["merged_deltas"]) == (0, 1, 0)
    assert queued["bytes_up"] == len(body)
    assert queued["tokens_trained"] == tokens
    assert queued["worker_steps"] == run.inner.steps
    assert queued["shards_done"] == 1
    assert queued["bytes_down"] == down_before
    assert queued["dense_equivalent_bytes"] == run.inner.steps * 8 * queued["n_params"]
    assert queued["workers_active"] == 0  # its lease is delivered

    assert api.drain() == 1
    merged = api.status()
    got = (merged["version"], merged["pending_deltas"], merged["merged_deltas"], merged["rejected_deltas"])
    assert got == (1, 0, 1, 0)
    assert api.snapshot("latest") != v0
    assert api.client.get(f"{API}/runs/t/snapshots/latest").headers[protocol.H_VERSION] == "1"
    assert api.drain() == 0  # nothing more queued


def test_duplicate_upload_is_answered_the_same_and_merged_once(api, run, make_delta):
    headers = api.register()
    lease = api.lease(headers)
    body = make_delta(lease)
    first = api.accept(lease.lease_id, body, headers)
    again = api.accept(lease.lease_id, body, headers)
    assert again.duplicate is True and first.duplicate is False
    assert (again.delta_id, again.will_merge_into) == (first.delta_id, first.will_merge_into) == (again.delta_id, 1)
    assert api.status()["pending_deltas"] == 1
    assert api.drain() == 1
    late = api.accept(lease.lease_id, body, headers)  # a retry after the merge
    assert late.duplicate is True and late.will_merge_into == 1
    assert api.drain() == 0
    st = api.status()
    assert (st["version"], st["merged_deltas"], st["bytes_up"]) == (1, 1, len(body))


def test_different_bytes_for_a_delivered_lease_conflict(api, run, make_delta):
    headers = api.register()
    lease = api.lease(headers)
    api.accept(lease.lease_id, make_delta(lease, seed=1), headers)
    for when in ("queued", "merged"):
        resp = api.upload(lease.lease_id, make_delta(lease, seed=2), headers)
        assert resp.status_code == 409, when
        assert "different delta" in resp.json()["detail"]
        api.drain()
    st = api.status()
    assert (st["version"], st["merged_deltas"], st["pending_deltas"]) == (1, 1, 0)


def _tensor(schema, name):
    return name, int(np.prod(schema[name]))


BAD_UPLOADS = {
    # id: (expected status, builder(ctx) -> (lease_id, body, headers, content_type))
    "no-token": (401, lambda c: (c.lease.lease_id, c.good, {}, None)),
    "bad-token": (401, lambda c: (c.lease.lease_id, c.good, {"Authorization": "Bearer forged"}, None)),
    "other-workers-lease": (403, lambda c: (c.lease.lease_id, c.good, c.other, None)),
    "no-such-lease": (404, lambda c: (987654, c.good, c.headers, None)),
    "content-type-json": (400, lambda c: (c.lease.lease_id, c.good, c.headers, "application/json")),
    "content-type-form": (400, lambda c: (c.lease.lease_id, c.good, c.headers, "application/x-www-form-urlencoded")),
    "garbage": (422, lambda c: (c.lease.lease_id, b"this is not a delta, just some bytes", c.headers, None)),
    "empty": (422, lambda c: (c.lease.lease_id, b"", c.headers, None)),
    "truncated": (422, lambda c: (c.lease.lease_id, c.good[:-7], c.headers, None)),
    "bit-flip": (422, lambda c: (c.lease.lease_id, c.good[:40] + bytes([c.good[40] ^ 0xFF]) + c.good[41:],
                                 c.headers, None)),
    "wrong-base-version": (422, lambda c: (c.lease.lease_id,
                                          c.make_delta(c.lease, base_version=c.lease.base_version + 1),
                                          c.headers, None)),
    "unknown-tensor": (422, lambda c: (c.lease.lease_id, codec.encode(Delta(c.lease.base_version, (
        Entry("no.such.weight", 4, IndexKind.DENSE, ValueKind.FP32, np.ones(4, np.float32)),))), c.headers, None)),
    "wrong-numel": (422, lambda c: (c.lease.lease_id, codec.encode(Delta(c.lease.base_version, (
        Entry("ln_f.weight", 31, IndexKind.DENSE, ValueKind.FP32, np.ones(31, np.float32)),))), c.headers, None)),
    "nan": (422, lambda c: (c.lease.lease_id, c.encode_unchecked(c.lease.base_version, [
        ("ln_f.weight", np.r_[np.ones(31), np.nan].astype(np.float32))]), c.headers, None)),
    "inf": (422, lambda c: (c.lease.lease_id, c.encode_unchecked(c.lease.base_version, [
        ("ln_f.bias", np.r_[-np.inf, np.zeros(31)].astype(np.float32))]), c.headers, None)),
}


class _Ctx:
    pass


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_bad_upload_is_refused_and_changes_nothing(api, run, make_delta, encode_unchecked, case):
    # one delta merged first, so the model is not at its initial state
    warm_headers = api.register()
    warm = api.lease(warm_headers)
    api.accept(warm.lease_id, make_delta(warm, seed=9), warm_headers)
    api.drain()

    c = _Ctx()
    c.headers, c.other = api.register(), api.register()
    c.lease = api.lease(c.headers)
    c.good, c.make_delta, c.encode_unchecked = make_delta(c.lease), make_delta, encode_unchecked
    expected, build = BAD_UPLOADS[case]
    lease_id, body, headers, ctype = build(c)

    keys = ("version", "merged_deltas", "pending_deltas", "rejected_deltas", "tokens_trained", "worker_steps",
            "shards_done")
    before = {k: api.status()[k] for k in keys}
    snap_before = api.snapshot("latest")
    deltas_dir = api.coordinator.storage.run_dir(api.runtime().run_id) / "deltas"
    files_before = sorted(p.name for p in deltas_dir.iterdir())

    resp = api.upload(lease_id, body, headers, content_type=ctype or "application/octet-stream")
    assert resp.status_code == expected, resp.text
    detail = resp.json()["detail"]
    assert isinstance(detail, str) and len(detail) > 5

    assert api.drain() == 0
    assert {k: api.status()[k] for k in keys} == before
    assert api.snapshot("latest") == snap_before
    assert sorted(p.name for p in deltas_dir.iterdir()) == files_before
    # the lease is untouched: its owner can still deliver it
    ack = api.accept(c.lease.lease_id, c.good, c.headers)
    assert ack.duplicate is False and ack.will_merge_into == 2


def test_hand_built_finite_delta_is_accepted(api, run, encode_unchecked):
    """The control for the NaN/Inf cases above: the same hand-built envelope with finite values merges."""
    headers = api.register()
    lease = api.lease(headers)
    body = encode_unchecked(lease.base_version, [("ln_f.bias", np.full(32, 0.5, np.float32))])
    before = api.runtime().state.params["ln_f.bias"].clone()
    assert api.accept(lease.lease_id, body, headers).will_merge_into == 1
    assert api.drain() == 1
    after = api.runtime().state.params["ln_f.bias"]
    # share of the outer step: lr / group * value
    expected = before - run.outer.lr / run.outer.group * 0.5
    assert torch.allclose(after, expected, atol=1e-6)
    assert api.status()["merged_deltas"] == 1


def test_rejected_uploads_are_counted_against_the_worker(api, run):
    headers = api.register()
    lease = api.lease(headers)
    resp = api.upload(lease.lease_id, b"junk" * 10, headers)
    assert resp.status_code == 422
    assert "delta refused" in resp.json()["detail"]
    from coordinator.models import Worker
    with api.coordinator.sessions() as s:
        (worker,) = s.query(Worker).all()
        assert worker.deltas_rejected == 1 and worker.deltas_accepted == 0


def test_upload_over_the_size_cap_is_413(tmp_path, open_api, run_config, make_delta):
    settings = CoordinatorSettings(data_dir=tmp_path / "small", max_upload_bytes=1024)
    with open_api(settings) as api:
        api.create_run(run_config())
        headers = api.register()
        lease = api.lease(headers)
        # dense fp32 for the whole model: far over 1 KiB
        from shared.config import CompressionConfig
        big = make_delta(lease, compression=CompressionConfig(index="dense", fraction=1.0, values="fp32"))
        assert len(big) > 1024
        resp = api.upload(lease.lease_id, big, headers)
        assert resp.status_code == 413
        assert "1024" in resp.json()["detail"]

        # no Content-Length (chunked): the cap is enforced while streaming
        def chunks():
            for i in range(0, len(big), 256):
                yield big[i:i + 256]

        streamed = api.client.post(f"{API}/leases/{lease.lease_id}/delta", content=chunks(),
                                   headers={**headers, "Content-Type": "application/octet-stream"})
        assert streamed.status_code == 413, streamed.text
        assert streamed.json()["detail"]
        st = api.status()
        assert (st["pending_deltas"], st["bytes_up"], st["shards_done"]) == (0, 0, 0)
        # a small delta still fits under the cap and is accepted
        small = make_delta(lease, compression=CompressionConfig(index="random", fraction=0.01, values="int4"))
        assert len(small) <= 1024
        assert api.accept(lease.lease_id, small, headers).will_merge_into == 1


def test_unknown_run_is_404(api, run):
    headers = api.register()
    for method, path in [("get", "/runs/nope/status"), ("get", "/runs/nope/config"),
                         ("get", "/runs/nope/snapshots/latest"), ("get", "/runs/nope/snapshots/0"),
                         ("post", "/runs/nope/evaluate"), ("post", "/runs/nope/leases"),
                         ("get", "/runs/nope/shards/0")]:
        resp = api.client.request(method.upper(), f"{API}{path}", headers=headers)
        assert resp.status_code == 404, (path, resp.text)
        assert "nope" in resp.json()["detail"]
    reg = api.client.post(f"{API}/runs/nope/workers", json={})
    assert reg.status_code == 404 and "nope" in reg.json()["detail"]


def test_evaluate_now_records_once_per_version(api, run):
    first = api.client.post(f"{API}/runs/t/evaluate")
    assert first.status_code == 200
    body = first.json()
    assert body["version"] == 0
    st = api.status()
    assert len(st["eval_history"]) == 1  # version 0 was evaluated at creation
    assert body["loss"] == pytest.approx(st["eval_history"][0]["loss"])
    assert 4.0 < body["loss"] < 6.0  # about ln(256) for an untrained byte model


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_diverged_model_is_reported_not_recorded(api, run, make_delta, monkeypatch, caplog, bad):
    """A non-finite eval loss (a diverged model) is logged as an error and answered 409 to an
    operator; nothing is recorded, so status and the dashboard keep working (a NaN would not
    survive JSON)."""
    rt = api.runtime()
    monkeypatch.setattr(rt, "evaluate", lambda: bad)
    resp = api.client.post(f"{API}/runs/t/evaluate")
    assert resp.status_code == 409 and "diverged" in resp.json()["detail"]
    assert "diverged" in caplog.text
    h = api.register()
    lease = api.lease(h)
    api.accept(lease.lease_id, make_delta(lease), h)
    api.drain()
    assert api.merger.coord.evaluate(rt) is None  # the merger's own evaluation: skipped, not raised
    st = api.status()  # parses: every recorded loss is finite
    assert st["version"] == 1 and [p["version"] for p in st["eval_history"]] == [0]
    assert api.client.get(f"{API}/runs/t/dashboard").status_code == 200


def test_admin_token_guards_operator_actions(tmp_path, open_api, run_config):
    token = "operator-secret-0123456789"
    settings = CoordinatorSettings(data_dir=tmp_path / "guarded", admin_token=token)
    with open_api(settings) as api:
        missing = api.client.post(f"{API}/runs", json=run_config())
        assert missing.status_code == 401
        assert "admin token" in missing.json()["detail"]
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = api.client.post(f"{API}/runs", json=run_config(), headers={"Authorization": "Bearer " + "x" * 26})
        assert wrong.status_code == 403 and wrong.json()["detail"]
        assert api.client.get(f"{API}/runs").json() == []

        admin = {"Authorization": f"Bearer {token}"}
        api.create_run(run_config(), headers=admin)
        assert api.client.post(f"{API}/runs/t/evaluate").status_code == 401
        assert api.client.post(f"{API}/runs/t/evaluate", headers={"Authorization": "Bearer no"}).status_code == 403
        assert api.client.post(f"{API}/runs/t/evaluate", headers=admin).status_code == 200
        # worker-facing and read-only routes stay open
        assert api.status()["version"] == 0
        headers = api.register()
        assert api.lease(headers).base_version == 0


def test_the_coordinator_runs_on_the_backend_asked_for(api, db_backend):
    assert api.coordinator.engine.dialect.name == db_backend
