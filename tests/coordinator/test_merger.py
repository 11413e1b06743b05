"""The merger: order, the merge rule against an independent replay, evaluation, restarts."""

from __future__ import annotations

import hashlib
import logging

import pytest
import torch

from coordinator.models import DeltaRecord
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
            body = self.make_delta(lease, seed=self._seed, scale=0.05)
            ack = self.api.accept(lease.lease_id, body, headers)
            self.sent[ack.will_merge_into] = (body, lease.base_version)
            seqs.append(ack.will_merge_into)
        return seqs

    def in_order(self) -> list[tuple[bytes, int]]:
        return [self.sent[seq] for seq in sorted(self.sent)]


MANY_SHARDS = {"shard_tokens": 2048}  # 18 shards: every worker in these tests always finds work


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

    with api.coordinator.sessions() as s:
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
    with api.coordinator.sessions() as s:
        rec = s.query(DeltaRecord).filter_by(seq=3).one()
    assert rec.outcome == "rejected" and "stale" in rec.reason
    assert_same(latest_params(api, cfg), replay(cfg, up.in_order()[:2]))


@pytest.mark.parametrize("checkpoint", ["kept", "corrupt", "missing", "older"])
def test_restart_resumes_with_identical_weights(tmp_path, open_api, run_config, make_delta, caplog, checkpoint):
    """Stop with 3 deltas merged and 2 acknowledged but queued; restart; everything merges once."""
    settings = CoordinatorSettings(data_dir=tmp_path / "coord")
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
        blob = bytearray(newest.read_bytes())
        blob[len(blob) // 2] ^= 0x01  # one bit in the tensor data
        newest.write_bytes(bytes(blob))
    elif checkpoint == "missing":
        for _, path in storage.list_checkpoints(run_id):
            path.unlink()
    elif checkpoint == "older":  # a half-written newest never got renamed in: version 0's is what there is
        newest.unlink()

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
    settings = CoordinatorSettings(data_dir=tmp_path / "coord", checkpoint_every=2, snapshot_keep=2)
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
