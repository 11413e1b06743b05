"""The coordinator's HTTP API, in process (TestClient over create_app, merging driven by the test)."""

from __future__ import annotations

import errno
import hashlib
import os
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
import torch
from sqlalchemy import update

from coordinator.api import deps
from coordinator.models import Worker
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
    assert resp.json() == {"status": "ok", "api_version": protocol.API_VERSION, "keeps_delivering_lease": True,
                           "min_api_version": protocol.MIN_API_VERSION, "worker_install": deps.worker_install(),
                           "max_upload_bytes": api.coordinator.settings.max_upload_bytes}


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
    from shared.data import load_corpus

    corpus = load_corpus(cfg["corpus"], max_bytes=cfg["corpus_max_bytes"])
    assert created["unused_tokens"] == corpus.train.size - 4 * 8192  # the tail past the last whole shard

    resp = api.client.post(f"{API}/runs", json=run_config(inner={"steps": 7}), headers=api.admin)
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
    {"inner": {"second_moment_workers": 3}},  # normalised for more workers than the group of 2
], ids=["name", "steps", "extra-field", "dense-fraction", "heads", "model-key", "shard-vs-context", "corpus",
        "shard-vs-corpus", "eval-vs-context", "second-moment-vs-group"])
def test_invalid_run_config_is_422_and_leaves_nothing_behind(api, run_config, overrides):
    resp = api.client.post(f"{API}/runs", json=run_config(**overrides), headers=api.admin)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"]
    assert api.client.get(f"{API}/runs").json() == []
    # the name is still free: a refused run leaves no half-made run behind
    assert api.create_run(run_config())["name"] == "t"


def test_config_hides_the_join_key_and_the_corpus_path(api, run_config, corpus_dir):
    api.create_run(run_config(join_key="sesame-open-1234"))
    resp = api.client.get(f"{API}/runs/t/config")
    cfg = resp.json()
    assert "join_key" not in cfg and "corpus" not in cfg
    assert str(corpus_dir) not in resp.text and "sesame" not in resp.text
    assert cfg["inner"]["steps"] == 3


def test_public_status_counts_flagged_workers_but_never_says_who_or_why(api, run):
    reason = "4 of its last 4 deltas rejected; last: norm 9.1 is 40.0x the median"
    for name, standing in (("ok-worker", "ok"), ("slow-poisoner", "throttled"), ("poisoner", "banned")):
        api.register(name=name)
        with api.db() as s:
            s.execute(update(Worker).where(Worker.name == name).values(
                standing=standing, standing_reason=reason if standing != "ok" else None))
            s.commit()
    resp = api.client.get(f"{API}/runs/t/status")
    assert resp.status_code == 200
    st = resp.json()
    assert (st["workers_throttled"], st["workers_banned"], st["workers_total"]) == (1, 1, 3)
    assert "workers_flagged" not in st and "poisoner" not in resp.text and "median" not in resp.text
    # the operator's route still has who and why
    listed = {w["name"]: w for w in api.operator("get", f"{API}/runs/t/workers").json()}
    assert listed["poisoner"]["standing"] == "banned" and listed["poisoner"]["standing_reason"] == reason


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
    assert lease.model.to_dict() == run.model.to_dict()
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
    storage = api.coordinator.storage
    deltas_dir = storage.deltas(api.runtime().run_id)
    files_before = storage.list(deltas_dir)

    resp = api.upload(lease_id, body, headers, content_type=ctype or "application/octet-stream")
    assert resp.status_code == expected, resp.text
    detail = resp.json()["detail"]
    assert isinstance(detail, str) and len(detail) > 5

    assert api.drain() == 0
    assert {k: api.status()[k] for k in keys} == before
    assert api.snapshot("latest") == snap_before
    assert storage.list(deltas_dir) == files_before
    # the lease is untouched: its owner can still deliver it
    ack = api.accept(c.lease.lease_id, c.good, c.headers)
    assert ack.duplicate is False and ack.will_merge_into == 2


def test_hand_built_finite_delta_is_accepted(api, run, encode_unchecked):
    """The control for the NaN/Inf cases above: the same hand-built envelope with finite values merges
    (every tensor: a round's delta carries the whole model, issue 18; the others a little noise)."""
    from tests.conftest import schema_of

    headers = api.register()
    lease = api.lease(headers)
    rng = np.random.default_rng(0)
    VALUE = 0.005  # within what a round of AdamW steps moves one element by (the merge screen's bound)
    body = encode_unchecked(lease.base_version, [
        (n, np.full(32, VALUE, np.float32) if n == "ln_f.bias" else rng.normal(0, 1e-4, shape).astype(np.float32))
        for n, shape in schema_of(lease).items()])
    before = api.runtime().state.params["ln_f.bias"].clone()
    assert api.accept(lease.lease_id, body, headers).will_merge_into == 1
    assert api.drain() == 1
    after = api.runtime().state.params["ln_f.bias"]
    # at most its share of the outer step, lr / group * value (robust merging may weigh a new
    # worker's first deltas down), the same for every element
    moved = before - after
    assert torch.allclose(moved, moved[0].expand_as(moved), atol=1e-9)
    assert 0 < moved[0] <= run.outer.lr / run.outer.group * VALUE + 1e-9
    assert api.status()["merged_deltas"] == 1


def test_rejected_uploads_are_counted_against_the_worker(api, run):
    headers = api.register()
    lease = api.lease(headers)
    resp = api.upload(lease.lease_id, b"junk" * 10, headers)
    assert resp.status_code == 422
    assert "delta refused" in resp.json()["detail"]
    from coordinator.models import Worker
    with api.db() as s:
        (worker,) = s.query(Worker).all()
        assert worker.deltas_rejected == 1 and worker.deltas_accepted == 0


def test_upload_over_the_size_cap_is_413(tmp_path, open_api, run_config, make_delta):
    settings = CoordinatorSettings(data_dir=tmp_path / "small", max_upload_bytes=2048)
    with open_api(settings) as api:
        # the run's deltas are small (1% random, int4; at most 1,045 bytes): they fit under the cap, so
        # run create takes the run
        api.create_run(run_config(compression={"index": "random", "fraction": 0.01, "values": "int4"}))
        headers = api.register()
        lease = api.lease(headers)
        # dense fp32 for the whole model: far over 2 KiB
        from shared.config import CompressionConfig
        big = make_delta(lease, compression=CompressionConfig(index="dense", fraction=1.0, values="fp32"))
        assert len(big) > 2048
        resp = api.upload(lease.lease_id, big, headers)
        assert resp.status_code == 413
        assert "2048" in resp.json()["detail"]

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
        small = make_delta(lease)
        assert len(small) <= 1024
        assert api.accept(lease.lease_id, small, headers).will_merge_into == 1


def test_unknown_run_is_404(api, run):
    headers = api.register()
    for method, path in [("get", "/runs/nope/status"), ("get", "/runs/nope/config"),
                         ("get", "/runs/nope/snapshots/latest"), ("get", "/runs/nope/snapshots/0"),
                         ("post", "/runs/nope/evaluate"), ("post", "/runs/nope/leases"),
                         ("get", "/runs/nope/shards/0")]:
        resp = api.client.request(method.upper(), f"{API}{path}",
                                  headers=api.admin if path.endswith("/evaluate") else headers)
        assert resp.status_code == 404, (path, resp.text)
        assert "nope" in resp.json()["detail"]
    reg = api.client.post(f"{API}/runs/nope/workers", json={})
    assert reg.status_code == 404 and "nope" in reg.json()["detail"]


def test_evaluate_now_records_once_per_version(api, run):
    first = api.operator("post", f"{API}/runs/t/evaluate")
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
    resp = api.operator("post", f"{API}/runs/t/evaluate")
    assert resp.status_code == 409 and "diverged" in resp.json()["detail"]
    assert "diverged" in caplog.text
    h = api.register()
    lease = api.lease(h)
    api.accept(lease.lease_id, make_delta(lease), h)
    api.drain()
    assert api.merger.coord.reports.evaluate(rt) is None  # the merger's own evaluation: skipped, not raised
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
    assert api.coordinator.db.engine.dialect.name == db_backend


# -- a full disk: 503 + Retry-After, nothing acknowledged, the same request succeeds once there is room --

def _no_space(err: int = 28):
    def write(*_args, **_kwargs):
        raise OSError(err, os.strerror(err))
    return write


def _acknowledged(api) -> tuple[int, int, int, int]:
    """(model version, deltas recorded, leases delivered, the workers' deltas_rejected + refusals)."""
    from sqlalchemy import func, select

    from coordinator.models import DeltaRecord, Lease, Refusal, Worker

    with api.db() as s:
        return (api.status()["version"], s.scalar(select(func.count()).select_from(DeltaRecord)),
                s.scalar(select(func.count()).select_from(Lease).where(Lease.state == "delivered")),
                s.scalar(select(func.sum(Worker.deltas_rejected))) + s.scalar(
                    select(func.count()).select_from(Refusal)))


def _assert_disk_full(resp) -> None:
    assert resp.status_code == 503, (resp.status_code, resp.text)
    assert resp.headers["Retry-After"] == "30"
    assert resp.json() == {"detail": "the coordinator's disk is full; retry later"}


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_an_upload_on_a_full_disk_is_503_and_acknowledges_nothing(api, run, make_delta, monkeypatch, err):
    headers = api.register()
    lease = api.lease(headers)
    body = make_delta(lease, scale=1e-4)
    with monkeypatch.context() as m:  # making the delta's bytes durable fails: no space (where a
        m.setattr(os, "fsync", _no_space(err))  # full disk shows itself, after delayed allocation)
        _assert_disk_full(api.upload(lease.lease_id, body, headers))
        assert _acknowledged(api) == (0, 0, 0, 0)  # nothing queued, and not held against the worker
        assert api.drain() == 0
    # room again: the same upload is acknowledged, as the first (not a duplicate), and merges once
    ack = api.accept(lease.lease_id, body, headers)
    assert (ack.will_merge_into, ack.duplicate) == (1, False)
    assert api.drain() == 1
    assert _acknowledged(api) == (1, 1, 1, 0)


def test_an_upload_that_finds_the_database_full_is_503(api, run, make_delta, database_full):
    headers = api.register()
    lease = api.lease(headers)
    body = make_delta(lease, scale=1e-4)
    with database_full(api.coordinator.db.engine):
        _assert_disk_full(api.upload(lease.lease_id, body, headers))
    assert _acknowledged(api) == (0, 0, 0, 0)
    assert api.accept(lease.lease_id, body, headers).will_merge_into == 1
    assert api.drain() == 1
    assert _acknowledged(api) == (1, 1, 1, 0)


def test_a_lease_on_a_full_database_is_503_and_takes_no_shard(api, run, database_full):
    from sqlalchemy import func, select

    from coordinator.models import Lease

    headers = api.register()
    with database_full(api.coordinator.db.engine):
        _assert_disk_full(api.client.post(f"{API}/runs/t/leases", headers=headers))
    with api.db() as s:
        assert s.scalar(select(func.count()).select_from(Lease)) == 0
    assert api.lease(headers).base_version == 0


def test_other_os_errors_are_not_taken_for_a_full_disk(api, run, make_delta, monkeypatch):
    """Only ENOSPC and EDQUOT become 503s; an I/O error stays a server error (500)."""
    headers = api.register()
    lease = api.lease(headers)
    monkeypatch.setattr(os, "fsync", _no_space(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):  # the TestClient re-raises a 500's cause
        api.upload(lease.lease_id, make_delta(lease, scale=1e-4), headers)


# -- issue 18: credit for nothing, double merges -----------------------------------------------------


def _worker(api, worker_id: int) -> Worker:
    with api.db() as s:
        return s.get(Worker, worker_id)


def _refusals(api, worker_id: int) -> list[str]:
    from coordinator.models import Refusal

    with api.db() as s:
        return [r.reason for r in s.query(Refusal).filter_by(worker_id=worker_id).all()]


def _model_state(api) -> tuple[int, bytes]:
    return api.status()["version"], api.snapshot("latest")


def test_a_one_value_delta_earns_nothing(api, run):
    """Issue 18: a 71-byte delta carrying one value of 1e-7 earned a whole round's credit (819,200)
    and first place. A round's delta must be what the lease's compression makes of the whole model:
    refused 422 with the reason, counted against the worker, no version, no tokens, no credit."""
    headers = api.register(name="cheat")
    lease = api.lease(headers)
    wid = api.coordinator.workers.authenticate(headers["Authorization"][7:]).id
    body = codec.encode(Delta(lease.base_version, (
        Entry("ln_f.bias", 32, IndexKind.PACKED, ValueKind.FP32, np.array([1e-7], np.float32),
              np.array([0], np.int64)),)))
    assert len(body) < 100
    before = _model_state(api)
    resp = api.upload(lease.lease_id, body, headers)
    assert resp.status_code == 422, resp.text
    assert "every tensor" in resp.json()["detail"]
    assert api.drain() == 0
    assert _model_state(api) == before
    w = _worker(api, wid)
    assert (w.credit, w.tokens_trained, w.deltas_accepted, w.deltas_rejected) == (0.0, 0, 0, 1)
    assert len(_refusals(api, wid)) == 1
    assert api.status()["tokens_trained"] == 0


def _tampered(lease: protocol.Lease, body: bytes, how: str) -> bytes:
    """The honest delta `body` with one thing changed the way a cheat would."""
    from tests.conftest import schema_of

    d = codec.decode(body, schema=schema_of(lease))
    first, rest = d.entries[0], d.entries[1:]
    if how == "drop-tensor":
        return codec.encode(Delta(d.base_version, rest))
    if how == "fewer-values":
        keep = max(1, first.k - 1) if first.k > 1 else 1
        if first.index_kind == IndexKind.DENSE:
            return codec.encode(Delta(d.base_version, (Entry(
                first.name, first.numel, IndexKind.PACKED, first.value_kind, first.values[:keep],
                np.arange(keep, dtype=np.int64)),) + rest))
        if first.index_kind == IndexKind.SEEDED:  # its own choice of fewer indices
            idx = np.sort(np.asarray(first.indices))[:keep]
            return codec.encode(Delta(d.base_version, (Entry(
                first.name, first.numel, IndexKind.PACKED, first.value_kind, first.values[:keep], idx),) + rest))
        return codec.encode(Delta(d.base_version, (Entry(
            first.name, first.numel, first.index_kind, first.value_kind, first.values[:keep],
            first.indices[:keep]),) + rest))
    if how == "other-seed":
        return codec.encode(Delta(d.base_version, (Entry(
            first.name, first.numel, first.index_kind, first.value_kind, first.values, None,
            (first.seed + 1) % 2**64),) + rest))
    raise ValueError(how)


@pytest.mark.parametrize("compression, cheats", [
    ({"index": "dense"}, ("drop-tensor", "fewer-values")),
    ({"index": "topk", "fraction": 0.25}, ("drop-tensor", "fewer-values")),
    ({"index": "random", "fraction": 0.25}, ("drop-tensor", "fewer-values", "other-seed")),
])
def test_a_delta_must_be_what_the_leases_compression_makes(api, run_config, make_delta, compression, cheats):
    """Every tensor once, k_for(numel, fraction) values each (all for dense), random ones at the
    indices the lease's seed draws: honest deltas pass, each cheat is refused (422, counted) and
    changes nothing."""
    api.create_run(run_config(compression=compression))
    for how in cheats:
        headers = api.register()
        lease = api.lease(headers)
        wid = api.coordinator.workers.authenticate(headers["Authorization"][7:]).id
        before = _model_state(api)
        resp = api.upload(lease.lease_id, _tampered(lease, make_delta(lease, scale=1e-3), how), headers)
        assert resp.status_code == 422, (how, resp.text)
        assert "delta refused" in resp.json()["detail"]
        assert api.drain() == 0 and _model_state(api) == before
        assert len(_refusals(api, wid)) == 1 and _worker(api, wid).deltas_accepted == 0
        # the honest delta of the same lease still goes through
        assert api.accept(lease.lease_id, make_delta(lease, scale=1e-3), headers).duplicate is False
        assert api.drain() == 1
    assert api.status()["version"] == len(cheats)


def test_copied_delta_bytes_are_merged_once(api, run, make_delta):
    """Issue 18: another worker's delta bytes posted on a second lease with the same base were
    merged a second time. Now 409 with the reason, counted against the copier; the copier's lease
    stays live for a delta of its own; the original's retry still gets its 202."""
    honest, copier = api.register(name="honest"), api.register(name="copier")
    a, b = api.lease(honest), api.lease(copier)
    assert a.base_version == b.base_version
    body = make_delta(a, scale=1e-3)
    first = api.accept(a.lease_id, body, honest)
    before = api.status()
    resp = api.upload(b.lease_id, body, copier)
    assert resp.status_code == 409, resp.text
    assert f"lease {a.lease_id}" in resp.json()["detail"] and "identical" in resp.json()["detail"]
    after = api.status()
    assert (after["version"], after["pending_deltas"], after["tokens_trained"]) == \
        (before["version"], before["pending_deltas"], before["tokens_trained"])
    cid = api.coordinator.workers.authenticate(copier["Authorization"][7:]).id
    assert len(_refusals(api, cid)) == 1 and _worker(api, cid).deltas_accepted == 0
    retry = api.accept(a.lease_id, body, honest)  # the original's retry: its original answer
    assert (retry.duplicate, retry.will_merge_into, retry.delta_id) == (True, first.will_merge_into, first.delta_id)
    assert api.drain() == 1
    assert api.status()["merged_deltas"] == 1
    own = api.accept(b.lease_id, make_delta(b, scale=1e-3), copier)  # its own work is welcome
    assert own.will_merge_into == 2 and api.drain() == 1
    assert _worker(api, cid).deltas_accepted == 1


def test_a_full_disk_is_told_by_the_error_not_by_what_a_client_sent():
    """ENOSPC/EDQUOT, SQLite's SQLITE_FULL and PostgreSQL's 53100 mean a full disk, wrapped or not; a
    statement whose parameters (a worker's name) happen to say "database or disk is full" does not."""
    import sqlite3

    import psycopg
    from sqlalchemy.exc import IntegrityError, OperationalError

    from coordinator.errors import is_disk_full

    words = "database or disk is full"
    assert is_disk_full(OSError(errno.ENOSPC, "full")) and is_disk_full(OSError(errno.EDQUOT, "quota"))
    assert is_disk_full(OperationalError("COMMIT", None, sqlite3.OperationalError(words)))
    assert is_disk_full(OperationalError("INSERT", None, psycopg.errors.DiskFull("could not extend file")))
    try:
        raise RuntimeError("while writing") from OSError(errno.ENOSPC, "full")
    except RuntimeError as exc:
        assert is_disk_full(exc)
    assert not is_disk_full(OSError(errno.EIO, "I/O error"))
    assert not is_disk_full(IntegrityError(f"INSERT ({words!r})", {"name": words},
                                           sqlite3.IntegrityError("UNIQUE constraint failed: workers.name")))
