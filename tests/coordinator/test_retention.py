"""Disk use stays bounded: received deltas and exchange bodies that every kept checkpoint already
holds are deleted (unless keep_deltas), a restart from any kept checkpoint still rebuilds the model
bit for bit, and a rebuild that would need deleted deltas is refused with what to do."""

from __future__ import annotations

import pytest
import torch
from sqlalchemy import func, select

from coordinator.errors import RunUnrecoverable
from coordinator.models import Exchange
from coordinator import checkpoints
from coordinator.settings import CoordinatorSettings
from tests.conftest import API
from tests.coordinator.test_exchange_replay import EVERY, STEPS, _exchange


def _train(api, make_delta, rounds: int) -> None:
    """Per round: three exchanges, then a delta from each of two workers (two versions)."""
    workers = [api.register() for _ in range(2)]
    seed = 0
    for _ in range(rounds):
        leases = [api.lease(h) for h in workers]
        for i, step in ((0, EVERY), (1, EVERY), (0, 2 * EVERY)):
            seed += 1
            _exchange(api, leases[i], step, workers[i], seed)
        for i in (0, 1):
            api.accept(leases[i].lease_id, make_delta(leases[i], seed=seed + 100 * i), workers[i])
            api.drain()


def _config(run_config):
    return run_config(algorithm="sparta+diloco", shard_tokens=2048, inner={"steps": STEPS, "batch_size": 2},
                      sparta={"p": 0.2, "every": EVERY}, outer={"group": 2})


def _files(storage, run_id) -> list[int]:
    return sorted(int(name.rsplit("/", 1)[-1].removesuffix(".delta")) for name in storage.list(storage.deltas(run_id))
                  if name.endswith(".delta"))


def _exchange_bodies(api, run_id) -> dict[int, int]:
    """after_version -> how many of the exchanges after it still have their body."""
    with api.db() as s:
        rows = s.execute(select(Exchange.after_version, func.length(Exchange.body)).where(
            Exchange.run_id == run_id)).all()
    out: dict[int, int] = {}
    for version, size in rows:
        out[version] = out.get(version, 0) + (size > 0)
    return out


def test_deltas_every_kept_checkpoint_holds_are_deleted_and_a_restart_still_rebuilds(
        tmp_path, open_api, run_config, make_delta):
    settings = CoordinatorSettings(data_dir=tmp_path / "coord", checkpoint_every=2)
    assert checkpoints.KEPT == 3
    with open_api(settings) as api:
        api.create_run(_config(run_config))
        held = api.register()  # a lease that stays open throughout, its first exchange made now (version 0)
        held_lease = api.lease(held)
        _exchange(api, held_lease, EVERY, held, 999)
        _train(api, make_delta, rounds=1)  # versions 1, 2: checkpoints 0 and 2, fewer than kept: nothing goes
        rt = api.runtime()
        storage, run_id = api.coordinator.storage, rt.run_id
        assert _files(storage, run_id) == [1, 2] and storage.pruned_through(run_id) == 0
        _train(api, make_delta, rounds=3)  # versions 3..8: checkpoints 4, 6, 8 kept
        assert rt.version == 8
        assert [v for v, _ in storage.list_checkpoints(run_id)] == [8, 6, 4]
        assert _files(storage, run_id) == [5, 6, 7, 8]  # 1..4 are in every kept checkpoint
        assert storage.pruned_through(run_id) == 4
        bodies = _exchange_bodies(api, run_id)
        assert all(n == 0 for v, n in bodies.items() if v < 4) and sum(n for v, n in bodies.items() if v >= 4) > 0
        assert api.status()["exchanges"] == 13  # the rows stay: counted, and a retry is still refused
        before = {n: t.clone() for n, t in rt.state.params.items()}
        momentum = {n: t.clone() for n, t in rt.state.momentum.items()}
        # the open lease's exchange, retried after its body went, is refused, not applied a second time
        with api.db() as s:
            assert s.scalar(select(Exchange.body).where(Exchange.lease_id == held_lease.lease_id)) == b""
        resp = api.client.post(f"{API}/leases/{held_lease.lease_id}/exchange", params={"step": EVERY},
                               content=b"x", headers={**held, "Content-Type": "application/octet-stream"})
        assert resp.status_code == 409 and "already exchanged" in resp.text
        assert torch.equal(rt.state.params[next(iter(before))], before[next(iter(before))])

    # the two newest checkpoints lost: the oldest kept one (version 4) plus what was not deleted rebuilds it
    storage.delete(storage.checkpoint(run_id, 8))
    storage.delete(storage.checkpoint(run_id, 6))
    with open_api(settings) as api:
        rt = api.runtime()
        assert rt.version == 8
        for n in before:
            assert torch.equal(rt.state.params[n], before[n]), n
            assert torch.equal(rt.state.momentum[n], momentum[n]), n

    # with every checkpoint gone a rebuild would need the deleted deltas: refused, with what to do, and
    # nothing is changed on disk
    for _, name in storage.list_checkpoints(run_id):
        storage.delete(name)
    left = _files(storage, run_id)
    with pytest.raises(RunUnrecoverable, match=r"deltas up to version \d+ were deleted.*Put back a good checkpoint"):
        with open_api(settings):
            pass
    assert _files(storage, run_id) == left and storage.list_checkpoints(run_id) == []


def test_keep_deltas_keeps_everything_for_a_rebuild_from_version_0(tmp_path, open_api, run_config, make_delta):
    settings = CoordinatorSettings(data_dir=tmp_path / "coord", checkpoint_every=2, keep_deltas=True)
    with open_api(settings) as api:
        api.create_run(_config(run_config))
        _train(api, make_delta, rounds=4)
        rt = api.runtime()
        storage, run_id = api.coordinator.storage, rt.run_id
        assert rt.version == 8 and _files(storage, run_id) == list(range(1, 9))
        assert storage.pruned_through(run_id) == 0
        assert all(n > 0 for n in _exchange_bodies(api, run_id).values())
        before = {n: t.clone() for n, t in rt.state.params.items()}
    for _, name in storage.list_checkpoints(run_id):
        storage.delete(name)
    with open_api(settings) as api:  # from version 0: every delta and exchange replayed
        rt = api.runtime()
        assert rt.version == 8
        for n in before:
            assert torch.equal(rt.state.params[n], before[n]), n


def test_prune_deltas_writes_its_mark_before_deleting(tmp_path):
    from coordinator.storage import Storage

    storage = Storage.local(tmp_path)
    for seq in range(1, 6):
        storage.write(storage.delta(1, seq), b"d")
    assert storage.prune_deltas(1, 3) == 3
    assert _files(storage, 1) == [4, 5] and storage.pruned_through(1) == 3
    assert storage.prune_deltas(1, 3) == 0  # again: nothing more
    assert storage.pruned_through(2) == 0  # another run: nothing deleted
