"""The gpu convergence profile, which the tests cannot run: its size, its refusal without CUDA, its code path."""

from __future__ import annotations

import pytest
import torch

import bench.convergence as convergence
from bench.__main__ import main
from bench.convergence import PROFILES, Profile
from shared.model import build_model, count_params
from tests.bench.conftest import TINY


def test_the_gpu_profile_is_a_20_to_50m_model_on_cuda():
    p = PROFILES["gpu"]
    assert 20e6 <= count_params(build_model(p.model)) <= 50e6
    assert p.device == "cuda" and p.rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_the_gpu_profile_is_refused_with_what_to_do(capsys, tmp_path):
    assert main(["convergence", "--profile", "gpu", "--out", str(tmp_path)]) == 2
    assert "CUDA device" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_profile_runs_its_rows_on_its_device_with_its_batch(tmp_path, monkeypatch, one_torch_thread):
    """The gpu profile's path (rows, batch, device) on the CPU device, with a tiny model."""
    tiny = Profile(TINY, steps_per_worker=6, corpus_max_bytes=1 << 16, eval_tokens=1 << 10, lr=1e-2,
                   warmup_steps=2, H=3, batch_size=3, device="cpu", rows=("alone", "(default)"))
    monkeypatch.setitem(PROFILES, "tiny-device", tiny)
    rows = convergence.run(profile="tiny-device", out=tmp_path, workers=2)
    assert [r["method"].split(" ")[0] for r in rows] == ["ddp", "1", "diloco"]
    tokens = 2 * 6 * 3 * TINY.context  # workers x steps x batch x context
    assert rows[0]["curve"][-1][0] == tokens and rows[2]["curve"][-1][0] == tokens
