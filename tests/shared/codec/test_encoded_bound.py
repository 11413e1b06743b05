"""codec.encoded_bound and the bounds built on it: never below what encode() really returns."""

from __future__ import annotations

import math

import pytest
import torch

from shared import codec
from shared.algorithms.compress import compress, round_bound
from shared.algorithms.sparta import exchange_bound, select
from shared.config import CompressionConfig
from shared.model import ModelConfig, build_model, get_params, meta_schema

MODEL = ModelConfig(n_layer=1, n_head=2, d_model=32, context=32)


@pytest.mark.parametrize("index,fraction", [("dense", 1.0), ("topk", 0.1), ("random", 0.05), ("topk", 1.0)])
@pytest.mark.parametrize("values", ["fp32", "fp16", "int8", "int4", "int2", "int1"])
def test_a_rounds_delta_never_exceeds_its_bound(index, fraction, values):
    cfg = CompressionConfig(index=index, fraction=fraction, values=values, error_feedback=False)
    torch.manual_seed(0)  # random values: zstd cannot shrink them, the worst case for the bound
    grads = {n: torch.randn(p.shape) for n, p in build_model(MODEL).named_parameters()}
    size = len(codec.encode(compress(grads, cfg, base_version=7, round_seed=3)))
    bound = round_bound(meta_schema(MODEL), cfg)
    assert size <= bound, (size, bound)
    assert bound <= 2 * size + 1024, (size, bound)  # zstd shrinks random floats a little; never by half


@pytest.mark.parametrize("values", ["fp32", "fp16", "int8"])
def test_an_exchange_never_exceeds_its_bound(values):
    params = {n: torch.randn(t.shape) for n, t in get_params(build_model(MODEL)).items()}
    size = len(codec.encode(select(params, p=0.01, seed=5, values=values)))
    assert size <= exchange_bound(meta_schema(MODEL), p=0.01, values=values)


def test_the_bound_grows_with_the_model():
    small, big = MODEL, ModelConfig(n_layer=4, n_head=4, d_model=128, context=128)
    cfg = CompressionConfig()
    assert round_bound(meta_schema(big), cfg) > 8 * round_bound(meta_schema(small), cfg)
    # dense fp32 is the model's own size and a bit: 4 bytes a parameter
    fp32 = CompressionConfig(values="fp32")
    n = sum(math.prod(s) for s in meta_schema(big).values())
    assert 4 * n < round_bound(meta_schema(big), fp32) < 4.1 * n
