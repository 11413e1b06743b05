"""A delta found false after it merged is taken back: a failed spot-check queues its compensation,
the merger applies it just before the next version (FlatOuter.compensate), and a restart's replay does
the same at the same place. Real worker rounds reach the in-process coordinator over its HTTP
interface; the false one is another lease's honest round (test_spotcheck.ForeignTrainer)."""

from __future__ import annotations

import pytest
import torch

from coordinator import checkpoints
from coordinator.models import Compensation, DeltaRecord, SpotCheck
from coordinator.services.spotchecks import copy_name
from shared import codec
from tests.coordinator.test_spotcheck import ForeignTrainer, run_worker

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def settings(settings):
    return settings.model_copy(update={"spot_check_rate": 1.0, "allowed_hosts": ["coordinator.test"]})


def weights(api) -> torch.Tensor:
    rt = api.runtime()
    with rt.lock:
        return rt.outer.weights_flat().clone()


def stored_delta(api, seq: int) -> torch.Tensor:
    rt = api.runtime()
    blob = rt.storage.read(rt.storage.delta(rt.run_id, seq))
    flat = codec.decode_flat(blob, schema=rt.schema, offsets=rt.outer.offsets)
    out = torch.zeros(rt.outer.n)
    if flat.values.size:
        out.index_add_(0, torch.from_numpy(flat.indices), torch.from_numpy(flat.values.astype("float32")))
    for off, v in flat.dense:
        out[off:off + len(v)] += torch.from_numpy(v.astype("float32"))
    return out


def test_a_merged_delta_that_fails_its_check_is_taken_back_before_the_next_version(api, run_config, tmp_path,
                                                                                  monkeypatch):
    # momentum 0, one delta a group: each version moves the weights by exactly -applied * its values
    api.create_run(run_config(outer={"group": 1, "momentum": 0.0, "lookahead": False}))
    run_worker(api, tmp_path, "honest", 1)
    after_honest = weights(api)
    run_worker(api, tmp_path, "foreign", 1, ForeignTrainer(torch.device("cpu")))
    with api.db() as s:
        false = s.query(DeltaRecord).filter_by(seq=2).one()
        assert false.outcome == "merged" and false.applied > 0  # the screens let it through
    assert not torch.equal(weights(api), after_honest)
    coord, rt = api.coordinator, api.runtime()
    assert coord.spotchecks.run_pending() == 2
    with api.db() as s:
        assert {c.lease_id: c.verdict for c in s.query(SpotCheck)} == {1: "passed", 2: "failed"}
        (comp,) = s.query(Compensation).all()
        assert (comp.seq, comp.before_version, comp.applied) == (2, None, false.applied)
        assert "spot-check" in comp.reason and "lease 2" in comp.reason
    assert coord.storage.exists(coord.storage.compensation(rt.run_id, 2))  # its bytes outlive the check's copy
    assert not coord.storage.exists(copy_name(coord.storage, rt.run_id, 2, false.sha256))
    assert coord.spotchecks.run_pending() == 0 and api.drain() == 0  # nothing merges: it waits for a delta

    run_worker(api, tmp_path, "honest", 1)  # version 3, from a base that held the false delta
    with api.db() as s:
        assert s.query(Compensation).one().before_version == 3
        third = s.query(DeltaRecord).filter_by(seq=3).one()
    assert third.outcome == "merged"
    assert api.client.get("/api/v1/runs/t/status").json()["compensated_deltas"] == 1
    # as if delta 2 had never merged: version 3 is version 1 moved by delta 3 alone
    expected = after_honest - third.applied * stored_delta(api, 3)
    torch.testing.assert_close(weights(api), expected, rtol=1e-5, atol=1e-6)

    # a restart replays it where the merger applied it, bit for bit (from the creation's checkpoint)
    live = weights(api)
    assert [v for v, _ in coord.storage.list_checkpoints(rt.run_id)] == [0]
    coord.recovery.reload_run(rt.run_id)
    assert torch.equal(weights(api), live)
    run_worker(api, tmp_path, "honest", 1)  # taken back once only
    with api.db() as s:
        assert s.query(Compensation).one().before_version == 3

    # once every kept checkpoint holds it, its bytes go with the merged deltas'
    monkeypatch.setattr(checkpoints, "KEPT", 1)
    rt = api.runtime()
    with rt.lock:
        checkpoints.write(rt)
    coord.recovery.prune_history(rt)
    assert not coord.storage.exists(coord.storage.compensation(rt.run_id, 2))


def test_a_compensation_whose_bytes_are_gone_is_recorded_lost_not_guessed(api, run_config, tmp_path, caplog):
    api.create_run(run_config())
    run_worker(api, tmp_path, "foreign", 1, ForeignTrainer(torch.device("cpu")))
    coord, rt = api.coordinator, api.runtime()
    assert coord.spotchecks.run_pending() == 1
    coord.storage.delete(coord.storage.compensation(rt.run_id, 1))
    before = weights(api)
    run_worker(api, tmp_path, "honest", 1)
    with api.db() as s:
        assert s.query(Compensation).one().before_version == 0  # compensations.LOST
    assert "cannot be compensated" in caplog.text
    assert not torch.equal(weights(api), before)  # the next delta merged all the same


def test_a_rejected_delta_that_fails_its_check_has_nothing_to_take_back(api, run_config, tmp_path):
    from tests.coordinator.test_spotcheck import ZeroTrainer

    api.create_run(run_config())
    run_worker(api, tmp_path, "zeros", 1, ZeroTrainer(torch.device("cpu")))
    assert api.coordinator.spotchecks.run_pending() == 1
    with api.db() as s:
        assert s.query(SpotCheck).one().verdict == "failed"
        assert s.query(DeltaRecord).one().outcome == "rejected"
        assert s.query(Compensation).count() == 0
    rt = api.runtime()
    assert not api.coordinator.storage.exists(api.coordinator.storage.compensation(rt.run_id, 1))
