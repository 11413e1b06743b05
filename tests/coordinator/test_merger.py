"""The merger: order, the merge rule against an independent replay, evaluation, restarts."""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import os
import sqlite3

import numpy as np
import pytest
import torch

from coordinator.models import DeltaRecord, Worker
from coordinator.settings import CoordinatorSettings
from shared import codec
from shared.algorithms.outer import OuterState, apply_delta, published, staleness_weight
from shared.config import RunConfig
from shared.model import build_model, get_params, param_schema
from shared.snapshot import decode_snapshot


def replay(cfg: RunConfig, deltas: list[tuple[bytes, int]]) -> dict[str, torch.Tensor]:
    """The merge rule applied from scratch, outside the coordinator: deltas in the given order,
    each (encoded bytes, base version), the i-th one merged into version i (so it lags i - base).
    Returns the published model (what a snapshot holds: the open group at its mean)."""
    model = build_model(cfg.model, seed=cfg.seed)
    schema = param_schema(model)
    state = OuterState.fresh(get_params(model))
    for version, (blob, base) in enumerate(deltas):
        staleness = version - base
        assert 0 <= staleness <= cfg.outer.max_staleness
        apply_delta(state, codec.decode(blob, schema=schema), weight=staleness_weight(staleness, cfg.outer),
                    cfg=cfg.outer)
    return published(state, cfg.outer)


def latest_params(api, cfg: RunConfig) -> dict[str, torch.Tensor]:
    params, meta = decode_snapshot(api.snapshot("latest"), schema=param_schema(build_model(cfg.model)))
    return params


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: max diff {(a[name] - b[name]).abs().max():.3g}"


def differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[n], b[n]) for n in a)


class Uploader:
    """Leases and uploads seeded random deltas through the API; remembers what was acknowledged."""

    def __init__(self, api, make_delta, n_workers: int = 3) -> None:
        self.api, self.make_delta = api, make_delta
        self.workers = [api.register() for _ in range(n_workers)]
        self.sent: dict[int, tuple[bytes, int]] = {}  # seq -> (bytes, base version)
        self._seed = 0

    def lease_all(self):
        return [(h, self.api.lease(h)) for h in self.workers]

    def deliver(self, held) -> list[int]:
        seqs = []
        for headers, lease in held:
            self._seed += 1
            body = self.make_delta(lease, seed=self._seed, scale=2e-3)  # within what a round can move
            ack = self.api.accept(lease.lease_id, body, headers)
            self.sent[ack.will_merge_into] = (body, lease.base_version)
            seqs.append(ack.will_merge_into)
        return seqs

    def in_order(self) -> list[tuple[bytes, int]]:
        return [self.sent[seq] for seq in sorted(self.sent)]


# 18 shards: every worker in these tests always finds work. The replay here is the merge rule alone:
# new workers at full weight from their first delta (no ramp), and random deltas, which agree with
# no consensus, never refused for it.
MANY_SHARDS = {"shard_tokens": 2048, "robust": {"ramp": 1, "min_agreement": -1.0}}


@pytest.fixture
def run(api, run_config) -> RunConfig:
    cfg = run_config(**MANY_SHARDS)
    assert api.create_run(cfg)["n_shards"] == 18
    return RunConfig.model_validate(cfg)


def test_merge_applies_deltas_in_seq_order_like_a_replay(api, run, make_delta):
    up = Uploader(api, make_delta)
    held = up.lease_all()  # three leases from version 0
    # delivered in reverse lease order: arrival order decides the sequence
    assert up.deliver(held[::-1]) == [1, 2, 3]
    assert api.drain() == 3
    held = up.lease_all()  # three more from version 3
    assert {lease.base_version for _, lease in held} == {3}
    assert up.deliver(held) == [4, 5, 6]
    assert api.drain() == 3

    got = latest_params(api, run)
    assert_same(got, replay(run, up.in_order()))
    assert_same(published(api.runtime().state, run.outer), got)
    # the stored bytes are the uploaded bytes
    storage, run_id = api.coordinator.storage, api.runtime().run_id
    for seq, (body, _) in up.sent.items():
        assert storage.read(storage.delta(run_id, seq)) == body
    # the check can fail: the order matters (the third delta of a group lags 2 versions: weight < 1)
    swapped = up.in_order()
    swapped[0], swapped[2] = swapped[2], swapped[0]
    assert differs(got, replay(run, swapped))

    with api.db() as s:
        recs = s.query(DeltaRecord).order_by(DeltaRecord.seq).all()
    assert [(r.seq, r.outcome, r.staleness) for r in recs] == [
        (1, "merged", 0), (2, "merged", 1), (3, "merged", 2), (4, "merged", 0), (5, "merged", 1), (6, "merged", 2)]
    assert recs[2].weight == pytest.approx(staleness_weight(2, run.outer)) and recs[2].weight < 1


def test_every_version_has_its_snapshot(api, run, make_delta):
    up = Uploader(api, make_delta, n_workers=2)
    up.deliver(up.lease_all())
    api.drain()
    for v in range(3):
        want = replay(run, up.in_order()[:v])
        params, meta = decode_snapshot(api.snapshot(v), schema=param_schema(build_model(run.model)))
        assert meta["version"] == str(v)
        assert_same(params, want)


def test_eval_recorded_every_eval_every_versions(api, run_config, make_delta):
    cfg_dict = run_config(eval_every=2, **MANY_SHARDS)
    api.create_run(cfg_dict)
    cfg = RunConfig.model_validate(cfg_dict)
    up = Uploader(api, make_delta)
    up.deliver(up.lease_all())
    assert api.drain() == 3
    up.deliver(up.lease_all())
    assert api.drain() == 3
    st = api.status()
    assert st["version"] == 6
    tokens = cfg.inner.steps * cfg.inner.batch_size * cfg.model.context
    assert [(e["version"], e["tokens_trained"]) for e in st["eval_history"]] == [
        (0, 0), (2, 2 * tokens), (4, 4 * tokens), (6, 6 * tokens)]
    assert st["eval_loss"] == st["eval_history"][-1]["loss"]
    # the recorded loss is the loss of that version's weights
    rt = api.runtime()
    assert st["eval_history"][-1]["loss"] == pytest.approx(rt.evaluate(), abs=1e-6)
    assert len({e["loss"] for e in st["eval_history"]}) == 4


def test_a_delta_too_stale_at_merge_time_is_rejected_not_applied(api, run_config, make_delta):
    cfg_dict = run_config(outer={"max_staleness": 1}, **MANY_SHARDS)
    api.create_run(cfg_dict)
    cfg = RunConfig.model_validate(cfg_dict)
    up = Uploader(api, make_delta)
    up.deliver(up.lease_all())  # all from version 0: the third lags 2 > 1 when its turn comes
    assert api.drain() == 3
    st = api.status()
    assert (st["version"], st["merged_deltas"], st["rejected_deltas"]) == (3, 2, 1)
    with api.db() as s:
        rec = s.query(DeltaRecord).filter_by(seq=3).one()
    assert rec.outcome == "rejected" and "stale" in rec.reason
    assert_same(latest_params(api, cfg), replay(cfg, up.in_order()[:2]))


@pytest.mark.parametrize("checkpoint", ["kept", "corrupt", "missing", "older"])
def test_restart_resumes_with_identical_weights(tmp_path, open_api, run_config, make_delta, caplog, checkpoint):
    """Stop with 3 deltas merged and 2 acknowledged but queued; restart; everything merges once."""
    # snapshot_duty 1: every version's snapshot at once, as in conftest.settings
    settings = CoordinatorSettings(data_dir=tmp_path / "coord", snapshot_duty=1.0)
    cfg_dict = run_config(**MANY_SHARDS)
    cfg = RunConfig.model_validate(cfg_dict)
    with open_api(settings) as api:
        api.create_run(cfg_dict)
        storage, run_id = api.coordinator.storage, api.runtime().run_id
        up = Uploader(api, make_delta)
        up.deliver(up.lease_all())
        assert api.drain() == 3
        before = latest_params(api, cfg)
        snaps_before = [api.snapshot(v) for v in range(4)]
        queued = up.lease_all()[:2]
        assert up.deliver(queued) == [4, 5]
        st = api.status()
        assert (st["version"], st["pending_deltas"]) == (3, 2)
        workers = up.workers

    # shutdown checkpointed version 3; version 0's checkpoint (from run creation) is still kept
    assert [v for v, _ in storage.list_checkpoints(run_id)] == [3, 0]
    newest = storage.checkpoint(run_id, 3)
    if checkpoint == "corrupt":  # the newest fails its hash: fall back to version 0's, replay 3 deltas
        blob = bytearray(storage.read(newest))
        blob[len(blob) // 2] ^= 0x01  # one bit in the tensor data
        storage.write(newest, bytes(blob))
    elif checkpoint == "missing":
        for _, name in storage.list_checkpoints(run_id):
            storage.delete(name)
    elif checkpoint == "older":  # a half-written newest never got renamed in: version 0's is what there is
        storage.delete(newest)

    caplog.set_level(logging.INFO, logger="coordinator")
    with open_api(settings) as api:
        rt = api.runtime()
        assert rt.version == 3
        assert_same(published(rt.state, cfg.outer), before)
        assert rt.state.in_group == 1  # group of 2: the third delta opened a new group
        # every kept version is served as before, with a hash that matches what is served
        for v, blob in enumerate(snaps_before):
            resp = api.client.get(f"/api/v1/runs/t/snapshots/{v}")
            assert hashlib.sha256(resp.content).hexdigest() == resp.headers["X-Content-SHA256"], v
            assert resp.content == blob, v
        assert api.snapshot("latest") == snaps_before[3]
        st = api.status()
        assert (st["version"], st["merged_deltas"], st["pending_deltas"]) == (3, 3, 2)
        if checkpoint == "corrupt":
            assert "fails its hash" in caplog.text
        if checkpoint == "missing":
            assert "replaying from version 0" in caplog.text
        replayed = {"kept": 0, "corrupt": 3, "missing": 3, "older": 3}[checkpoint]
        assert f"resumed at version 3 ({replayed} deltas replayed, 0 exchanges)" in caplog.text

        # the acknowledged deltas merge now, once, and the workers carry on with their tokens
        assert api.drain() == 2
        up.api, up.workers = api, workers
        up.deliver(up.lease_all()[:1])
        assert api.drain() == 1
        st = api.status()
        assert (st["version"], st["merged_deltas"], st["pending_deltas"]) == (6, 6, 0)
        final = latest_params(api, cfg)
        assert_same(final, replay(cfg, up.in_order()))
        assert differs(final, before)


def test_restart_after_checkpoint_every(tmp_path, open_api, run_config, make_delta):
    """Periodic checkpoints and snapshot clean-up, then a restart from the newest checkpoint."""
    settings = CoordinatorSettings(data_dir=tmp_path / "coord", checkpoint_every=2, snapshot_keep=2,
                                   snapshot_duty=1.0)  # every version's snapshot at once, as in conftest.settings
    cfg_dict = run_config(**MANY_SHARDS)
    cfg = RunConfig.model_validate(cfg_dict)
    with open_api(settings) as api:
        api.create_run(cfg_dict)
        up = Uploader(api, make_delta, n_workers=2)
        for _ in range(3):
            up.deliver(up.lease_all())
            api.drain()
        assert api.status()["version"] == 6
        # old snapshots went (version 0 stays: it is where replay starts)
        assert api.client.get("/api/v1/runs/t/snapshots/2").status_code == 410
        assert api.client.get("/api/v1/runs/t/snapshots/0").status_code == 200
        assert api.client.get("/api/v1/runs/t/snapshots/5").status_code == 200
        final = latest_params(api, cfg)
    assert_same(final, replay(cfg, up.in_order()))
    with open_api(settings) as api:
        assert api.runtime().version == 6
        assert_same(published(api.runtime().state, cfg.outer), final)


# -- a full disk: the merger finds its own way back, and a restart needs no writes ---------------

def _no_space(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _two_queued(api, make_delta) -> list[tuple[bytes, int]]:
    """Two deltas from version 0, acknowledged and queued; returns them in their merge order."""
    sent = []
    for seed in (1, 2):
        headers = api.register()
        lease = api.lease(headers)
        body = make_delta(lease, seed=seed, scale=1e-4)
        assert api.accept(lease.lease_id, body, headers).will_merge_into == seed
        sent.append((body, lease.base_version))
    return sent


def _merged(api) -> tuple[int, int, int]:
    st = api.status()
    return st["version"], st["merged_deltas"] + st["rejected_deltas"], st["pending_deltas"]


def test_the_merger_recovers_by_itself_when_a_full_disk_stops_a_merge_step(api, run, make_delta, monkeypatch):
    """The snapshot of a batch fails for want of space after its weights moved: the live model is
    ahead of the database. Today's merger then saw nothing left to merge until an upload forced a
    reload; now it reloads itself and, once there is room, merges the same deltas, each once."""
    sent = _two_queued(api, make_delta)
    with monkeypatch.context() as m:
        m.setattr(api.coordinator.storage, "write", _no_space)
        for _ in range(2):  # every try while full fails, and leaves the model as the database has it
            with pytest.raises(OSError, match="No space left"):
                api.drain()
            assert _merged(api) == (0, 0, 2)
            assert api.runtime().version == 0
    assert api.drain() == 2  # room again: no upload needed
    assert _merged(api) == (2, 2, 0)
    assert_same(latest_params(api, run), replay(run, sent))
    assert_same(published(api.runtime().state, run.outer), replay(run, sent))


def test_the_merger_reloads_before_merging_while_a_reload_fails(api, run, make_delta, monkeypatch, database_full):
    """The commit finds the database full and the reload after it fails too (the database away): the
    next step reloads first, so the deltas merge once, not on top of the model that got ahead."""
    from sqlalchemy.exc import OperationalError

    sent = _two_queued(api, make_delta)
    coord = api.coordinator

    def away(_run_id):
        raise OperationalError("SELECT", None, sqlite3.OperationalError("unable to open database file"))

    with database_full(coord.db.engine), monkeypatch.context() as m:
        m.setattr(coord.recovery, "reload_run", away)
        with pytest.raises(OperationalError, match="disk is full|disk_full|No space"):
            api.drain()
        # ahead of the database (one delta: a batch ends where a snapshot is due, every version
        # here), and no reload managed yet
        assert api.runtime().version == 1
        assert api.runtime().ahead  # exchanges are refused (503) while it is (test_exchange.py)
        with pytest.raises(OperationalError, match="unable to open"):
            api.drain()  # tries the reload first, which still fails: nothing merged on top
        assert api.runtime().version == 1
    assert _merged(api) == (0, 0, 2)
    assert api.drain() == 2
    assert _merged(api) == (2, 2, 0) and not api.runtime().ahead  # the reloaded object
    assert_same(published(api.runtime().state, run.outer), replay(run, sent))


def test_a_restart_on_a_full_disk_comes_up_and_writes_what_it_skipped_later(tmp_path, open_api, run_config,
                                                                             make_delta, monkeypatch):
    """A crash left two merged versions to replay; the restart finds no room for the checkpoint after
    the replay or the missing snapshot. It comes up all the same: /healthz, status and leases answer,
    uploads get 503; once there is room the merger writes both."""
    settings = CoordinatorSettings(data_dir=tmp_path / "coord", checkpoint_every=2)
    cfg_dict = run_config(**MANY_SHARDS)
    cfg = RunConfig.model_validate(cfg_dict)
    with open_api(settings) as api:
        api.create_run(cfg_dict)
        run_id = api.runtime().run_id
        sent = _two_queued(api, make_delta)
        api.runtime().snapshot_cost_s = 1e9  # the snapshot duty holds version 2's snapshot back
        assert api.drain() == 2
    storage = api.coordinator.storage
    storage.delete(storage.checkpoint(run_id, 2))  # the crash came before the checkpoint: 2 deltas to replay
    assert [v for v, _ in storage.list_checkpoints(run_id)] == [0]

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", _no_space)  # every durable write fails
        with open_api(settings) as api:
            assert api.client.get("/healthz").status_code == 200
            assert _merged(api) == (2, 2, 0)
            assert_same(published(api.runtime().state, cfg.outer), replay(cfg, sent))
            assert [v for v, _ in storage.list_checkpoints(run_id)] == [0]
            headers = api.register()
            lease = api.lease(headers)
            assert lease.base_version == 0  # the newest snapshot there is
            resp = api.upload(lease.lease_id, make_delta(lease, seed=3, scale=1e-4), headers)
            assert (resp.status_code, resp.headers["Retry-After"]) == (503, "30")
            with pytest.raises(OSError):  # the merger's catch-up fails too, and says so, until there is room
                api.merger.catch_up_snapshot(api.runtime())
            m.undo()
            assert api.merger.catch_up_snapshot(api.runtime())
            assert api.merger.catch_up_checkpoint(api.runtime())
            assert [v for v, _ in storage.list_checkpoints(run_id)] == [2, 0]
            assert api.lease(api.register()).base_version == 2
            assert_same(latest_params(api, cfg), replay(cfg, sent))


def test_the_screen_holds_from_the_first_delta_and_a_new_worker_ramps_up(api, run_config, make_delta, encode_unchecked):
    """Issue 18: before 8 norms were known only the absolute bound applied (~10 H lr per element): one
    worker's random deltas at 0.95x it all merged. Now the first such delta is rejected (the
    per-element bound), a delta of zeros is no round's work, both count toward the sender's standing
    and earn nothing; an honest new worker's first delta merges at 1/ramp of its weight."""
    cfg = RunConfig.model_validate(run_config(shard_tokens=2048))
    api.create_run(cfg.model_dump(mode="json"))
    rt = api.runtime()
    assert rt.reference_norm is not None and rt.reference_norm > 0  # the coordinator's own round
    bad, good = api.register(name="bad"), api.register(name="good")
    schema = param_schema(build_model(cfg.model))
    v0 = latest_params(api, cfg)
    a = 0.95 * cfg.robust.bound_factor * cfg.inner.steps * cfg.inner.lr
    rng = np.random.default_rng(0)
    for values in ("random", "zeros"):
        lease = api.lease(bad)
        entries = [(n, (a * rng.choice([-1.0, 1.0], size=math.prod(s)) if values == "random"
                        else np.zeros(math.prod(s))).astype(np.float32)) for n, s in schema.items()]
        assert api.upload(lease.lease_id, encode_unchecked(lease.base_version, entries), bad).status_code == 202
        assert api.drain() == 1
    assert_same(latest_params(api, cfg), v0)  # nothing merged
    with api.db() as s:
        recs = s.query(DeltaRecord).order_by(DeltaRecord.seq).all()
        assert [r.outcome for r in recs] == ["rejected", "rejected"]
        assert "one element" in recs[0].reason and "too small" in recs[1].reason
        w = s.get(Worker, recs[0].worker_id)
        assert (w.standing, w.credit or 0.0) == ("throttled", 0.0)
    assert api.client.post("/api/v1/runs/t/leases", headers=bad).status_code == 429

    lease = api.lease(good)
    body = make_delta(lease)
    api.accept(lease.lease_id, body, good)
    assert api.drain() == 1
    state = OuterState.fresh(get_params(build_model(cfg.model, seed=cfg.seed)))
    assert lease.base_version == 2  # the rejected deltas made versions too, and moved nothing
    apply_delta(state, codec.decode(body, schema=schema), weight=staleness_weight(0, cfg.outer) / cfg.robust.ramp,
                cfg=cfg.outer)
    got, want = latest_params(api, cfg), published(state, cfg.outer)
    assert all(torch.allclose(got[n], want[n], atol=1e-7) for n in got)
    assert differs(got, v0)
