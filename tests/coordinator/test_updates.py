"""GET /runs/{run}/updates/{from}/{to}: the int8 (or int4) change between two kept versions."""

from __future__ import annotations

import hashlib

from shared import codec, protocol
from shared.algorithms.sync import apply_update
from shared.snapshot import decode_snapshot
from tests.conftest import API, schema_of


def test_update_turns_an_old_snapshot_into_the_new_one(api, run, make_delta):
    w = api.register()
    leases = []
    for seed in range(1, 4):
        lease = api.lease(w)
        leases.append(lease)
        api.accept(lease.lease_id, make_delta(lease, seed=seed, scale=2e-3), w)
        api.drain()
    schema = schema_of(leases[0])
    old, _ = decode_snapshot(api.snapshot(0), schema=schema)
    new, _ = decode_snapshot(api.snapshot(3), schema=schema)
    resp = api.client.get(f"{API}/runs/t/updates/0/3")
    assert resp.status_code == 200, resp.text
    assert resp.headers[protocol.H_SHA256] == hashlib.sha256(resp.content).hexdigest()
    assert resp.headers[protocol.H_VERSION] == "3" and "immutable" in resp.headers["cache-control"]
    update = codec.decode(resp.content, schema=schema)
    assert update.base_version == 0
    got = {n: t.clone() for n, t in old.items()}
    apply_update(got, update)
    assert {e.value_kind for e in update.entries} == {codec.ValueKind.INT4}  # the run's update_values default
    for n in new:  # int4 rounding: at most max|change| / 14 per block of 256
        assert (got[n] - new[n]).abs().max() <= (new[n] - old[n]).abs().max() / 14 * 1.01 + 1e-7, n
    assert len(resp.content) < 0.5 * len(api.snapshot(3))
    # the second request is served from the file built by the first, and both are counted
    before = api.status()["bytes_down_model"]
    assert api.client.get(f"{API}/runs/t/updates/0/3").content == resp.content
    assert api.status()["bytes_down_model"] == before + len(resp.content)


def test_update_refusals(api, run, make_delta):
    w = api.register()
    lease = api.lease(w)
    api.accept(lease.lease_id, make_delta(lease), w)
    api.drain()
    for path, status in (("1/1", 422), ("1/0", 422), ("0/9", 404), ("0/-1", 422), ("x/1", 422)):
        resp = api.client.get(f"{API}/runs/t/updates/{path}")
        assert resp.status_code == status, (path, resp.text)
    assert api.client.get(f"{API}/runs/nope/updates/0/1").status_code == 404


def test_an_update_from_a_version_no_longer_kept_is_gone(tmp_path, open_api, run_config, make_delta):
    from coordinator.settings import CoordinatorSettings

    settings = CoordinatorSettings(data_dir=tmp_path / "c", checkpoint_every=2, snapshot_keep=2)
    with open_api(settings) as api:
        api.create_run(run_config(shard_tokens=2048))
        w = api.register()
        for seed in range(1, 5):
            lease = api.lease(w)
            api.accept(lease.lease_id, make_delta(lease, seed=seed), w)
            api.drain()
        assert api.client.get(f"{API}/runs/t/updates/3/4").status_code == 200
        resp = api.client.get(f"{API}/runs/t/updates/1/4")
        assert resp.status_code == 410 and "snapshots/4" in resp.json()["detail"]
        assert api.client.get(f"{API}/runs/t/updates/0/4").status_code == 200  # version 0 is always kept


def test_a_run_with_int8_updates_serves_them_in_int8(api, run_config, make_delta):
    api.create_run(run_config(update_values="int8"))
    w = api.register()
    for seed in (1, 2):
        lease = api.lease(w)
        api.accept(lease.lease_id, make_delta(lease, seed=seed, scale=2e-3), w)
        api.drain()
    schema = schema_of(lease)
    old, _ = decode_snapshot(api.snapshot(0), schema=schema)
    new, _ = decode_snapshot(api.snapshot(2), schema=schema)
    blob = api.client.get(f"{API}/runs/t/updates/0/2").content
    update = codec.decode(blob, schema=schema)
    assert {e.value_kind for e in update.entries} == {codec.ValueKind.INT8}
    got = {n: t.clone() for n, t in old.items()}
    apply_update(got, update)
    for n in new:  # int8 rounding: at most max|change| / 254 per block of 256
        assert (got[n] - new[n]).abs().max() <= (new[n] - old[n]).abs().max() / 254 * 1.01 + 1e-7, n
    assert len(blob) < 0.5 * len(api.snapshot(2))


def test_concurrent_requests_build_an_update_once_and_one_build_at_a_time(api, run, make_delta, monkeypatch):
    # a new version's update is wanted by every worker that held the old one, at once: built once,
    # the others wait for its file; different pairs are built one after another (each build holds
    # two decoded snapshots: ~1 GB at 124M parameters)
    import threading
    import time

    w = api.register()
    for seed in range(1, 4):
        lease = api.lease(w)
        api.accept(lease.lease_id, make_delta(lease, seed=seed, scale=2e-3), w)
        api.drain()
    coord = api.coordinator
    real, active, peak = coord.downloads.build_update, [0], [0]
    guard = threading.Lock()

    def slow_build(*args):
        with guard:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.2)
        try:
            return real(*args)
        finally:
            with guard:
                active[0] -= 1

    monkeypatch.setattr(coord.downloads, "build_update", slow_build)
    built = coord.downloads.updates_built
    pairs = [(0, 3)] * 6 + [(0, 2), (1, 3), (1, 2)]
    blobs: dict[int, tuple[bytes, str]] = {}

    def ask(i: int) -> None:
        blobs[i] = coord.downloads.model_update("t", *pairs[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(pairs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert coord.downloads.updates_built - built == 4  # (0, 3) once, and each other pair once
    assert peak[0] == 1
    assert len({blobs[i] for i in range(6)}) == 1  # every (0, 3) request got the same bytes
    assert blobs[0][0] == api.client.get(f"{API}/runs/t/updates/0/3").content
