"""An upload writes its bytes durably under a name of its lease and content before it takes a
sequence number; the merger (or a restart) renames them to the sequence number. Nothing
acknowledged is ever without its file; leftovers of uploads that never got their 202 go."""

from __future__ import annotations

import hashlib
import time

from tests.conftest import API


def _files(storage, run_id) -> list[str]:
    return sorted(name.rsplit("/", 1)[-1] for name in storage.list(storage.deltas(run_id))
                  if name.endswith((".delta", ".staged")))


def _staged(storage, run_id) -> list[str]:
    return [name for name in storage.list(storage.deltas(run_id)) if name.endswith(".staged")]


def test_the_acknowledged_bytes_are_staged_then_renamed_to_their_sequence_number(api, run, make_delta):
    h = api.register()
    lease = api.lease(h)
    body = make_delta(lease, seed=3)
    ack = api.accept(lease.lease_id, body, h)
    storage, run_id = api.coordinator.storage, api.runtime().run_id
    staged = storage.staged_delta(run_id, lease.lease_id, hashlib.sha256(body).hexdigest())
    assert storage.read(staged) == body and not storage.exists(storage.delta(run_id, ack.will_merge_into))
    assert api.drain() == 1
    assert storage.read(storage.delta(run_id, ack.will_merge_into)) == body and not storage.exists(staged)
    # the same bytes again: the same answer, and no second file left behind
    again = api.upload(lease.lease_id, body, h)
    assert again.status_code == 202 and again.json()["duplicate"]
    assert _files(storage, run_id) == [f"{ack.will_merge_into:010d}.delta"]


def test_a_restart_merges_what_was_acknowledged_but_not_renamed(open_api, settings, run_config, make_delta):
    with open_api(settings) as api:
        api.create_run(run_config())
        h = api.register()
        sent = []
        for seed in range(2):
            lease = api.lease(h)
            body = make_delta(lease, seed=seed)
            sent.append((api.accept(lease.lease_id, body, h).will_merge_into, body))
        storage, run_id = api.coordinator.storage, api.runtime().run_id
        assert all(not storage.exists(storage.delta(run_id, seq)) for seq, _ in sent)  # not merged: still staged
    with open_api(settings) as api:  # a new process: the queue is in the database, the bytes staged
        assert api.drain() == 2
        assert api.runtime().version == 2
        for seq, body in sent:
            assert storage.read(storage.delta(run_id, seq)) == body
        assert not _staged(storage, run_id)


def test_a_different_body_for_a_delivered_lease_leaves_no_file(api, run, make_delta):
    h = api.register()
    lease = api.lease(h)
    first, second = make_delta(lease, seed=1), make_delta(lease, seed=2)
    api.accept(lease.lease_id, first, h)
    resp = api.upload(lease.lease_id, second, h)
    assert resp.status_code == 409
    storage, run_id = api.coordinator.storage, api.runtime().run_id
    assert [storage.read(name) for name in _staged(storage, run_id)] == [first]


def test_stale_staged_leftovers_go_and_a_waiting_one_stays(api, run, make_delta):
    coord = api.coordinator
    storage, run_id = coord.storage, api.runtime().run_id
    h = api.register()
    lease = api.lease(h)
    body = make_delta(lease, seed=5)
    api.accept(lease.lease_id, body, h)  # acknowledged, not merged yet: its staged file waits
    orphan = storage.staged_delta(run_id, 999_999, "ab" * 32)  # an upload that died before its row
    storage.write(orphan, b"never acknowledged")
    later = time.time() + coord.recovery.STAGED_KEEP_S + 1
    assert coord.recovery.drop_stale_staged(run_id, now=time.time()) == 0  # too recent: kept
    assert coord.recovery.drop_stale_staged(run_id, now=later) == 1
    assert not storage.exists(orphan) and len(_staged(storage, run_id)) == 1
    api.drain()
    # a retry's second copy of a delta already renamed: a leftover too
    storage.write(storage.staged_delta(run_id, lease.lease_id, hashlib.sha256(body).hexdigest()), body)
    assert coord.recovery.drop_stale_staged(run_id, now=later) == 1
    assert _files(storage, run_id) == ["0000000001.delta"]
    assert api.client.get(f"{API}/runs/t/status").status_code == 200
