"""Sparse exchanges (POST /leases/{id}/exchange) and the sparta round end, in process.

One coordinator serves the whole module (a refusal changes nothing, so the cases can share it):
run "s" uses sparta, "sd" sparta+diloco, "d" diloco. Shards of 1024 tokens leave plenty of leases.
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import zstandard
from sqlalchemy import func, select, update

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.models import Exchange, Lease, Refusal, Run, Worker, utcnow
from coordinator.settings import CoordinatorSettings
from shared import codec, protocol
from shared.algorithms.compress import tensor_seed
from shared.algorithms.exchange_screen import NEW_TOKEN_SHARE
from shared.algorithms.sparta import apply_correction, exchange_seed, select as sparta_select
from shared.codec import Delta, Entry, IndexKind, ValueKind
from shared.config import SpartaConfig
from shared.snapshot import decode_snapshot
from tests.conftest import BASE_URL, TINY_MODEL, Api, fresh_database

API = protocol.API_PREFIX
STEPS, EVERY = 4, 2  # exchanges follow steps 2 and 4
SPARTA = {"p": 0.1, "every": EVERY, "alpha": 0.5, "values": "fp16"}


def _config(name: str, algorithm: str, corpus_dir) -> dict:
    return {"name": name, "algorithm": algorithm, "corpus": str(corpus_dir), "corpus_max_bytes": 1 << 18,
            "shard_tokens": 1024, "eval_tokens": 4096, "model": dict(TINY_MODEL),
            "inner": {"steps": STEPS, "batch_size": 2}, "outer": {"group": 2}, "sparta": SPARTA}


OWN_DB_BACKENDS = True  # the module-scoped app below runs once per backend


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def api(request, tmp_path_factory, corpus_dir):
    with fresh_database(request.param) as db_url:
        # the module's many workers all register from one address (testclient): no registration limit
        settings = CoordinatorSettings(data_dir=tmp_path_factory.mktemp("exchange") / "coordinator",
                                       register_rate=0, database_url=db_url, corpus_dirs=[corpus_dir])
        with TestClient(create_app(settings, start_merger=False), base_url=BASE_URL) as client:
            a = Api(client)
            for name, algorithm in (("s", "sparta"), ("sd", "sparta+diloco"), ("d", "diloco")):
                a.create_run(_config(name, algorithm, corpus_dir))
            yield a


def post_exchange(api: Api, lease_id: int, step, body: bytes, headers: dict, content_type="application/octet-stream"):
    params = {} if step is None else {"step": step}
    return api.client.post(f"{API}/leases/{lease_id}/exchange", params=params, content=body,
                           headers={**headers, "Content-Type": content_type})


def worker_values(api: Api, run: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A worker's weights: the centre plus some local drift (as far as a few steps of lr 2e-3 go: the
    coordinator clips, and far beyond refuses, values further from the centre than the lease's AdamW
    steps can move them)."""
    g = torch.Generator().manual_seed(seed)
    return {n: t.clone() + 1e-3 * torch.randn(t.shape, generator=g) for n, t in api.runtime(run).state.params.items()}


def sent_for(lease: protocol.Lease, step: int, params, *, p: float = SPARTA["p"], seed: int | None = None,
             base_version: int | None = None) -> Delta:
    return sparta_select(params, p=p, seed=exchange_seed(lease.seed, step) if seed is None else seed,
                         values=SPARTA["values"],
                         base_version=lease.base_version if base_version is None else base_version)


def observe(api: Api) -> dict:
    """Everything an exchange may change."""
    api.coordinator.traffic.flush()  # the byte counts it holds in memory (coordinator/traffic.py)
    with api.db() as s:
        runs = {r.name: (r.bytes_up, r.bytes_down_model, r.bytes_down_data, r.version, r.tokens_trained)
                for r in s.scalars(select(Run))}
        workers = {w.id: (w.bytes_up, w.bytes_down) for w in s.scalars(select(Worker))}
        leases = {le.id: le.state for le in s.scalars(select(Lease))}
        n_exchanges = s.scalar(select(func.count()).select_from(Exchange))
    params = {name: {n: t.clone() for n, t in api.runtime(name).state.params.items()} for name in ("s", "sd", "d")}
    return {"runs": runs, "workers": workers, "leases": leases, "exchanges": n_exchanges, "params": params}


def assert_same(a: dict, b: dict) -> None:
    for key in ("runs", "workers", "leases", "exchanges"):
        assert a[key] == b[key], key
    for run, params in a["params"].items():
        for n, t in params.items():
            assert torch.equal(t, b["params"][run][n]), (run, n)


def test_lease_says_the_algorithm(api):
    for run, algorithm in (("s", "sparta"), ("sd", "sparta+diloco"), ("d", "diloco")):
        lease = api.lease(api.register(run), run=run)
        assert lease.algorithm == algorithm
        assert lease.sparta == SpartaConfig(**SPARTA)


def test_openapi_lists_the_exchange(api):
    paths = api.client.get("/openapi.json").json()["paths"]
    op = paths[f"{API}/leases/{{lease_id}}/exchange"]["post"]
    assert "application/octet-stream" in op["requestBody"]["content"]
    assert any(p["name"] == "step" for p in op["parameters"])


@pytest.mark.parametrize("run", ["s", "sd"])
def test_exchange_mixes_the_selected_coordinates_and_answers_the_correction(api, run):
    headers = api.register(run)
    lease = api.lease(headers, run=run)
    rt = api.runtime(run)
    w = worker_values(api, run)
    before = observe(api)
    c0 = {n: t.clone() for n, t in rt.state.params.items()}
    body = codec.encode(sent_for(lease, EVERY, w))

    resp = post_exchange(api, lease.lease_id, EVERY, body, headers)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/octet-stream"
    assert resp.headers[protocol.H_SHA256] == hashlib.sha256(resp.content).hexdigest()
    correction = codec.decode(resp.content, schema=rt.schema)
    seen = codec.decode(body, schema=rt.schema)  # what the coordinator read (fp16 values)
    assert correction.base_version == lease.base_version
    assert [e.name for e in correction.entries] == list(rt.schema)
    for e, d in zip(seen.entries, correction.entries):
        assert d.index_kind == IndexKind.SEEDED and d.value_kind == ValueKind.FP16 and d.seed == e.seed
        assert d.seed == tensor_seed(exchange_seed(lease.seed, EVERY), e.name)
        idx = torch.from_numpy(e.indices)
        old, new = c0[e.name].reshape(-1), rt.state.params[e.name].reshape(-1)
        want_d = 0.5 * (torch.from_numpy(e.values) - old[idx])
        # the centre moved by d at exactly the exchanged indices, nowhere else: within the lease's reach and
        # not up the loss, so as sent, at the share of a token that has delivered no round yet
        # (exchange_screen.py)
        torch.testing.assert_close(new[idx], old[idx] + NEW_TOKEN_SHARE * want_d)
        mask = torch.ones(old.numel(), dtype=torch.bool)
        mask[idx] = False
        assert torch.equal(new[mask], old[mask])
        # the answer is d (as fp16)
        torch.testing.assert_close(torch.from_numpy(d.values), want_d, atol=2e-3, rtol=1e-3)
    # the worker subtracts d: it lands on the pair's average (alpha = 0.5), 
    apply_correction(w, correction)
    for e in seen.entries:
        idx = torch.from_numpy(e.indices)
        midpoint = 0.5 * (torch.from_numpy(e.values) + c0[e.name].reshape(-1)[idx])
        torch.testing.assert_close(w[e.name].reshape(-1)[idx], midpoint, atol=2e-3, rtol=1e-3)

    after = observe(api)
    assert after["exchanges"] == before["exchanges"] + 1
    up, down_model, down_data, version, tokens = before["runs"][run]
    assert after["runs"][run] == (up + len(body), down_model + len(resp.content), down_data, version, tokens)
    with api.db() as s:
        row = s.scalar(select(Exchange).where(Exchange.lease_id == lease.lease_id))
        assert (row.step, row.bytes_in, row.bytes_out) == (EVERY, len(body), len(resp.content))
        wid = row.worker_id
    assert after["workers"][wid] == (before["workers"][wid][0] + len(body),
                                     before["workers"][wid][1] + len(resp.content))
    # the next exchange step of the same lease works too; the version did not move
    resp = post_exchange(api, lease.lease_id, 2 * EVERY, codec.encode(sent_for(lease, 2 * EVERY, w)), headers)
    assert resp.status_code == 200, resp.text
    assert api.status(run)["exchanges"] == 2 and api.status(run)["version"] == version


def _other_run_lease(api, c):
    headers = api.register("d")
    return api.lease(headers, run="d").lease_id, EVERY, c.good, headers


def _delivered(api, c):
    api.accept(c.lease.lease_id, codec.encode(Delta(c.lease.base_version, ())), c.headers)
    return c.lease.lease_id, EVERY, c.good, c.headers


def _abandoned(api, c):
    api.lease(c.headers, run="s")  # taking a new lease gives up the old one
    return c.lease.lease_id, EVERY, c.good, c.headers


def _set_lease(api, lease_id: int, **values) -> None:
    with api.db() as s:
        s.execute(update(Lease).where(Lease.id == lease_id).values(**values))
        s.commit()


def _expired(api, c):
    _set_lease(api, c.lease.lease_id, state="expired")
    return c.lease.lease_id, EVERY, c.good, c.headers


def _past_deadline(api, c):
    _set_lease(api, c.lease.lease_id, deadline=utcnow() - timedelta(seconds=1))
    return c.lease.lease_id, EVERY, c.good, c.headers


def _twice(api, c):
    assert post_exchange(api, c.lease.lease_id, EVERY, c.good, c.headers).status_code == 200
    return c.lease.lease_id, EVERY, codec.encode(sent_for(c.lease, EVERY, worker_values(api, "s", 5))), c.headers


def _with_entries(c, entries) -> bytes:
    return codec.encode(Delta(c.lease.base_version, tuple(entries)))


def _packed(c):
    """The right values, but with explicit (packed) indices instead of the seed."""
    return _with_entries(c, [Entry(e.name, e.numel, IndexKind.PACKED, e.value_kind, e.values, e.indices)
                             for e in c.sent.entries])


def _own_seed(c):
    """SEEDED, but with a seed the worker chose."""
    return codec.encode(sent_for(c.lease, EVERY, c.w, seed=12345))


def _other_step_seed(c):
    return codec.encode(sent_for(c.lease, 2 * EVERY, c.w))


def _dense(c):
    return _with_entries(c, [Entry(n, t.numel(), IndexKind.DENSE, ValueKind.FP16, t.reshape(-1).numpy())
                             for n, t in c.w.items()])


REFUSALS = {
    # id: (status, words in the detail, builder(api, ctx) -> (lease_id, step, body, headers)[, content type])
    "no-token": (401, "token", lambda a, c: (c.lease.lease_id, EVERY, c.good, {})),
    "no-such-lease": (404, "no lease", lambda a, c: (987654, EVERY, c.good, c.headers)),
    "other-workers-lease": (403, "another worker", lambda a, c: (c.lease.lease_id, EVERY, c.good, c.other)),
    "diloco-run": (409, "no exchanges", _other_run_lease),
    "delivered": (410, "delivered", _delivered),
    "abandoned": (410, "abandoned", _abandoned),
    "expired": (410, "expired", _expired),
    "past-deadline": (410, "expired", _past_deadline),
    "step-0": (422, "step 0", lambda a, c: (c.lease.lease_id, 0, c.good, c.headers)),
    "step-negative": (422, "step -2", lambda a, c: (c.lease.lease_id, -2, c.good, c.headers)),
    "step-not-multiple": (422, "step 3", lambda a, c: (c.lease.lease_id, 3, c.good, c.headers)),
    "step-past-round": (422, "step 6", lambda a, c: (c.lease.lease_id, STEPS + EVERY, c.good, c.headers)),
    "step-missing": (422, "step", lambda a, c: (c.lease.lease_id, None, c.good, c.headers)),
    "twice": (409, "already exchanged", _twice),
    "garbage": (422, "refused", lambda a, c: (c.lease.lease_id, EVERY, b"not an exchange at all", c.headers)),
    "empty-body": (422, "refused", lambda a, c: (c.lease.lease_id, EVERY, b"", c.headers)),
    "truncated": (422, "refused", lambda a, c: (c.lease.lease_id, EVERY, c.good[:-5], c.headers)),
    "missing-tensor": (422, "missing", lambda a, c: (c.lease.lease_id, EVERY,
                                                     _with_entries(c, c.sent.entries[1:]), c.headers)),
    "no-entries": (422, "missing", lambda a, c: (c.lease.lease_id, EVERY, _with_entries(c, []), c.headers)),
    "packed-indices": (422, "seeded indices", lambda a, c: (c.lease.lease_id, EVERY, _packed(c), c.headers)),
    "dense": (422, "seeded indices", lambda a, c: (c.lease.lease_id, EVERY, _dense(c), c.headers)),
    "own-seed": (422, "seeded indices", lambda a, c: (c.lease.lease_id, EVERY, _own_seed(c), c.headers)),
    "other-steps-seed": (422, "seeded indices", lambda a, c: (c.lease.lease_id, EVERY, _other_step_seed(c),
                                                              c.headers)),
    "wrong-k": (422, "values", lambda a, c: (c.lease.lease_id, EVERY,
                                             codec.encode(sent_for(c.lease, EVERY, c.w, p=0.2)), c.headers)),
    "wrong-base-version": (422, "base version", lambda a, c: (
        c.lease.lease_id, EVERY, codec.encode(sent_for(c.lease, EVERY, c.w, base_version=c.lease.base_version + 1)),
        c.headers)),
    "content-type": (400, "octet-stream", lambda a, c: (c.lease.lease_id, EVERY, c.good, c.headers, "text/plain")),
}


# A body that does not even decode is the worker's own doing (issue 18): counted toward its standing
# (a Refusal row) and its bytes as its traffic; the model and everything else stay as they were.
COUNTED = {"garbage", "empty-body", "truncated"}


def refusals_of(api: Api, headers: dict) -> list[tuple[str, str]]:
    """(kind, reason) of the Refusal rows that count against the worker of `headers`."""
    worker = api.coordinator.workers.authenticate(headers["Authorization"].split()[1])
    with api.db() as s:
        return [(r.kind, r.reason) for r in s.scalars(select(Refusal).where(Refusal.worker_id == worker.id))]


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_exchange_changes_nothing(api, case):
    c = SimpleNamespace()
    c.headers, c.other = api.register("s"), api.register("s")
    c.lease = api.lease(c.headers, run="s")
    c.w = worker_values(api, "s", seed=1)
    c.sent = sent_for(c.lease, EVERY, c.w)
    c.good = codec.encode(c.sent)
    status, words, build = REFUSALS[case]
    lease_id, step, body, headers, *ctype = build(api, c)
    before = observe(api)

    resp = post_exchange(api, lease_id, step, body, headers, *ctype)
    assert resp.status_code == status, resp.text
    detail = resp.json()["detail"]
    assert isinstance(detail, str) and words in detail, detail  # validation answers too (api/errors.py)
    if case in COUNTED:  # before: refused uncounted, so malformed bodies cost their sender nothing
        assert [kind for kind, _ in refusals_of(api, headers)] == ["exchange"]
        wid = api.coordinator.workers.authenticate(headers["Authorization"].split()[1]).id
        up, down = before["workers"][wid]
        before["workers"][wid] = (up + len(body), down)
        r = before["runs"]["s"]
        before["runs"]["s"] = (r[0] + len(body), *r[1:])
    assert_same(before, observe(api))

    # the refusal did not use up the exchange: the owner of a live lease can still make it
    with api.db() as s:
        live = s.get(Lease, c.lease.lease_id).state == "active" and case not in ("past-deadline", "twice")
    if live:
        assert post_exchange(api, c.lease.lease_id, EVERY, c.good, c.headers).status_code == 200


def test_exchange_over_the_size_cap_is_413(api, monkeypatch):
    headers = api.register("s")
    lease = api.lease(headers, run="s")
    body = codec.encode(sent_for(lease, EVERY, worker_values(api, "s")))
    assert len(body) > 1024
    monkeypatch.setattr(api.coordinator.settings, "max_upload_bytes", 1024)
    before = observe(api)
    resp = post_exchange(api, lease.lease_id, EVERY, body, headers)
    assert resp.status_code == 413 and "1024" in resp.json()["detail"]
    assert_same(before, observe(api))


def test_a_sparta_round_ends_with_an_empty_delta(api):
    """An empty delta closes the lease: a no-op merge that still makes a version and a snapshot,
    counting the round's tokens. The version's snapshot carries the exchanges made before it."""
    api.drain()  # what earlier tests queued
    headers = api.register("s")
    lease = api.lease(headers, run="s")
    assert post_exchange(api, lease.lease_id, EVERY, codec.encode(sent_for(lease, EVERY, worker_values(api, "s"))),
                         headers).status_code == 200
    rt = api.runtime("s")
    st = api.status("s")
    centre = {n: t.clone() for n, t in rt.state.params.items()}
    momentum = {n: t.clone() for n, t in rt.state.momentum.items()}
    in_group = rt.state.in_group

    # a pseudo-gradient is not what a sparta round sends
    full = codec.encode(Delta(lease.base_version, (
        Entry("ln_f.bias", 32, IndexKind.DENSE, ValueKind.FP32, np.full(32, 0.1, np.float32)),)))
    refused = api.upload(lease.lease_id, full, headers)
    assert refused.status_code == 422 and "empty delta" in refused.json()["detail"]

    ack = api.accept(lease.lease_id, codec.encode(Delta(lease.base_version, ())), headers)
    assert ack.will_merge_into == st["version"] + 1
    api.drain()
    after = api.status("s")
    assert after["version"] == st["version"] + 1
    assert after["merged_deltas"] == st["merged_deltas"] + 1 and after["rejected_deltas"] == st["rejected_deltas"]
    # the round's tokens in the share of its exchanges it made: one of STEPS // EVERY = 2 (issue 18)
    assert after["tokens_trained"] == st["tokens_trained"] + STEPS * 2 * TINY_MODEL["context"] // 2
    assert all(torch.equal(centre[n], t) for n, t in rt.state.params.items())
    assert all(torch.equal(momentum[n], t) for n, t in rt.state.momentum.items())
    assert rt.state.in_group == in_group
    snap, _ = decode_snapshot(api.snapshot(after["version"], run="s"), schema=rt.schema)
    assert all(torch.equal(snap[n], centre[n]) for n in centre)


def test_sparta_diloco_rounds_end_with_a_pseudo_gradient(api, make_delta):
    headers = api.register("sd")
    lease = api.lease(headers, run="sd")
    assert post_exchange(api, lease.lease_id, EVERY, codec.encode(sent_for(lease, EVERY, worker_values(api, "sd"))),
                         headers).status_code == 200
    rt = api.runtime("sd")
    centre = {n: t.clone() for n, t in rt.state.params.items()}
    api.accept(lease.lease_id, make_delta(lease), headers)
    api.drain()
    assert any(not torch.equal(centre[n], t) for n, t in rt.state.params.items())  # the outer step moved it
    assert api.status("sd")["merged_deltas"] >= 1


def test_an_empty_delta_on_a_diloco_run_is_refused_and_changes_nothing(api, make_delta):
    # Otherwise a worker could claim a round's tokens (and credit) for no work at all.
    headers = api.register("d")
    first = api.lease(headers, run="d")
    api.accept(first.lease_id, make_delta(first), headers)
    api.drain()
    rt = api.runtime("d")
    state = {k: t.clone() for k, t in rt.state.tensors().items()}
    before = api.status("d")
    lease = api.lease(headers, run="d")
    refused = api.upload(lease.lease_id, codec.encode(Delta(lease.base_version, ())), headers)
    assert refused.status_code == 422 and "empty delta" in refused.json()["detail"]
    api.drain()
    after = api.status("d")
    assert after["version"] == before["version"] and after["tokens_trained"] == before["tokens_trained"]
    assert all(torch.equal(state[k], t) for k, t in rt.state.tensors().items())


def test_a_sparta_rounds_credit_follows_the_exchanges_it_made(api):
    """Issue 18: in a sparta run an empty end-of-round delta earned a whole round's tokens and
    credit, exchanges or not. Now it counts the round's tokens times exchanges made / expected:
    none made, no tokens and no credit (the delta is still taken: it closes the lease)."""
    api.drain()
    tokens = STEPS * 2 * TINY_MODEL["context"]  # the run's round: steps x batch x context
    made = {}
    for n_exchanges in (0, 1, 2):
        headers = api.register("s", name=f"sparta-{n_exchanges}")
        lease = api.lease(headers, run="s")
        for i in range(n_exchanges):
            step = EVERY * (i + 1)
            body = codec.encode(sent_for(lease, step, worker_values(api, "s", seed=i)))
            assert post_exchange(api, lease.lease_id, step, body, headers).status_code == 200
        before = api.status("s")
        ack = api.accept(lease.lease_id, codec.encode(Delta(lease.base_version, ())), headers)
        assert not ack.duplicate
        assert api.drain() == 1
        after = api.status("s")
        assert after["version"] == before["version"] + 1
        made[n_exchanges] = after["tokens_trained"] - before["tokens_trained"]
    assert made == {0: 0, 1: tokens // 2, 2: tokens}
    with api.db() as s:
        credit = {w.name: (w.credit, w.tokens_trained) for w in s.scalars(
            select(Worker).where(Worker.name.like("sparta-%")))}
    assert credit["sparta-0"] == (0.0, 0)
    assert credit["sparta-1"][1] == tokens // 2 and tokens // 2 <= credit["sparta-1"][0] <= 4 * tokens // 2
    assert credit["sparta-2"][1] == tokens and tokens <= credit["sparta-2"][0] <= 4 * tokens


def test_a_zstd_bomb_exchange_is_422_counted_and_never_decompressed(api, monkeypatch):
    """Issue 18: a few KB declaring 100 MB was decompressed (twice) before the exchange was refused,
    uncounted. Now its header alone refuses it (codec.MAX_UPLOAD_RATIO), and it counts."""
    import shared.codec.envelope as env
    from shared.codec.envelope import HEADER

    decompressed = []
    real = env._decompress
    monkeypatch.setattr(env, "_decompress", lambda frame, n: decompressed.append(n) or real(frame, n))
    monkeypatch.setattr(env, "max_body_bytes", lambda schema: 1 << 30)  # a big model's cap, not the tiny one's
    headers = api.register("s")
    lease = api.lease(headers, run="s")
    declared = 100 << 20
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(struct.pack("<QI", lease.base_version, 1)
                                                                    + bytes(declared - 12))
    bomb = HEADER.pack(codec.MAGIC, codec.FORMAT_VERSION, declared) + frame
    assert len(bomb) < 8 << 10
    before = observe(api)
    resp = post_exchange(api, lease.lease_id, EVERY, bomb, headers)
    assert resp.status_code == 422 and "times its" in resp.json()["detail"], resp.text
    assert decompressed == []
    assert [kind for kind, _ in refusals_of(api, headers)] == ["exchange"]
    wid = api.coordinator.workers.authenticate(headers["Authorization"].split()[1]).id
    up, down = before["workers"][wid]
    before["workers"][wid] = (up + len(bomb), down)
    before["runs"]["s"] = (before["runs"]["s"][0] + len(bomb), *before["runs"]["s"][1:])
    assert_same(before, observe(api))  # the model, the exchanges, the leases: unchanged


def test_exchanges_far_from_the_model_are_refused_and_throttle_the_worker(api):
    """Issue 18: a fresh worker's exchanges with values of 60000 were all answered 200 and took the
    eval loss to 2.6e9. Each is refused now (422, the reason), changes nothing, and counts toward the
    worker's standing: two of them throttle it."""
    headers = api.register("s")
    lease = api.lease(headers, run="s")
    before = observe(api)
    for step in (EVERY, 2 * EVERY):
        sent = sent_for(lease, step, worker_values(api, "s"))
        poisoned = Delta(sent.base_version, tuple(
            Entry(e.name, e.numel, e.index_kind, e.value_kind, np.full(e.k, 60000, np.float32), e.indices, e.seed)
            for e in sent.entries))
        resp = post_exchange(api, lease.lease_id, step, codec.encode(poisoned), headers)
        assert resp.status_code == 422, resp.text
        assert "exchange refused" in resp.json()["detail"] and "AdamW" in resp.json()["detail"]
    after = observe(api)
    assert after["exchanges"] == before["exchanges"]
    for run, params in before["params"].items():  # the model is untouched
        assert all(torch.equal(t, after["params"][run][n]) for n, t in params.items()), run
    with api.db() as s:
        (w,) = [w for w in s.scalars(select(Worker)) if w.id == _worker_of(api, lease.lease_id)]
        assert w.standing == "throttled" and "exchange refused" in w.standing_reason
    resp = api.client.post(f"{API}/runs/s/leases", headers=headers)
    assert resp.status_code == 429, resp.text  # throttled: no new lease for now


def test_an_honest_exchange_passes_the_screen_and_is_remembered(api):
    headers = api.register("s")
    lease = api.lease(headers, run="s")
    rt = api.runtime("s")
    wid = _worker_of(api, lease.lease_id)
    resp = post_exchange(api, lease.lease_id, EVERY, codec.encode(sent_for(lease, EVERY, worker_values(api, "s"))),
                         headers)
    assert resp.status_code == 200, resp.text
    assert len(rt.exchange_ratios.by_worker[str(wid)]) == 1  # its ratio to its limits, what its peers are judged by
    assert rt.exchange_ratios.by_worker[str(wid)][0] < 1.0  # a few steps' drift: within what the lease can move


def _worker_of(api, lease_id: int) -> int:
    with api.db() as s:
        return s.get(Lease, lease_id).worker_id


def test_no_exchange_folds_into_a_model_ahead_of_the_database(api):
    """A merge step that failed to commit (a full disk) leaves the live model ahead of the database until
    the merger reloads the run; an exchange meanwhile would be recorded after a version the database
    never reached, and a restart would replay it onto another model. It is answered 503 + Retry-After
    and changes nothing; the reloaded model takes it."""
    headers = api.register("s")
    lease = api.lease(headers, run="s")
    body = codec.encode(sent_for(lease, EVERY, worker_values(api, "s", seed=1)))
    api.runtime("s").ahead = True  # what Merger.step marks when its commit fails
    before = observe(api)
    resp = post_exchange(api, lease.lease_id, EVERY, body, headers)
    assert resp.status_code == 503 and int(resp.headers["Retry-After"]) >= 1, resp.text
    assert "retry" in resp.json()["detail"]
    assert_same(before, observe(api))
    api.coordinator.recovery.reload_run(api.runtime("s").run_id)  # what the merger does next
    assert post_exchange(api, lease.lease_id, EVERY, body, headers).status_code == 200
