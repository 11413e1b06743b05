"""A worker's round on a CUDA device (fp32, and bf16 autocast: a CUDA worker's default) against the same
round on the CPU, for a short run's defaults (AdamW, int4) and a long run's (AdamW normalised for 8 workers,
int1): the delta sent points the same way and lowers the loss when applied. Skipped without CUDA (CI has
none); self-contained, so it runs on a machine that has only the worker's packages:
`python -m pytest --noconftest -p no:cacheprovider -n 0 tests/worker/test_round_on_cuda.py`."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import torch

from shared import codec, protocol
from shared.config import RunConfig
from shared.model import ModelConfig, build_model, evaluate_loss, get_params, param_schema, set_params
from worker.fit import FitOptions
from worker.trainer import LocalTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODEL = ModelConfig(n_layer=2, n_head=4, d_model=64, context=64)
SCHEMA = param_schema(build_model(MODEL))
LONG_PLAN = 600 * 8 * 8 * MODEL.context  # 600 local steps a worker for 8 workers of 8 sequences


def regime_lease(regime: str) -> protocol.Lease:
    cfg = RunConfig.model_validate({"name": "t", "regime": regime, "schedule_tokens": LONG_PLAN, "model": MODEL,
                                    "inner": {"batch_size": 8, "warmup_steps": 0}, "outer": {"group": 8}})
    inner = cfg.inner.model_copy(update={"steps": 24})
    return protocol.Lease(lease_id=1, run="t", shard_id=0, shard_sha256="0" * 64, base_version=0, seed=3,
                          lr=cfg.inner.lr, inner=inner, compression=cfg.compression, model=MODEL.to_dict(),
                          deadline=datetime(2030, 1, 1, tzinfo=timezone.utc))


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    text = (b"def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
            b"        self.x, self.y = x, y\n") * 120
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def sent(trainer: LocalTrainer, lease: protocol.Lease, base: dict, tokens: torch.Tensor) -> torch.Tensor:
    body = trainer.train_round(lease, base, tokens).body
    dense = codec.decode(body, schema=SCHEMA).to_dense(SCHEMA)
    return torch.cat([torch.from_numpy(dense[n]).flatten() for n in sorted(SCHEMA)])


@pytest.mark.parametrize("regime", ["short", "long"])
# measured on an H200: fp32 1.0000 / 0.9998 (short / long), bf16 autocast 0.9993 / 0.9953 (the CPU under bf16:
# 0.999 / 0.996)
@pytest.mark.parametrize("precision, min_cosine", [("fp32", 0.99), ("auto", 0.97)])
def test_a_cuda_round_sends_what_the_cpu_round_sends(tokens, regime, precision, min_cosine):
    lease = regime_lease(regime)
    assert (lease.compression.values, lease.inner.second_moment_workers) == (
        ("int1", 8) if regime == "long" else ("int4", 1))
    base = get_params(build_model(MODEL, seed=0))
    on_cpu = sent(LocalTrainer(torch.device("cpu")), lease, base, tokens)
    on_cuda = sent(LocalTrainer(torch.device("cuda"), fit=FitOptions(precision=precision)), lease, base, tokens)
    cosine = torch.nn.functional.cosine_similarity(on_cpu, on_cuda, dim=0).item()
    ratio = (on_cuda.norm() / on_cpu.norm()).item()
    print(f"{regime} {precision}: cosine {cosine:.4f}, norm ratio {ratio:.4f}")
    assert cosine >= min_cosine and 0.8 <= ratio <= 1.25
    model = build_model(MODEL)
    flat = {n: on_cuda[o:o + base[n].numel()].view_as(base[n]) for n, o in _offsets(base).items()}
    set_params(model, base)
    before = evaluate_loss(model, tokens, context=MODEL.context)
    set_params(model, {n: base[n] - flat[n] for n in base})  # the pseudo-gradient is base - local
    assert evaluate_loss(model, tokens, context=MODEL.context) < before - 0.1


def _offsets(base: dict) -> dict[str, int]:
    out, at = {}, 0
    for n in sorted(SCHEMA):
        out[n], at = at, at + base[n].numel()
    return out
