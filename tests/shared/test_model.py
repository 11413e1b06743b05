"""The transformer and its parameter plumbing (shared/model.py)."""

from __future__ import annotations

import math

import pytest
import torch

from shared.model import (
    ModelConfig, build_model, count_params, evaluate_loss, get_params, meta_schema, param_schema, set_params,
)

TINY = ModelConfig(n_layer=1, d_model=32, n_head=2, context=16)


@pytest.mark.parametrize("kwargs,match", [
    ({"n_layer": 0}, "n_layer must be a positive integer"),
    ({"d_model": -32}, "d_model must be a positive integer"),
    ({"context": 2.5}, "context must be a positive integer"),
    ({"n_head": "4"}, "n_head must be a positive integer"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"d_model": 30, "n_head": 4}, "divisible by n_head"),
    ({"vocab_size": (1 << 22) + 1}, "above the limit"),  # above 65,536 shards are uint32
    ({"dropout": 1.0}, "dropout must be in"),
    ({"dropout": -0.1}, "dropout must be in"),
])
def test_model_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_model_config_dict_round_trip():
    cfg = ModelConfig(n_layer=2, d_model=64, n_head=4, context=32, dropout=0.1, vocab_size=65536)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown model config keys: \['n_embd'\]"):
        ModelConfig.from_dict({"n_embd": 3})


def test_build_model_is_deterministic_by_seed():
    a, b, c = build_model(TINY, seed=1), build_model(TINY, seed=1), build_model(TINY, seed=2)
    pa, pb, pc = get_params(a), get_params(b), get_params(c)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert any(not torch.equal(pa[n], pc[n]) for n in pa if pa[n].std() > 0)


def test_build_model_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(TINY, seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_schema_and_weight_tying():
    model = build_model(TINY)
    schema = param_schema(model)
    assert list(schema) == [n for n, _ in model.named_parameters()]
    assert schema["wte.weight"] == (256, 32) and schema["wpe.weight"] == (16, 32)
    assert not any("head" in n for n in schema)  # the output head is the embedding
    assert count_params(model) == sum(math.prod(s) for s in schema.values())


def test_get_params_returns_copies_not_aliases():
    model = build_model(TINY, seed=0)
    params = get_params(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for t in params.values():
        assert t.dtype == torch.float32 and t.device.type == "cpu" and not t.requires_grad
        t.add_(1.0)  # mutating the copy...
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n])  # ...leaves the model alone
    params2 = get_params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.0)  # and training the model leaves an earlier copy alone
    assert all(params2[n].abs().sum() > 0 for n in params2 if "weight" in n and "ln" not in n)


def test_set_params_copies_values_in():
    model = build_model(TINY, seed=0)
    other = get_params(build_model(TINY, seed=9))
    set_params(model, other)
    got = get_params(model)
    assert all(torch.equal(got[n], other[n]) for n in other)
    for t in other.values():
        t.add_(5.0)  # no aliasing in this direction either
    assert all(torch.equal(get_params(model)[n], got[n]) for n in got)


def test_set_params_rejects_wrong_names_and_shapes():
    model = build_model(TINY, seed=0)
    params = get_params(model)
    missing = dict(params)
    missing.pop("wpe.weight")
    with pytest.raises(ValueError, match=r"missing \['wpe.weight'\]"):
        set_params(model, missing)
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        set_params(model, {**params, "extra": torch.zeros(1)})
    bad = dict(params)
    bad["wpe.weight"] = torch.zeros(17, 32)
    with pytest.raises(ValueError, match=r"wpe.weight: shape \(17, 32\) != model \(16, 32\)"):
        set_params(model, bad)


def test_evaluate_loss_of_a_fresh_model_is_near_uniform():
    model = build_model(TINY, seed=0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2000,), generator=g, dtype=torch.int64).to(torch.uint8)
    model.train()
    loss = evaluate_loss(model, tokens, context=16, batch_size=16)
    assert loss == pytest.approx(math.log(256), abs=0.1)  # 5.545 nats: nothing learnt yet
    assert model.training  # mode restored
    assert evaluate_loss(model, tokens, context=16, max_sequences=3) == pytest.approx(
        evaluate_loss(model, tokens[:3 * 16 + 1], context=16))


def test_evaluate_loss_needs_one_window():
    model = build_model(TINY)
    with pytest.raises(ValueError, match="shorter than one context window"):
        evaluate_loss(model, torch.zeros(16, dtype=torch.uint8), context=16)


def test_forward_shapes_and_context_limit():
    model = build_model(TINY)
    x = torch.randint(0, 256, (3, 16))
    logits, loss = model(x)
    assert logits.shape == (3, 16, 256) and loss is None
    _, loss = model(x, x)
    assert loss.ndim == 0 and torch.isfinite(loss)
    with pytest.raises(ValueError, match="exceeds the model context 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_model_is_causal():
    model = build_model(TINY, seed=3).eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(x)[0], model(y)[0]
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("cfg", [ModelConfig(), ModelConfig(n_layer=1, n_head=2, d_model=32, context=32),
                                 ModelConfig(n_layer=2, n_head=4, d_model=64, context=64, vocab_size=300)])
def test_n_params_without_building(cfg):
    assert cfg.n_params() == count_params(build_model(cfg))


@pytest.mark.parametrize("kw", [{"n_layer": 100_000}, {"context": 1 << 21},
                                {"n_layer": 500, "d_model": 65536, "n_head": 64}])
def test_absurd_model_configs_are_refused_before_anything_is_built(kw):
    with pytest.raises(ValueError, match="out of range|above the limit"):
        ModelConfig(**kw)


@pytest.mark.parametrize("cfg", [TINY, ModelConfig(), ModelConfig(n_layer=2, n_head=4, d_model=64, vocab_size=300)])
def test_meta_schema_is_the_built_model_schema(cfg):
    assert meta_schema(cfg) == param_schema(build_model(cfg))
    assert list(meta_schema(cfg)) == list(param_schema(build_model(cfg)))  # same order: what deltas follow


def test_meta_schema_of_a_huge_model_allocates_nothing(monkeypatch):
    """1.6B parameters (6.4 GB in fp32): any real allocation of a parameter fails the test."""
    cfg = ModelConfig(n_layer=48, n_head=26, d_model=1664, context=1024)
    real = torch.nn.Parameter.__new__

    def meta_only(cls, data=None, requires_grad=True):
        assert data is None or data.device.type == "meta", "a parameter was allocated for real"
        return real(cls, data, requires_grad)

    monkeypatch.setattr(torch.nn.Parameter, "__new__", meta_only)
    assert sum(math.prod(s) for s in meta_schema(cfg).values()) == cfg.n_params()
