"""The worker's kept start states: written before a round, named by lease, the newest few kept, a wanted
one kept until sent (across a restart: it is on disk), dropped when the coordinator no longer wants it
and kept when the coordinator is away."""

from __future__ import annotations

import hashlib

import httpx
from types import SimpleNamespace

import pytest

from worker.answers import CoordinatorError
from worker.start_states import StartStates


class Coordinator:
    def __init__(self, answer=None) -> None:
        self.answer, self.got = answer, []

    def upload_start_state(self, lease_id: int, blob: bytes, *, exchanges_applied: str | None = None) -> None:
        if isinstance(self.answer, BaseException):
            raise self.answer
        self.got.append((lease_id, blob))
        self.applied = getattr(self, "applied", []) + [(lease_id, exchanges_applied)]


def test_the_newest_states_are_kept_and_committed_to_by_their_hash(tmp_path):
    starts = StartStates(tmp_path / "starts")
    for lease_id in range(1, 8):
        starts.keep(lease_id, b"state %d" % lease_id)
    assert sorted(int(p.stem) for p in (tmp_path / "starts").glob("*.st")) == [4, 5, 6, 7]
    assert starts.commitment(7) == (hashlib.sha256(b"state 7").hexdigest(), 7)
    assert StartStates(tmp_path / "starts").commitment(6) == (hashlib.sha256(b"state 6").hexdigest(), 7)  # restart
    assert starts.commitment(1) is None


def test_a_wanted_state_survives_pruning_and_a_restart_then_goes_once(tmp_path):
    starts = StartStates(tmp_path / "starts")
    starts.keep(1, b"first")
    starts.want(1)
    for lease_id in range(2, 9):
        starts.keep(lease_id, b"later")
    again = StartStates(tmp_path / "starts")  # a restarted worker
    assert again.wanted() == [1]
    coord = Coordinator()
    assert again.send_wanted(coord) == 1 and coord.got == [(1, b"first")]
    assert again.wanted() == [] and again.commitment(1) is None
    assert again.send_wanted(coord) == 0


@pytest.mark.parametrize("answer, kept", [
    (httpx.ConnectError("down"), True),
    (CoordinatorError(503, "restarting"), True),
    (CoordinatorError(404, "not wanted"), False),
    (CoordinatorError(409, "not the committed bytes"), False),
])
def test_the_coordinator_away_keeps_it_and_a_refusal_drops_it(tmp_path, answer, kept):
    starts = StartStates(tmp_path / "starts")
    starts.keep(3, b"state")
    starts.want(3)
    assert starts.send_wanted(Coordinator(answer)) == 0
    assert starts.wanted() == ([3] if kept else [])


def test_a_state_asked_for_after_it_was_pruned_is_said_and_not_marked(tmp_path, caplog):
    starts = StartStates(tmp_path / "starts")
    starts.want(9)
    assert starts.wanted() == [] and "gone" in caplog.text


def test_a_sparta_rounds_corrections_go_with_its_state_and_then_go(tmp_path):
    starts = StartStates(tmp_path / "starts")
    starts.keep(3, b"state 3")
    starts.keep(4, b"state 4")
    def sparta(lease_id: int, algorithm: str = "sparta"):
        return SimpleNamespace(lease_id=lease_id, algorithm=algorithm)

    starts.note_exchanges(sparta(3), SimpleNamespace(resumed_at=0, exchanges_applied_at={2: 3, 4: 7}))
    starts.note_exchanges(sparta(9), SimpleNamespace(resumed_at=0, exchanges_applied_at={2: 3}))  # no state kept
    starts.note_exchanges(sparta(4, "diloco"), SimpleNamespace(resumed_at=0, exchanges_applied_at={}))
    starts.want(3)
    starts.want(4)
    coord = Coordinator()
    assert starts.send_wanted(coord) == 2
    assert coord.applied == [(3, "0;2:3,4:7"), (4, None)]
    assert not list((tmp_path / "starts").glob("*.ex"))
