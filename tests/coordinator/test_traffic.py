"""coordinator/traffic.py: bytes counted in memory, written in one transaction; nothing counted twice or lost."""

from __future__ import annotations

import pytest

from coordinator.traffic import TrafficCounter
from tests.conftest import API


def test_counts_add_up_and_take_empties():
    t = TrafficCounter()
    t.add(2, 7, down_data=10)
    t.add(1, up=5, down_model=3)
    t.add(2, 7, up=1, down_model=4)
    runs, workers = t.take()
    assert list(runs) == [1, 2] and runs == {1: [5, 3, 0], 2: [1, 4, 10]}
    assert workers == {7: [1, 14]}
    assert t.take() == ({}, {})


def test_a_failed_write_is_counted_again():
    t = TrafficCounter()
    t.add(1, 3, up=2, down_data=5)
    runs, workers = t.take()
    t.add(1, 3, down_model=1)
    t.put_back(runs, workers)
    assert t.take() == ({1: [2, 1, 5]}, {3: [2, 6]})


def test_downloads_reach_the_database_once(api, run, make_delta):
    headers = api.register()
    lease = api.lease(headers)
    before = api.status()
    shard = api.client.get(f"{API}/runs/t/shards/{lease.shard_id}", headers=headers)
    snap = api.client.get(f"{API}/runs/t/snapshots/0")
    after = api.status()  # a read writes what was counted first
    assert after["bytes_down_data"] - before["bytes_down_data"] == len(shard.content)
    assert after["bytes_down_model"] - before["bytes_down_model"] == len(snap.content)
    api.coordinator.traffic.flush()  # nothing left to write twice
    assert api.status()["bytes_down"] == after["bytes_down"]
    (w,) = api.operator("get", f"{API}/runs/t/workers").json()
    assert w["bytes_down"] == len(shard.content)


def test_a_database_error_keeps_the_counts(api, run, monkeypatch):
    api.coordinator.traffic.add(1, down_data=123)

    def broken():
        raise RuntimeError("database away")

    monkeypatch.setattr(api.coordinator.db, "begin", broken)
    with pytest.raises(RuntimeError):
        api.coordinator.traffic.flush()
    monkeypatch.undo()
    assert api.coordinator.traffic.take()[0] == {1: [0, 0, 123]}
