"""A worker's round on the Llama-style model (arch "llama"): the same pipeline as the GPT's (build,
inner steps, pseudo-gradient, compression, the wire format), and the worker's fit options on it."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import torch

from shared import codec, protocol
from shared.config import CompressionConfig, InnerConfig
from shared.model import ModelConfig, build_model, evaluate_loss, get_params, param_schema, set_params
from worker.fit import FitOptions
from worker.trainer import LocalTrainer

LLAMA = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, d_model=32, context=32, vocab_size=256,
                    tie_embeddings=False)
SCHEMA = param_schema(build_model(LLAMA))


def lease(seed: int = 1, steps: int = 8) -> protocol.Lease:
    return protocol.Lease(
        lease_id=seed, run="t", shard_id=0, shard_sha256="0" * 64, base_version=0, seed=seed, lr=3e-3,
        inner=InnerConfig(steps=steps, batch_size=4, warmup_steps=0),
        compression=CompressionConfig(index="topk", fraction=0.5, values="fp32"),
        model=LLAMA.to_dict(), deadline=datetime(2030, 1, 1, tzinfo=timezone.utc))


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    text = b"the quick brown fox jumps over the lazy dog, again and again. " * 80
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def test_a_llama_round_sends_a_delta_that_lowers_the_loss_when_applied(tokens):
    base = get_params(build_model(LLAMA, seed=0))
    result = LocalTrainer(torch.device("cpu")).train_round(lease(steps=12), base, tokens)
    delta = codec.decode(result.body, schema=SCHEMA)
    assert {e.name for e in delta.entries} == set(SCHEMA) and "lm_head.weight" in SCHEMA
    sent = {n: torch.from_numpy(a) for n, a in delta.to_dense(SCHEMA).items()}
    model = build_model(LLAMA)
    set_params(model, base)
    before = evaluate_loss(model, tokens, context=LLAMA.context)
    set_params(model, {n: base[n] - sent[n] for n in base})  # the pseudo-gradient is base - local
    assert evaluate_loss(model, tokens, context=LLAMA.context) < before - 0.1


def test_activation_checkpointing_gives_the_same_llama_round(tokens):
    base = get_params(build_model(LLAMA, seed=0))
    plain = LocalTrainer(torch.device("cpu")).train_round(lease(), base, tokens)
    ckpt = LocalTrainer(torch.device("cpu"), fit=FitOptions(activation_checkpointing=True)).train_round(
        lease(), base, tokens)
    assert len(plain.losses) == len(ckpt.losses)
    assert plain.losses == pytest.approx(ckpt.losses, rel=1e-5, abs=1e-6)
