"""A run with update_feedback: each model update is the change from the worker's own copy, which the
coordinator keeps (GET /runs/{run}/updates/{from}/{to}/{copy_digest})."""

from __future__ import annotations

import torch

from shared import codec, protocol
from shared.algorithms.sync import apply_update, copy_digest
from shared.snapshot import decode_snapshot
from tests.conftest import API, schema_of


def _versions(api, make_delta, n: int):
    w = api.register()
    for seed in range(1, n + 1):
        lease = api.lease(w)
        api.accept(lease.lease_id, make_delta(lease, seed=seed, scale=2e-3), w)
        api.drain()
    api.worker = w  # the copy route is for the run's workers
    return schema_of(lease)


def _moved(api, schema, copy, path):
    resp = api.client.get(f"{API}/runs/t/updates/{path}", headers=api.worker)
    assert resp.status_code == 200, resp.text
    assert resp.headers[protocol.H_UPDATE_FEEDBACK] == "1"
    update = codec.decode(resp.content, schema=schema)
    assert {e.value_kind for e in update.entries} == {codec.ValueKind.INT1}
    got = {n: t.clone() for n, t in copy.items()}
    apply_update(got, update)
    return got, resp.content


def _distance(a, b) -> float:
    return sum(float((a[n] - b[n]).square().sum()) for n in a) ** 0.5


def test_each_update_is_taken_from_the_workers_copy_and_carries_the_last_ones_rounding(api, run_config, make_delta):
    api.create_run(run_config(update_values="int1", update_feedback=True))
    schema = _versions(api, make_delta, 3)
    snap = {v: decode_snapshot(api.snapshot(v), schema=schema)[0] for v in range(4)}
    kept = api.coordinator.storage.copies(1)

    # from version 0 itself (a worker that joined from its snapshot): no copy named
    copy1, blob = _moved(api, schema, snap[0], "0/1")
    assert api.coordinator.storage.exists(f"{kept}/{copy_digest(copy1)}.f32")  # kept for the worker's next update
    assert 0 < _distance(copy1, snap[1]) < 0.7 * _distance(snap[0], snap[1])  # int1: sqrt(1 - 2/pi) of the change
    assert api.client.get(f"{API}/runs/t/updates/0/1").content == blob  # a retry: the same bytes, kept
    assert api.coordinator.storage.exists(api.coordinator.storage.update(1, 0, 1))
    # the next update is taken from that copy, so the copy's error is sent along, not kept
    copy3, _ = _moved(api, schema, copy1, f"1/3/{copy_digest(copy1)}")
    plain3 = {n: t.clone() for n, t in copy1.items()}  # what the change between versions 1 and 3 would make
    apply_update(plain3, codec.decode(api.client.get(f"{API}/runs/t/updates/1/3").content, schema=schema))
    assert _distance(copy3, snap[3]) < 0.7 * _distance(copy1, snap[3])
    assert _distance(copy3, snap[3]) < _distance(plain3, snap[3])
    # a snapshot's own digest names it too: a worker holding version 2 exactly
    _moved(api, schema, snap[2], f"2/3/{copy_digest(snap[2])}")


def test_a_copy_not_kept_is_gone_and_a_malformed_one_refused(api, run_config, make_delta):
    api.create_run(run_config(update_values="int1", update_feedback=True))
    schema = _versions(api, make_delta, 2)
    stranger = {n: torch.ones(s) for n, s in schema.items()}
    resp = api.client.get(f"{API}/runs/t/updates/0/2/{copy_digest(stranger)}", headers=api.worker)
    assert resp.status_code == 410 and "is not kept here; fetch snapshots/2" in resp.json()["detail"]
    for bad in ("ABC", "0" * 63, "g" * 64):
        assert api.client.get(f"{API}/runs/t/updates/0/2/{bad}", headers=api.worker).status_code == 422, bad
    assert api.client.get(f"{API}/runs/t/updates/2/2/{'0' * 64}", headers=api.worker).status_code == 422
    assert api.client.get(f"{API}/runs/t/updates/0/9/{'0' * 64}", headers=api.worker).status_code == 404
    # each answer is built for the asking worker: the run's workers only
    assert api.client.get(f"{API}/runs/t/updates/0/2/{'0' * 64}").status_code == 401
    api.create_run(run_config("u"))
    outsider = api.register("u")
    resp = api.client.get(f"{API}/runs/t/updates/0/2/{'0' * 64}", headers=outsider)
    assert resp.status_code == 403 and "another run" in resp.json()["detail"]


def test_a_run_without_update_feedback_serves_the_change_between_versions(api, run, make_delta):
    _versions(api, make_delta, 2)
    plain = api.client.get(f"{API}/runs/t/updates/0/2")
    named = api.client.get(f"{API}/runs/t/updates/0/2/{'0' * 64}", headers=api.worker)
    assert named.status_code == 200 and named.content == plain.content
    assert protocol.H_UPDATE_FEEDBACK not in named.headers and protocol.H_UPDATE_FEEDBACK not in plain.headers
    assert api.coordinator.storage.list(api.coordinator.storage.copies(1)) == []


def test_only_the_newest_copies_are_kept(tmp_path, open_api, run_config, make_delta):
    from coordinator.settings import CoordinatorSettings

    with open_api(CoordinatorSettings(data_dir=tmp_path / "c", update_copies_keep=2)) as api:
        api.create_run(run_config(update_values="int4", update_feedback=True))
        schema = _versions(api, make_delta, 3)
        storage = api.coordinator.storage
        v0, _ = decode_snapshot(api.snapshot(0), schema=schema)
        made = []
        for to in (1, 2, 3):
            blob = api.client.get(f"{API}/runs/t/updates/0/{to}").content
            copy = {n: t.clone() for n, t in v0.items()}
            apply_update(copy, codec.decode(blob, schema=schema))
            made.append(storage.copy(1, copy_digest(copy)))
        assert storage.list(storage.copies(1)) == sorted(made[1:])  # the oldest copy went


def test_an_update_from_a_copy_is_built_once_and_goes_with_the_copy(tmp_path, open_api, run_config, make_delta):
    from coordinator.settings import CoordinatorSettings

    with open_api(CoordinatorSettings(data_dir=tmp_path / "c", update_copies_keep=2)) as api:
        api.create_run(run_config(update_values="int1", update_feedback=True))
        schema = _versions(api, make_delta, 4)
        storage, downloads = api.coordinator.storage, api.coordinator.downloads
        copy1, _ = _moved(api, schema, decode_snapshot(api.snapshot(0), schema=schema)[0], "0/1")
        built = downloads.updates_built
        path = f"1/3/{copy_digest(copy1)}"
        copy3, blob = _moved(api, schema, copy1, path)
        assert downloads.updates_built == built + 1
        # a retry, or a second worker holding the same copy: the kept bytes, not built again
        assert api.client.get(f"{API}/runs/t/updates/{path}", headers=api.worker).content == blob
        assert downloads.updates_built == built + 1
        assert storage.exists(storage.copy_update(1, copy_digest(copy1), 3))
        copy4, _ = _moved(api, schema, copy3, f"3/4/{copy_digest(copy3)}")
        # two copies kept: the oldest went, and the update built from it with it
        assert set(storage.list(storage.copies(1))) == {
            storage.copy(1, copy_digest(copy3)), storage.copy_update(1, copy_digest(copy3), 4),
            storage.copy(1, copy_digest(copy4))}
        assert api.client.get(f"{API}/runs/t/updates/{path}", headers=api.worker).status_code == 410


def test_int1_updates_need_update_feedback(api, run_config):
    resp = api.client.post(f"{API}/runs", json=run_config(update_values="int1"), headers=api.admin)
    assert resp.status_code == 422 and "needs update_feedback" in resp.text
