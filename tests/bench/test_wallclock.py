"""`bench wallclock`: PowerSGD's math, compressed ddp, the clock, the report, and a tiny run end to end."""

from __future__ import annotations

import json

import pytest
import torch

from bench.__main__ import main
from bench.links import Link
from bench.powersgd import PowerSGD
from bench.sim import Method, Setup, run_method
from bench.wallclock import LR_FACTORS, run
from bench.wallclock_clock import Compute, RowTraffic, curve_on_links
from bench.wallclock_ddp import run_compressed_ddp
from bench.wallclock_report import captured, loss_at, time_to
from shared.model import build_model, count_params
from tests.bench.conftest import TINY, tiny_setup


@pytest.fixture(scope="module")
def setup() -> Setup:
    return tiny_setup(6)


def test_powersgd_is_exact_for_a_low_rank_mean():
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(20, 2, generator=gen)
    grads = [{"w": u @ torch.randn(2, 12, generator=gen), "b": torch.randn(12, generator=gen)} for _ in range(3)]
    comp = PowerSGD({"w": (20, 12), "b": (12,)}, rank=2, workers=3)
    out = comp.step(grads)
    mean_w = torch.stack([g["w"] for g in grads]).mean(0)
    assert torch.allclose(out["w"], mean_w, atol=1e-5)
    assert torch.equal(out["b"], torch.stack([g["b"] for g in grads]).mean(0))  # vectors: sent whole
    # each worker keeps what the mean did not carry of its own gradient; together nothing is lost
    assert torch.allclose(sum(r["w"] for r in comp.residual), torch.zeros(20, 12), atol=1e-5)
    assert comp.bytes_per_step == 4 * ((20 + 12) * 2 + 12)  # P (20, 2) and Q (12, 2) in fp32, b whole


def test_powersgd_error_feedback_loses_nothing_over_steps():
    """sum of what was applied + the workers' mean residual = sum of the mean gradients."""
    gen = torch.Generator().manual_seed(2)
    comp = PowerSGD({"w": (16, 10)}, rank=1, workers=2)
    applied, total = torch.zeros(16, 10), torch.zeros(16, 10)
    for _ in range(5):
        grads = [{"w": torch.randn(16, 10, generator=gen)} for _ in range(2)]
        total += (grads[0]["w"] + grads[1]["w"]) / 2
        applied += comp.step(grads)["w"]
    assert not torch.allclose(applied, total, atol=1e-2)  # rank 1 of full-rank noise: much held back
    residual = (comp.residual[0]["w"] + comp.residual[1]["w"]) / 2
    assert torch.allclose(applied + residual, total, atol=1e-4)


def test_powersgd_sends_small_matrices_whole():
    comp = PowerSGD({"w": (3, 3)}, rank=2, workers=1)  # (3 + 3) x 2 = 12 values > 9
    assert not comp.low_rank and comp.bytes_per_step == 36
    with pytest.raises(ValueError):
        PowerSGD({"w": (3, 3)}, rank=0, workers=1)


def test_uncompressed_path_is_the_simulators_ddp(setup):
    """PowerSGD at a rank no matrix gains from sends everything whole: the mean of the workers' rows'
    gradients is the combined batch's, so the run is bench/sim.py's ddp up to float rounding."""
    ours = run_compressed_ddp(setup, "whole", compressor="powersgd", rank=1000)
    ddp = run_method(setup, Method("ddp", "ddp"))
    assert [t for t, _ in ours.result.curve] == [t for t, _ in ddp.curve]
    assert [loss for _, loss in ours.result.curve] == pytest.approx([loss for _, loss in ddp.curve], abs=2e-4)
    n = count_params(build_model(TINY))
    assert ours.payload_bytes_per_step == 4 * n
    assert ours.result.bytes_up_per_worker == pytest.approx(2 * 2 / 3 * 4 * n * setup.steps_per_worker)


def test_int8_ddp_counts_encoded_bytes(setup):
    out = run_compressed_ddp(setup, "int8", compressor="int8")
    n = count_params(build_model(TINY))
    # about a byte a value (plus scales, envelope; zstd in the envelope takes some off), against 4 in fp32
    assert n // 4 < out.payload_bytes_per_step < 2 * n
    assert out.allreduces == 1 and out.compress_s_per_step > 0
    assert out.result.eval_loss < out.result.curve[0][1]
    with pytest.raises(ValueError):
        run_compressed_ddp(setup, "x", compressor="fp8")


def test_the_clock_of_each_pattern():
    compute = Compute(step_s=0.1, tokens_per_step=100, workers=2)
    fast = [Link(1e12, 1e12, 0.0)] * 2
    ddp = curve_on_links([(0, 5.0), (2000, 4.0)], "ddp", RowTraffic(payload_bytes_per_step=8), compute, fast,
                         coordinator=None)
    assert ddp["curve"] == [(0.0, 5.0), (pytest.approx(1.0), 4.0)]  # 10 steps of 2 x 100 tokens, 0.1 s each
    alone = curve_on_links([(0, 5.0), (1000, 4.5)], "alone", RowTraffic(), compute, fast, coordinator=None)
    assert alone["curve"] == [(0.0, 5.0), (pytest.approx(1.0), 4.5)]
    # worker rounds: H = 10 steps (1 s), 2 rounds; uploads of 0.5 s hidden but the last
    rtt0 = [Link(8e6, 8e6, 0.0)] * 2
    traffic = RowTraffic(rounds=2, H=10, delta_bytes_up=2 * (500_000 - 500), update_bytes_down=0)
    w = curve_on_links([(0, 5.0), (2000, 4.2), (4000, 4.0)], "worker", traffic, compute, rtt0, coordinator=None)
    lease = 2 * 8 * 500 / 8e6  # a lease request: headers both ways, 1 ms
    upload = 8 * 500_000 / 8e6 + 8 * 500 / 8e6  # 0.5 s with its headers, and the answer's headers
    # both workers deliver round 0 at lease + 1 s + upload; round 1's base came during round 0
    assert [t for t, _ in w["curve"]] == pytest.approx([0.0, lease + 1 + upload, lease + 2 + upload])


def test_report_numbers():
    curve = [(0.0, 5.0), (10.0, 4.0), (20.0, 3.0)]
    assert loss_at(curve, 5.0) == 4.5 and loss_at(curve, 99.0) == 3.0 and loss_at(curve, -1) == 5.0
    assert time_to(curve, 3.5) == 15.0 and time_to(curve, 2.0) is None and time_to(curve, 6.0) == 0.0
    assert captured(3.0, 2.5, 2.0) == 0.5 and captured(3.0, 2.5, 3.1) is None


def test_tiny_profile_end_to_end(tmp_path):
    results = run(profile="tiny", out=tmp_path, up_mbps=(10.0, 1000.0), only=["default"], threads=1)
    names = [r["row"] for r in results["rows"]]
    assert len(names) == 3 and names[0].startswith("ddp fp32") and names[2].endswith("(default)")
    for r in results["rows"]:
        assert [x["lr"] for x in r["runs"]] == pytest.approx([1e-2 * f for f in LR_FACTORS])
        assert r["final_loss"] == min(x["final_loss"] for x in r["runs"])
        assert len(r["runs"][0]["clock"]) == 3  # two link speeds and the datacenter
    slow, fast, datacenter = results["panels"]
    assert datacenter["links"] == "10000/10000 Mbit/s, 0.05 ms"
    ddp_slow, ddp_fast = slow["rows"][0], fast["rows"][0]
    assert ddp_slow["finish_s"] > ddp_fast["finish_s"]  # the same training, a slower link
    assert json.loads((tmp_path / "results.json").read_text())["targets"] == results["targets"]
    assert "| ddp fp32" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "wallclock.png").read_bytes()[:4] == b"\x89PNG"


def test_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["wallclock", "--help"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m bench wallclock")


@pytest.mark.parametrize("argv", [["--rank", "0"], ["--up-mbps", "0"], ["--hetero", "0.5"], ["--workers", "1"],
                                  ["--profile", "nope"], ["--threads", "0"], ["--step-ms", "0"]])
def test_bad_options_say_what_to_do(argv, capsys):
    assert main(["wallclock", *argv]) == 2
    assert capsys.readouterr().err.strip()
