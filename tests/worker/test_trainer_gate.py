"""worker.trainer's gate between local steps: a pause saves the round before waiting, a "no"
suspends it, and resuming from that save gives the uninterrupted round's delta."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import pytest
import torch

from shared import protocol
from shared.config import CompressionConfig, InnerConfig
from shared.model import ModelConfig, build_model, get_params
from worker.state import TrainerState
from worker.trainer import LocalTrainer, RoundSuspended

MODEL = ModelConfig(n_layer=1, d_model=32, n_head=2, context=32)


def make_lease(steps: int = 6) -> protocol.Lease:
    return protocol.Lease(
        lease_id=3, run="t", shard_id=0, shard_sha256="0" * 64, base_version=0, seed=5, lr=3e-3,
        inner=InnerConfig(steps=steps, batch_size=4, warmup_steps=0),
        compression=CompressionConfig(index="topk", fraction=0.1, values="int8"),
        model=MODEL.to_dict(), deadline=datetime(2030, 1, 1, tzinfo=timezone.utc))



@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    text = b"the quick brown fox jumps over the lazy dog, again and again. " * 80
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def base() -> dict[str, torch.Tensor]:
    return get_params(build_model(MODEL, seed=0))


def test_the_gate_runs_between_steps_and_a_no_suspends_after_saving(tokens):
    saved: list[TrainerState] = []
    asked: list[int] = []

    def gate(step: int, save) -> bool:
        asked.append(step)
        if step == 4:
            save()
            save()  # asking twice saves once
            return False
        return True

    tr = LocalTrainer(torch.device("cpu"))
    with pytest.raises(RoundSuspended) as info:
        tr.train_round(make_lease(), base(), tokens, checkpoint=saved.append, checkpoint_every=2, gate=gate)
    assert (info.value.lease_id, info.value.step) == (3, 4)
    assert asked == [1, 2, 3, 4]
    # the periodic checkpoint at 2 and 4; the gate's save at 4 found it done
    assert [s.round.step for s in saved] == [2, 4]

    resumed = LocalTrainer(torch.device("cpu"))
    resumed.restore_state(saved[-1])
    result = resumed.train_round(make_lease(), None, tokens, resume=saved[-1].round)
    whole = LocalTrainer(torch.device("cpu")).train_round(make_lease(), base(), tokens)
    assert result.body == whole.body and result.losses == whole.losses


def test_a_paused_gate_is_not_training_time(tokens):
    def gate(step: int, save) -> bool:
        save()
        time.sleep(0.3)  # paused
        return True

    saved: list[TrainerState] = []
    tr = LocalTrainer(torch.device("cpu"))
    t0 = time.perf_counter()
    result = tr.train_round(make_lease(steps=3), base(), tokens, checkpoint=saved.append, gate=gate)
    wall = time.perf_counter() - t0
    assert [s.round.step for s in saved] == [1, 2]  # never after the last step: the round's end saves itself
    assert 0 < result.seconds <= wall - 0.6  # the two pauses of 0.3 s are left out
    assert len(result.losses) == 3
